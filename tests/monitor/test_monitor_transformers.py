"""MemoryMonitorCallback in a real (CPU) Hugging Face Trainer: a few steps of a tiny GPT-2,
trained exactly as without it, with the figures in the Trainer's logs; without a GPU it warns
once and touches nothing; out of memory in ``guard()`` keeps the same exception."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dptune.monitor import MonitorWarning  # noqa: E402

from fake_cards import FakeCards  # noqa: E402
from hf_models import SEQ, TokenData, tiny_gpt2, training_args  # noqa: E402


def train(tmp_path, callback=None, attach=False):
    model = tiny_gpt2()
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenData(),
                                   callbacks=[callback] if callback is not None and not attach else None)
    if attach:
        callback.attach(trainer)
    trainer.train()
    return trainer, model


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """The model trained without the callback (the reference both tests compare with)."""
    return train(tmp_path_factory.mktemp("alone"))[1]


def test_the_callback_reads_each_step_and_logs_per_card_figures(tmp_path, alone):
    from dptune.integrations.transformers import MemoryMonitorCallback
    from dptune.monitor import load_run

    cards = FakeCards(n=2)
    cards.alloc(1, 3 << 30)                                # something on card 1 to see in the logs
    cb = MemoryMonitorCallback(runtime=cards)
    trainer, watched = train(tmp_path / "watched", cb, attach=True)
    assert trainer.callback_handler.callbacks[0] is cb     # before the reporting callbacks
    assert same_weights(alone, watched)                    # the training is untouched
    assert not watched._forward_pre_hooks                  # the shape hook is gone
    rec = load_run(tmp_path / "watched" / "out" / "dptune-monitor")
    assert [(r["step"], r["card"], r["batch_size"], r["length"]) for r in rec.rows] == \
        [(s, c, 4, SEQ) for c in (0, 1) for s in (1, 2, 3)]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    assert all(h["memory/rank0/card1/reserved_bytes.all.peak"] == 3 << 30 for h in logged)
    assert all(h["memory/rank0/card0/allocated_bytes.all.peak"] == 0 for h in logged)
    assert rec.metas[0]["finished"] is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_the_callback_warns_once_and_touches_nothing(tmp_path, alone):
    from dptune.integrations.transformers import MemoryMonitorCallback

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, watched = train(tmp_path / "watched", MemoryMonitorCallback())
    mine = [w for w in caught if issubclass(w.category, MonitorWarning)]
    assert len(mine) == 1 and "no CUDA card" in str(mine[0].message)
    assert same_weights(alone, watched)
    assert not (tmp_path / "watched" / "out" / "dptune-monitor").exists()
    assert not any(k.startswith("memory/") for h in trainer.state.log_history for k in h)


def test_out_of_memory_in_guard_records_the_forward_that_ran_out(tmp_path):
    from dptune.integrations.transformers import MemoryMonitorCallback

    cards = FakeCards(n=1)
    cb = MemoryMonitorCallback(runtime=cards, run_dir=tmp_path / "run")
    model = tiny_gpt2()
    calls, raised = [], []

    def run_out(module, args, output):      # in the forward, after the callback saw the inputs
        calls.append(1)
        if len(calls) == 2:                  # the second step's forward runs out
            cards.ooms[0] += 1
            raised.append(torch.OutOfMemoryError("CUDA out of memory. GPU 0 has a total capacity"))
            raise raised[0]

    model.register_forward_hook(run_out)
    trainer = transformers.Trainer(model=model, args=training_args(tmp_path), train_dataset=TokenData(),
                                   callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        with pytest.raises(torch.OutOfMemoryError) as info:
            with cb.guard():
                trainer.train()
    assert info.value is raised[0]
    forensics = json.loads((tmp_path / "run" / "oom.rank0.json").read_text())
    assert (forensics["card"], forensics["step"], forensics["batch_size"], forensics["length"]) == (0, 2, 4, SEQ)
    assert forensics["cards"][0]["last_reading"]["step"] == 1
