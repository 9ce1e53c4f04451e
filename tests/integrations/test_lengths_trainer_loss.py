"""The length plan of a HF Trainer probes the Trainer's own loss, as tune_trainer does.

With ``label_smoothing_factor`` or a ``compute_loss_func`` the Trainer pops the labels and
computes the loss on the logits gathered onto card 0, which the model's own loss (what the
plan probed before) leaves out. The oracle, per bucket: the Trainer's own ``training_step``
(``_prepare_inputs``, ``compute_loss``, ``loss.mean()``, ``accelerator.backward``) run through
the simulator as a user step function at the bucket's planned split and length, followed by
the optimizer's step.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dptune.backends.simulated import estimate_memory  # noqa: E402
from dptune.integrations.trainer_lengths import TrainerLengthSample, plan_trainer_lengths  # noqa: E402
from hf_models import training_args  # noqa: E402
from dptune.examples.hf import tiny_gpt2  # noqa: E402

VOCAB = 8000
CLUSTER = "2x1GB"


class Texts(torch.utils.data.Dataset):
    """Token ids of lengths 4..19, the labels the ids themselves."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = [(7 * i + k) % VOCAB for k in range(4 + i // 2)]
        return {"input_ids": ids, "labels": list(ids)}


def pad(features: list) -> dict:
    """Pads to the longest (labels with -100), as a dynamic-padding collator does."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    labels = torch.full((len(features), n), -100)
    for row, f in enumerate(features):
        ids[row, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        labels[row, :len(f["labels"])] = torch.tensor(f["labels"])
    return {"input_ids": ids, "labels": labels}


class AsDataParallel(torch.nn.DataParallel):
    """The simulator's wrapper as the nn.DataParallel the Trainer builds."""

    def __init__(self, wrapped):
        torch.nn.Module.__init__(self)
        self.module = wrapped.module
        self.wrapped = wrapped

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


def lm_trainer(tmp_path, **kw) -> transformers.Trainer:
    model = tiny_gpt2(vocab_size=VOCAB, n_positions=32, use_cache=False, n_embd=32, n_head=2)
    args = training_args(tmp_path, per_device_train_batch_size=8, optim="sgd", **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=Texts(), data_collator=pad)


def sgd(p):
    return torch.optim.SGD(p, lr=0.1)


def real_step_peaks(trainer, split, length) -> list:
    """Per-card peaks of the Trainer's training_step at ``split``, its batch at ``length``."""
    trainer.current_gradient_accumulation_steps = 1     # set by train()
    sample = TrainerLengthSample(trainer, "input_ids")

    def step(model, batch, optimizer):
        trainer.training_step(AsDataParallel(model), dict(batch))
        optimizer.step()

    return estimate_memory(trainer.model, lambda n: sample(n, length), split, CLUSTER,
                           optimizer=sgd, step=step).peak_bytes


def own_loss_peaks(trainer, split, length) -> list:
    """What the plan probed before: the model's own loss inside each replica."""
    sample = TrainerLengthSample(trainer, "input_ids")
    return estimate_memory(trainer.model, lambda n: sample(n, length), split, CLUSTER,
                           optimizer=sgd).peak_bytes


def check_plan(trainer) -> None:
    plan = plan_trainer_lengths(trainer, [12, 19], simulate=CLUSTER, headroom=0,
                                budget_level="allocated",    # compared with allocated peaks
                                max_probes=4, optimizer=sgd)
    for bucket in plan.buckets:
        real = real_step_peaks(trainer, list(bucket.chunk_sizes), bucket.length)
        for card, (planned, truth) in enumerate(zip(bucket.peak_bytes, real)):
            assert planned == pytest.approx(truth, rel=0.005), (bucket, card, real)
        assert all(p <= b for p, b in zip(real, plan.budget_bytes)), (bucket, real)
        # the model's own loss is another step: it leaves out the loss over the gathered logits
        own = own_loss_peaks(trainer, list(bucket.chunk_sizes), bucket.length)
        assert own[0] < 0.9 * real[0], (bucket, own, real)


@pytest.mark.slow
def test_label_smoothing_is_planned_per_bucket(tmp_path):
    check_plan(lm_trainer(tmp_path, label_smoothing_factor=0.1))


@pytest.mark.slow
def test_compute_loss_func_is_planned_per_bucket(tmp_path):
    seen: list = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        seen.append(tuple(labels.shape))
        logits = outputs["logits"].float()        # the loss over the gathered logits, in fp32
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                 ignore_index=-100)

    trainer = lm_trainer(tmp_path)
    trainer.compute_loss_func = loss_func
    check_plan(trainer)
    assert {shape[1] for shape in seen} >= {12, 19}   # every bucket's probes ran it


def test_a_loss_fn_given_replaces_the_trainers_loss(tmp_path, monkeypatch):
    """loss_fn= (or step=) is the loss the plan probes, as for tune_trainer."""
    import dptune.lengths.search as search

    got: dict = {}

    def plan_lengths(model, sample, lengths, buckets, **kw):
        got.update(kw)
        return "plan"

    monkeypatch.setattr(search, "plan_lengths", plan_lengths)
    trainer = lm_trainer(tmp_path, label_smoothing_factor=0.1)
    assert plan_trainer_lengths(trainer, 2, simulate=CLUSTER) == "plan"
    assert got["compute_loss"].trainer is trainer
    got.clear()
    mine = lambda out, batch: out.logits.sum()   # noqa: E731
    plan_trainer_lengths(trainer, 2, simulate=CLUSTER, loss_fn=mine)
    assert got["loss_fn"] is mine and "compute_loss" not in got
