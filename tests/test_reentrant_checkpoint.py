"""Reentrant activation checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``).

A reentrant checkpoint whose inputs all lack ``requires_grad`` (the first checkpointed block
gets the batch itself) computes no gradient through the block: PyTorch warns "None of the
inputs have requires_grad=True". dptune names that cause and its two fixes, rather than
pointing at the loss.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from dptune import Tuner
from dptune.errors import UsageError


class Checkpointed(nn.Module):
    """Two blocks, each under a checkpoint; the first gets the batch itself."""

    def __init__(self, reentrant: bool, input_requires_grad: bool = False, with_loss: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2))
        self.reentrant, self.input_requires_grad, self.with_loss = reentrant, input_requires_grad, with_loss

    def forward(self, x: torch.Tensor):
        if self.input_requires_grad:      # what HF's enable_input_require_grads does (a hook)
            x = x.detach().requires_grad_(True)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return {"loss": x.pow(2).mean()} if self.with_loss else x


def tune(model: nn.Module, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Tuner(model, lambda b: torch.randn(b, 16), batch_size=8, simulate="2x24GB",
                     verbose=False, **kw).fit()


@pytest.mark.parametrize("with_loss", [False, True], ids=["output", "model-loss"])
def test_reentrant_checkpoint_on_the_batch_says_why_and_what_to_do(with_loss):
    with pytest.raises(UsageError) as err:
        tune(Checkpointed(reentrant=True, with_loss=with_loss))
    msg = str(err.value)
    assert "\n" not in msg
    assert "use_reentrant=True" in msg and "None of the inputs have requires_grad=True" in msg
    assert "use_reentrant=False" in msg and "enable_input_require_grads" in msg
    assert "pass loss_fn" not in msg


def test_reentrant_checkpoint_on_the_batch_with_a_loss_fn_says_the_same():
    with pytest.raises(UsageError, match="use_reentrant=False"):
        tune(Checkpointed(reentrant=True), loss_fn=lambda out, batch: out.float().mean())


@pytest.mark.parametrize("model", [Checkpointed(reentrant=False),
                                   Checkpointed(reentrant=True, input_requires_grad=True)],
                         ids=["non-reentrant", "input-requires-grad"])
def test_either_fix_tunes(model):
    r = tune(model)
    assert sum(r.chunk_sizes) == 8


def test_an_output_without_grad_and_no_checkpoint_keeps_its_own_message():
    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x):
            with torch.no_grad():
                return self.lin(x)

    with pytest.raises(UsageError, match="pass loss_fn") as err:
        tune(Frozen())
    assert "reentrant" not in str(err.value)
