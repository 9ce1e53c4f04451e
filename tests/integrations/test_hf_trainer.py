"""The Hugging Face Trainer integration: tune_trainer, BalancedTrainer, the loss weighting.

All on the CPU with models built from a transformers config (no download) and datasets held in
memory. The multi-GPU path of BalancedTrainer runs on the CPU through ``fake_gpus``: the
TrainingArguments report 4 GPUs and BalancedDataParallel's CUDA steps (scatter, replicate,
parallel_apply, gather) are replaced by CPU ones that run each replica in turn, so the
wrapping, the batch drawn and the loss combination are the real code.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch import nn

from dptune.errors import UsageError
from dptune.integrations.transformers import (
    BalancedTrainer, TrainerSample, trainer_optimizer, trainer_sample, trainer_step_settings,
)
from dptune.parallel import BalancedDataParallel
from dptune.step.workload import StepSettings
from hf_models import SEQ, VOCAB, TokenData, tiny_gpt2, training_args

class MeanLossNet(nn.Module):
    """A model whose forward returns the mean loss over its own samples (no loss kwargs);
    every sample has SEQ loss items (masked labels count as class 0)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, labels):
        logits = self.head(self.emb(input_ids))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.clamp(min=0).flatten())
        return {"loss": loss, "logits": logits}


def make_trainer(cls, model, args, data=None, **kw):
    return cls(model=model, args=args, train_dataset=data if data is not None else TokenData(),
               data_collator=transformers.default_data_collator, **kw)


def logged_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# ---- the loss weighting (the reduction itself, by hand) -----------------------------------

def test_weighting_gives_the_batch_mean_for_uneven_replica_losses():
    """Replicas of 1, 3 and 4 samples with mean losses 2.0, 1.0, 0.5: the batch mean is
    (1*2.0 + 3*1.0 + 4*0.5) / 8 = 7/8; the unweighted mean would be 3.5/3."""
    w = BalancedDataParallel.__new__(BalancedDataParallel)
    nn.Module.__init__(w)
    w._last_used_sizes = [1, 3, 4]
    losses = torch.tensor([2.0, 1.0, 0.5], requires_grad=True)
    batch = w.reduce(losses)
    assert batch.item() == pytest.approx(7 / 8)
    assert losses.mean().item() == pytest.approx(3.5 / 3)
    batch.backward()
    assert losses.grad.tolist() == pytest.approx([1 / 8, 3 / 8, 4 / 8])


# ---- building the workload from a Trainer ----------------------------------------------------

def test_sample_cycles_the_dataset_and_drops_unused_columns(tmp_path):
    trainer = make_trainer(transformers.Trainer, tiny_gpt2(), training_args(tmp_path),
                           data=TokenData(3))
    sample = trainer_sample(trainer)
    batch = sample(7)
    assert type(batch) is dict and set(batch) == {"input_ids", "labels"}
    assert batch["input_ids"].shape == (7, SEQ)
    ids = TokenData(3).ids
    assert torch.equal(batch["input_ids"], ids[[0, 1, 2, 0, 1, 2, 0]])


def test_sample_from_an_iterable_dataset_cycles_what_it_yielded():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(2):
                yield {"x": torch.tensor([float(i)])}

    sample = TrainerSample(Stream(), transformers.default_data_collator)
    assert sample(5)["x"].flatten().tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    with pytest.raises(UsageError, match="empty"):
        TrainerSample([], transformers.default_data_collator)(2)


def test_optimizer_and_settings_come_from_the_args(tmp_path):
    args = training_args(tmp_path, optim="sgd", gradient_accumulation_steps=3,
                         max_grad_norm=0.5, bf16=True, activation_checkpointing=True)
    trainer = make_trainer(transformers.Trainer, tiny_gpt2(), args)
    opt = trainer_optimizer(trainer)
    assert opt.cls is torch.optim.SGD and opt.name == "sgd"
    assert isinstance(opt([nn.Parameter(torch.zeros(2))]), torch.optim.SGD)
    assert trainer_step_settings(args) == StepSettings(
        amp="bf16", accumulate=3, clip_grad_norm=0.5, gradient_checkpointing=True)
    fp16 = training_args(tmp_path, max_grad_norm=0.0, fp16=True)
    assert trainer_step_settings(fp16) == StepSettings(amp="fp16")
    adamw = make_trainer(transformers.Trainer, tiny_gpt2(), training_args(tmp_path))
    assert trainer_optimizer(adamw).cls is torch.optim.AdamW
    # an optimizer handed to the Trainer is rebuilt with its own class and defaults
    net = tiny_gpt2()
    given = torch.optim.Adagrad(net.parameters(), lr=0.1)
    own = make_trainer(transformers.Trainer, net, training_args(tmp_path),
                       optimizers=(given, None))
    assert trainer_optimizer(own).cls is torch.optim.Adagrad
    assert trainer_optimizer(own).kwargs["lr"] == 0.1


# ---- BalancedTrainer without several GPUs: exactly the Trainer -----------------------------

def test_single_device_is_the_plain_trainer(tmp_path):
    plain = make_trainer(transformers.Trainer, tiny_gpt2(), training_args(tmp_path))
    with pytest.warns(UserWarning, match=r"split \[1, 3, 4, 0\] is not used"):
        balanced = make_trainer(BalancedTrainer, tiny_gpt2(), training_args(tmp_path),
                                tuned=[1, 3, 4, 0])
    assert not balanced.balanced and balanced._train_batch_size == 4

    # one training step by hand: the same loss and the same gradients
    batch = trainer_sample(plain)(4)
    for t in (plain, balanced):
        t.current_gradient_accumulation_steps = 1   # set by train(); read by training_step
    losses = [t.training_step(t.model, dict(batch)) for t in (plain, balanced)]
    assert torch.equal(losses[0], losses[1])
    for (n, p), (_, q) in zip(plain.model.named_parameters(), balanced.model.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
        p.grad = q.grad = None

    plain.train()
    balanced.train()
    assert len(logged_losses(plain)) == 3
    assert logged_losses(plain) == logged_losses(balanced)
    assert not isinstance(balanced.model_wrapped, BalancedDataParallel)
    for p, q in zip(plain.model.parameters(), balanced.model.parameters()):
        assert torch.equal(p, q)


def test_without_tuned_it_is_the_trainer_and_says_nothing(tmp_path, recwarn):
    t = make_trainer(BalancedTrainer, tiny_gpt2(), training_args(tmp_path))
    assert t.tuned_chunk_sizes is None and not t.balanced
    assert not [w for w in recwarn if "BalancedTrainer" in str(w.message)]


# ---- BalancedTrainer on (fake) several GPUs ------------------------------------------------

def four_gpu_args(tmp_path, **kw):
    args = training_args(tmp_path, **kw)
    _ = args.device          # set up devices (the CPU), then report 4 GPUs
    args._n_gpu = 4
    return args


@pytest.mark.parametrize("case", ["gpt2-token-count", "mean-loss-model"])
def test_several_gpus_train_like_one_device_on_the_whole_batch(tmp_path, fake_gpus, case,
                                                              recwarn):
    """Uneven split [0, 4, 4, 2] (card 0 gets nothing): the loss and the weights after the
    steps equal those of the plain Trainer on one device with the whole batch of 10."""
    build = tiny_gpt2 if case == "gpt2-token-count" else MeanLossNet
    # SGD: the weights move by lr x gradient (Adam's division would magnify float noise)
    extra = dict(optim="sgd", learning_rate=0.5)
    if case == "gpt2-token-count":
        extra["gradient_accumulation_steps"] = 2
    ref = make_trainer(transformers.Trainer, build(),
                       training_args(tmp_path, per_device_train_batch_size=10, **extra),
                       data=TokenData(20))
    bal = make_trainer(BalancedTrainer, build(),
                       four_gpu_args(tmp_path, per_device_train_batch_size=3, **extra),
                       data=TokenData(20), tuned=[0, 4, 4, 2])
    assert bal.balanced and bal.args.n_gpu == 4
    assert bal._train_batch_size == 10            # not 3 x 4
    assert bal.get_train_dataloader().total_batch_size == 10
    assert bal.model_accepts_loss_kwargs is (case == "gpt2-token-count")
    ref.train()
    bal.train()
    assert isinstance(bal.model_wrapped, BalancedDataParallel)
    assert bal.model_wrapped.chunk_sizes == [0, 4, 4, 2]
    assert fake_gpus and all(r == [4, 4, 2] for r in fake_gpus)   # card 0 got no samples
    # the wrapper's advice to weight per-replica losses is not needed: the Trainer does
    assert not [w for w in recwarn if "scalar per replica" in str(w.message)]
    assert logged_losses(bal) == pytest.approx(logged_losses(ref), rel=1e-5)
    for (n, p), q in zip(ref.model.named_parameters(), bal.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_unweighted_mean_would_differ(tmp_path, fake_gpus):
    """The same batch through the wrapper: the Trainer's plain mean() of the replicas' losses
    is not the batch mean that BalancedTrainer computes (so the test above can fail)."""
    bal = make_trainer(BalancedTrainer, MeanLossNet(),
                       four_gpu_args(tmp_path, per_device_train_batch_size=3), tuned=[1, 5, 2, 2])
    model = bal._wrap_model(bal.model)
    batch = trainer_sample(bal)(10)
    with pytest.warns(UserWarning, match="use loss = model.reduce"):   # used directly
        per_replica = model(**batch)["loss"]
    assert per_replica.shape == (4,)
    whole = MeanLossNet()(**batch)["loss"]
    combined = bal.compute_loss(model, dict(batch))
    torch.testing.assert_close(combined, whole)
    assert abs(per_replica.mean().item() - whole.item()) > 1e-4   # float error: ~1e-6


def test_a_split_for_other_cards_is_refused(tmp_path):
    with pytest.raises(UsageError, match=r"is for 2 GPUs but this Trainer uses 4"):
        make_trainer(BalancedTrainer, MeanLossNet(), four_gpu_args(tmp_path), tuned=[3, 5])


def test_report_folder_as_tuned(tmp_path, fake_gpus):
    from tests.test_result_wrap import write_report

    folder = write_report(tmp_path / "rep", [1, 3, 3, 3])
    t = make_trainer(BalancedTrainer, MeanLossNet(), four_gpu_args(tmp_path, max_grad_norm=0.0),
                     tuned=folder)
    assert t.tuned_chunk_sizes == [1, 3, 3, 3] and t._train_batch_size == 10


# ---- tune_trainer on a simulated cluster ---------------------------------------------------

def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_tune_trainer_end_to_end_names_the_trainers_settings(tmp_path):
    from dptune.integrations.transformers import tune_trainer
    from dptune.report import read_report, write_report

    args = training_args(tmp_path, per_device_train_batch_size=6, bf16=True,
                         gradient_accumulation_steps=2, max_grad_norm=1.0,
                         activation_checkpointing=True, optim="adamw_torch")
    model = tiny_gpt2()
    trainer = make_trainer(transformers.Trainer, model, args)
    before, rng = _state(model), torch.get_rng_state()
    result = tune_trainer(trainer, simulate="4x24GB", verbose=False)
    assert result.batch_size == 24 and len(result.chunk_sizes) == 4   # 6 per card x 4 cards
    assert result.settings == StepSettings(amp="bf16", accumulate=2, clip_grad_norm=1.0,
                                           gradient_checkpointing=True)
    assert any("per_device_train_batch_size 6 x 4 cards" in n for n in result.notes)
    assert any("adamw_torch (AdamW)" in n for n in result.notes)
    # the model, its checkpointing switches and the RNG are as they were
    assert not model.is_activation_checkpointing
    assert "_require_grads_hooks" not in model.__dict__
    assert not any("_gradient_checkpointing_func" in m.__dict__ for m in model.modules())
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(rng, torch.get_rng_state())
    folder = tmp_path / "report"
    write_report(result, folder, plots=False)
    summary = (folder / "summary.md").read_text()
    for words in ("bf16 autocast", "accumulate 2", "clip 1", "gradient checkpointing"):
        assert words in summary, words
    assert read_report(folder).settings == result.settings


def test_checkpointing_from_the_args_is_what_the_probes_run(tmp_path):
    """The same Trainer with and without activation_checkpointing: the probes' activations
    on every card are smaller with it (so it was on in the probed model)."""
    from dptune.integrations.transformers import tune_trainer

    peaks = {}
    for ckpt in (False, True):
        args = training_args(tmp_path, per_device_train_batch_size=8, activation_checkpointing=ckpt)
        r = tune_trainer(make_trainer(transformers.Trainer, tiny_gpt2(), args),
                         simulate="2x24GB", verbose=False, max_probes=3)
        peaks[ckpt] = [b["activations"] for b in r.even.breakdown]
        assert r.settings.gradient_checkpointing is ckpt
    assert all(on < off for on, off in zip(peaks[True], peaks[False])), peaks


def test_tune_trainer_batch_size_and_errors(tmp_path):
    from dptune.integrations.transformers import tune_trainer

    trainer = make_trainer(transformers.Trainer, MeanLossNet(), training_args(tmp_path))
    r = tune_trainer(trainer, simulate="2x24GB", batch_size=10, verbose=False, max_probes=3)
    assert r.batch_size == 10
    with pytest.raises(UsageError, match="reads amp from the Trainer's arguments"):
        tune_trainer(trainer, simulate="2x24GB", amp="bf16")
    with pytest.raises(UsageError, match="expects a transformers.Trainer"):
        tune_trainer(MeanLossNet())
    no_data = transformers.Trainer(model=MeanLossNet(), args=training_args(tmp_path))
    with pytest.raises(UsageError, match="has no train_dataset"):
        tune_trainer(no_data, simulate="2x24GB")


# ---- the command line ------------------------------------------------------------------------

TRAINER_MODULE = '''
import torch, transformers
from hf_models import TokenData, tiny_gpt2

def make_trainer():
    args = transformers.TrainingArguments(
        output_dir="out", per_device_train_batch_size=4, gradient_accumulation_steps=2,
        max_grad_norm=0.5, report_to=[], use_cpu=True, save_strategy="no")
    return transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=TokenData(),
                                data_collator=transformers.default_data_collator)

def not_a_trainer():
    return 3

def broken():
    raise RuntimeError("boom in make_trainer")
'''


@pytest.fixture
def trainer_module(tmp_path, monkeypatch):
    import sys
    import uuid

    name = f"hftrainer_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TRAINER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + list(sys.path))
    yield name
    sys.modules.pop(name, None)


def test_cli_hf_trainer_writes_the_report(trainer_module, tmp_path, capsys):
    from dptune.cli import main

    code = main(["search", "--hf-trainer", f"{trainer_module}:make_trainer", "--simulate",
                 "2x24GB", "--max-probes", "4", "--out", str(tmp_path / "rep"), "--no-plots",
                 "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert sum(report["chunk_sizes"]) == 8                     # 4 per card x 2 cards
    assert report["settings"]["accumulate"] == 2 and report["settings"]["clip_grad_norm"] == 0.5
    assert "accumulate 2, clip 0.5" in (tmp_path / "rep" / "summary.md").read_text()


@pytest.mark.parametrize("argv, code, fragment", [
    (["--hf-trainer", "{m}:make_trainer", "--loss", "sum"], 2, "drop --loss"),
    (["--hf-trainer", "{m}:make_trainer", "--input-shape", "3"], 2, "drop --input-shape"),
    (["--hf-trainer", "{m}:not_a_trainer"], 2, "returned a int, not a transformers.Trainer"),
    (["--hf-trainer", "{m}:broken"], 1, "boom in make_trainer"),
    (["--hf-trainer", "{m}:nothing"], 2, "nothing"),
    (["--hf-trainer", "{m}:make_trainer", "--model", "x:y"], 2, "not allowed with"),
])
def test_cli_hf_trainer_errors(trainer_module, capsys, argv, code, fragment):
    from dptune.cli import main

    rc = main(["search", *[a.format(m=trainer_module) for a in argv], "--simulate", "2x24GB"])
    err = capsys.readouterr().err
    assert rc == code, err
    assert fragment in err


# ---- real GPUs -----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs at least two CUDA GPUs")
def test_real_gpus_balanced_trainer_matches_one_device(tmp_path):
    """On every visible GPU (no torchrun): an uneven split trains like one device on the
    whole batch, and the Trainer's own n_gpu decides the wrapping."""
    n = torch.cuda.device_count()
    tuned = [1] + [3] * (n - 1)
    total = sum(tuned)
    ref = make_trainer(transformers.Trainer, tiny_gpt2(),
                       training_args(tmp_path, use_cpu=True, per_device_train_batch_size=total,
                                     optim="sgd", learning_rate=0.5),
                       data=TokenData(2 * total))
    bal = make_trainer(BalancedTrainer, tiny_gpt2(),
                       training_args(tmp_path, use_cpu=False, per_device_train_batch_size=2,
                                     optim="sgd", learning_rate=0.5),
                       data=TokenData(2 * total), tuned=tuned)
    assert bal.args.n_gpu == n and bal.balanced and bal._train_batch_size == total
    ref.train()
    bal.train()
    assert isinstance(bal.model_wrapped, BalancedDataParallel)
    assert bal.model_wrapped.last_chunk_sizes == tuned
    assert logged_losses(bal) == pytest.approx(logged_losses(ref), rel=1e-4)
    for (name, p), q in zip(ref.model.named_parameters(), bal.model.parameters()):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=1e-5, msg=name)


# ---- a split tuned for another step --------------------------------------------------------

def _report_with(tmp_path, name, settings):
    import dataclasses

    from tests.test_result_wrap import write_report

    from dptune.result.model import TuneResult

    folder = write_report(tmp_path / name, [1, 3, 3, 3])
    result = dataclasses.replace(TuneResult.load(str(folder)), settings=settings)
    (folder / "report.json").write_text(json.dumps(result.to_dict()))
    return folder


def test_a_report_for_other_settings_warns_as_wrap_does(tmp_path):
    """A bf16 report given to a BalancedTrainer with fp32 arguments warns with the same
    message as load_result(...).wrap(...) with amp=None; matching arguments say nothing."""
    import warnings

    from dptune import load_result
    from dptune.errors import DptuneWarning
    from dptune.result.model import TuneResult

    # TrainingArguments clip at max_grad_norm=1.0 by default
    bf16 = _report_with(tmp_path, "bf16", StepSettings(amp="bf16", clip_grad_norm=1.0))
    with pytest.warns(DptuneWarning) as got:
        t = make_trainer(BalancedTrainer, MeanLossNet(), four_gpu_args(tmp_path), tuned=bf16)
    assert t.tuned_chunk_sizes == [1, 3, 3, 3]
    mine = [str(w.message) for w in got if issubclass(w.category, DptuneWarning)]
    assert len(mine) == 1 and "amp='bf16' in the report, None here" in mine[0], mine
    with pytest.warns(DptuneWarning) as by_wrap:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA")
            load_result(bf16).wrap(MeanLossNet(), device_ids=[0, 1, 2, 3], amp=None,
                                         clip_grad_norm=1.0)
    assert [str(w.message) for w in by_wrap if issubclass(w.category, DptuneWarning)] == mine
    # a TuneResult object, and the args' accumulation and clipping, are compared too
    other = load_result(_report_with(tmp_path, "acc", StepSettings(amp="bf16", accumulate=4)))
    assert isinstance(other, TuneResult)
    with pytest.warns(DptuneWarning, match=r"accumulate=4 in the report, 2 here.*clip_grad_norm"
                                           r"=None in the report, 0.5 here"):
        make_trainer(BalancedTrainer, MeanLossNet(),
                     four_gpu_args(tmp_path, bf16=True, gradient_accumulation_steps=2,
                                   max_grad_norm=0.5), tuned=other)
    # the same settings: nothing said
    same = _report_with(tmp_path, "same", StepSettings(amp="bf16", clip_grad_norm=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DptuneWarning)
        make_trainer(BalancedTrainer, MeanLossNet(), four_gpu_args(tmp_path, bf16=True),
                     tuned=same)
