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


# ---- several cards: the broadcast's backward once per segment ----------------------------------
#
# The reference counts, per card, what torch's DataParallel holds at its peak, from torch's own
# code: ``Broadcast`` gives each card a copy of every parameter (card 0 uses the masters); its
# backward gets a gradient for *every* copy, autograd materializing zeros on the copy's card
# for those the segment did not touch (``Function``'s default ``materialize_grads``);
# ``ReduceAddCoalesced`` reduces them into new tensors on card 0 (``nccl.reduce`` into
# ``empty_like``), which become the masters' gradients the first time and are added into them
# after. With ``use_reentrant=True`` every checkpointed segment's backward runs that once,
# the replicas' copies still held by the checkpoints (their ``run_function``); without
# checkpointing it runs once, at the end, the copies already freed. Like the simulator
# (README, "What the simulator models"), it leaves out the transient 10 MiB buffers that
# ``comm.reduce_add_coalesced`` flattens the gradients into.

MiB = 2**20
D, BLOCKS = 4096, 8     # parameters dominate: a chunk's activations are < 0.3% of a card


def _r512(n: int) -> int:            # the caching allocator's rounding
    return -(-n // 512) * 512


def _workspace() -> int:
    """The workspaces per card: cuBLAS's, from torch's default CUBLAS_WORKSPACE_CONFIG
    ':4096:2:16:8' (sizes in KiB, counts), which the simulated (non-Hopper) cards take, one for
    each thread's handle (``CublasHandlePool.cpp``: the forward's and the autograd engine's
    thread of the card), and cuBLASLt's (CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB)."""
    return 2 * (4096 * 1024 * 2 + 16 * 1024 * 8) + 1024 * 1024


def _reference(n_cards: int, reentrant: bool) -> list[int]:
    P = BLOCKS * (_r512(D * D * 4) + _r512(D * 4))     # one copy of the parameters
    ws = _workspace()
    if reentrant:
        # in a later segment's backward: card 0 the masters, their gradients, replica 0's
        # gradients (touched or zeros) and the reduced sum; a replica card its copies and
        # their gradients (touched or zeros)
        return [4 * P + ws] + [2 * P + ws] * (n_cards - 1)
    # card 0 at the reduction, once, at the end: the masters, replica 0's gradients and the
    # reduced sum that becomes the masters' gradients; a replica card when the last block's
    # gradients are made (the first of the backward), every copy still saved for it
    block = _r512(D * D * 4) + _r512(D * 4)
    return [3 * P + ws] + [P + block + ws] * (n_cards - 1)


class Stack(nn.Module):
    """The issue's 8-block MLP, each block its own checkpointed segment."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(BLOCKS))
        self.reentrant = reentrant

    def forward(self, x):
        x = x.detach().requires_grad_(True)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True) if self.reentrant else b(x)
        return x


# uneven chunks on 2 and 4 cards in `make test`; the even splits (several seconds each) are slow
@pytest.mark.parametrize("split", [pytest.param([8, 8], marks=pytest.mark.slow), [4, 12],
                                   pytest.param([4, 4, 4, 4], marks=pytest.mark.slow),
                                   pytest.param([2, 6, 4, 4], marks=pytest.mark.slow)],
                         ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "plain"])
def test_data_parallel_peaks_match_torchs_broadcast_and_reduce(split, reentrant):
    from dptune.backends.simulated import SimulatedBackend
    from dptune.step.workload import Workload

    wl = Workload(Stack(reentrant), lambda b: torch.randn(b, D), None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = SimulatedBackend(wl, f"{len(split)}x24GB").estimate(split)
    ref = _reference(len(split), reentrant)
    for card, (got, want) in enumerate(zip(est.peak_bytes, ref)):
        assert abs(got - want) <= 0.005 * want, (card, got / MiB, want / MiB)
