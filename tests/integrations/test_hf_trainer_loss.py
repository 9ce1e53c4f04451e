"""The HF Trainer's own loss is what tune_trainer probes (issue 25).

With ``label_smoothing_factor`` the Trainer pops the labels and computes the loss on the logits
gathered onto card 0. The oracle is the Trainer's own ``training_step`` (``_prepare_inputs``,
``compute_loss``, ``loss.mean()``, ``accelerator.backward``) run through the simulator as a
user step function at the tuned split, followed by the optimizer's step.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_models import training_args

from dptune.backends.simulated import estimate_memory
from dptune.examples.hf import tiny_gpt2
from dptune.integrations.transformers import trainer_sample, tune_trainer

VOCAB, SEQ = 8000, 32


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


class AsDataParallel(torch.nn.DataParallel):
    """The simulator's wrapper as the nn.DataParallel the Trainer builds (accelerate's
    unwrap_model reaches the model through .module only in a DataParallel)."""

    def __init__(self, wrapped):
        torch.nn.Module.__init__(self)
        self.module = wrapped.module
        self.wrapped = wrapped

    def forward(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)


def lm_trainer(tmp_path, **kw) -> transformers.Trainer:
    model = tiny_gpt2(vocab_size=VOCAB, n_positions=SEQ, use_cache=False, n_embd=32, n_head=2)
    args = training_args(tmp_path, per_device_train_batch_size=8, optim="sgd", **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                data_collator=transformers.default_data_collator)


def real_step_peaks(trainer, split, cluster) -> list:
    """Per-card peaks of the Trainer's training_step at ``split`` on the simulated cluster."""
    trainer.current_gradient_accumulation_steps = 1     # set by train()

    def step(model, batch, optimizer):
        trainer.training_step(AsDataParallel(model), dict(batch))
        optimizer.step()

    est = estimate_memory(trainer.model, trainer_sample(trainer), split, cluster,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), step=step)
    return est.peak_bytes


@pytest.mark.slow
def test_label_smoothing_trainer_is_tuned_for_the_step_it_runs(tmp_path):
    trainer = lm_trainer(tmp_path, label_smoothing_factor=0.1)
    result = tune_trainer(trainer, simulate="3x1GB", objective="max_batch", headroom=0,
                          budget_level="allocated",     # compared with allocated peaks
                          verbose=False, max_probes=8)
    split = result.chunk_sizes
    real = real_step_peaks(trainer, split, "3x1GB")
    for card, (tuned, truth) in enumerate(zip(result.peak_bytes, real)):
        assert tuned == pytest.approx(truth, rel=0.005), (card, split, result.peak_bytes, real)
    assert all(p <= b for p, b in zip(real, result.budget_bytes)), (real, result.budget_bytes)
    # the model's own loss inside each replica (what was probed before) is another step: it
    # leaves out the gathered logits' loss on card 0, so it cannot stand for the real one
    own = estimate_memory(trainer.model, trainer_sample(trainer), split, "3x1GB",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).peak_bytes
    assert own[0] < 0.8 * real[0], (own, real)
    assert not any("model's loss" in n for n in result.notes)


def test_a_subclass_compute_loss_is_the_one_probed(tmp_path):
    """A Trainer subclass whose compute_loss adds a term over the gathered logits: the probe
    at one split equals the Trainer's training_step at that split."""

    class Extra(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            out = model(**inputs)
            loss = out.loss.mean() + out.logits.float().pow(2).mean()
            return (loss, out) if return_outputs else loss

    trainer = lm_trainer(tmp_path)
    trainer.__class__ = Extra
    result = tune_trainer(trainer, simulate="2x24GB", batch_size=12, verbose=False,
                          max_probes=3, budget_level="allocated")   # compared with allocated peaks
    real = real_step_peaks(trainer, result.chunk_sizes, "2x24GB")
    for tuned, truth in zip(result.peak_bytes, real):
        assert tuned == pytest.approx(truth, rel=0.005), (result.peak_bytes, real)


def test_compute_loss_excludes_loss_fn_and_step():
    from dptune.errors import UsageError
    from dptune.step.workload import Workload

    model = torch.nn.Linear(2, 2)
    for extra in ({"loss_fn": lambda o, b: o.sum()}, {"step": lambda m, b, o: None}):
        with pytest.raises(UsageError, match="compute_loss= runs the forward and the loss"):
            Workload(model, lambda n: torch.ones(n, 2), compute_loss=lambda m, b: m(b).sum(),
                     **extra)
