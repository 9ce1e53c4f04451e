"""Constructs where a simulated card must behave as a CUDA card: activation checkpointing on
several cards, a card given no samples, models that read tensor values, host tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptune.backends.simulated import estimate_memory

D, T, HID, BLOCKS = 64, 128, 256, 4


class Stack(nn.Module):
    """An input layer, then blocks Linear-GELU-Linear, each optionally checkpointed."""

    def __init__(self, mode: str = "none"):
        super().__init__()
        self.mode = mode
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(D, HID), nn.GELU(), nn.Linear(HID, D)) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for b in self.blocks:
            if self.mode == "none":
                x = b(x)
            else:
                x = checkpoint(b, x, use_reentrant=self.mode == "reentrant")
        return x


def peaks(mode: str, sizes: list[int]) -> list[int]:
    e = estimate_memory(lambda: Stack(mode), lambda n: torch.randn(n, T, D), sizes,
                        f"{len(sizes)}x24GB", loss_fn=lambda out, batch: out.sum())
    return e.peak_bytes


def u(c: int) -> int:
    """Bytes of one block input/output for a chunk of c samples (fp32)."""
    return c * T * D * 4


def params_bytes() -> int:
    """The model's parameters, each rounded as the allocator rounds it."""
    return sum(-(-p.numel() * 4 // 512) * 512 for p in Stack().parameters())


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("sizes", [[0, 16], [8, 16], [0, 8, 16, 24], [16, 16, 8, 8]])
def test_checkpointing_on_several_cards_saves_on_each_card_its_own_chunk(mode, sizes):
    plain, ckpt = peaks("none", sizes), peaks(mode, sizes)
    saved = [p - q for p, q in zip(plain, ckpt)]
    # The hidden activations (h and GELU(h), 4 u each) of all but the block being recomputed
    # are not kept: 3 blocks x 8 u, less checkpoint's own small tensors. With the reentrant
    # form each segment runs its own backward through DataParallel's broadcast, which fills
    # the gradients of the parameters it did not reach with zeros on every card (one
    # transient copy of the parameters' size) and reduces them onto card 0; and it holds the
    # recomputed segment's output (u) while that segment's backward runs.
    reentrant = mode == "reentrant"
    extra = params_bytes() if reentrant else 0
    for card, c in enumerate(sizes):
        if c == 0:
            # card 0 runs no replica: nothing of the other cards' recomputation lands there
            assert 0 <= ckpt[card] - plain[card] <= extra
        elif card > 0:
            low = (23 if reentrant else 24) * u(c) - 32 * 1024
            assert low <= saved[card] <= 24 * u(c), (card, saved[card] / u(c))
        else:   # card 0 also holds the gathered output; its peak comes at another moment
            assert 20 * u(c) - extra <= saved[card] <= 24 * u(c), saved[card] / u(c)
    # the saving on a card depends on its own chunk only
    for a in range(1, len(sizes)):
        for b in range(1, len(sizes)):
            if sizes[a] == sizes[b]:
                assert saved[a] == saved[b]


def test_hf_gradient_checkpointing_on_two_cards():
    from transformers import GPT2Config, GPT2LMHeadModel

    def model(ckpt: bool):
        cfg = GPT2Config(n_layer=3, n_embd=64, n_head=4, n_positions=128, vocab_size=100)
        m = GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
        if ckpt:
            m.gradient_checkpointing_enable()   # HF's default: the reentrant form
        return m

    def sample(n: int) -> dict:
        ids = torch.randint(0, 100, (n, 128))
        return {"input_ids": ids, "labels": ids}

    plain = estimate_memory(model(False), sample, [0, 8], "2x24GB").peak_bytes
    ckpt = estimate_memory(model(True), sample, [0, 8], "2x24GB").peak_bytes
    assert ckpt[0] == plain[0]          # nothing of card 1's recomputation lands on card 0
    assert ckpt[1] < plain[1] - 2 * u(8)


def test_a_failure_in_dptunes_own_hook_is_reported_as_dptunes(monkeypatch):
    from dptune.backends import simulated
    from dptune.errors import InternalError, UserCodeError

    real = simulated._Ledger.retag

    def broken(self, t, category):
        if category == "gradients":        # only in the hook on the replicas' weights
            raise KeyError("boom")
        return real(self, t, category)

    monkeypatch.setattr(simulated._Ledger, "retag", broken)
    with pytest.raises(InternalError, match="dptune's simulator failed in the gradient hook") as info:
        estimate_memory(Stack(), lambda n: torch.randn(n, T, D), [2, 2], "2x24GB",
                        loss_fn=lambda out, batch: out.sum())
    assert not isinstance(info.value, UserCodeError)
    assert "bug in dptune, not in your model" in str(info.value)
    causes, e = [], info.value
    while e is not None:
        causes.append(type(e))
        e = e.__cause__
    assert KeyError in causes               # the original failure stays chained
