"""DataParallel's broadcast backward: the zero gradients autograd gives it, on every card.

torch's ``replicate`` broadcasts every parameter through ``Broadcast``, which marks the copies
of frozen parameters non-differentiable. When its backward runs, autograd hands it a zero
gradient, made on the copy's card, for every copy that got none (a frozen parameter's, an
unused parameter's, and in each segment of a reentrant checkpoint every parameter the segment
did not touch), and ``ReduceAddCoalesced`` sums them all onto card 0. Each case is checked per
card against ``tests/support/dp_reference.py``, which runs torch's own ``replicate``,
``Broadcast``, ``ReduceAddCoalesced`` and autograd engine on meta tensors (not dptune's code),
within 0.5%: the simulator leaves out the transient buckets ``comm`` flattens small tensors
into, which the reference has.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from dp_reference import dataparallel_peaks
from dptune.backends.simulated import SimulatedBackend, estimate_memory, parse_cluster

D = 4096          # parameters dominate each card's peak


def simulated(make, sample, split, **kw) -> list[int]:
    """The simulator's per-card peaks, less its workspaces (two cuBLAS, one cuBLASLt per card),
    which the reference leaves out."""
    cluster = f"{len(split)}x24GB"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_memory(make, sample, split, cluster, **kw)
    c = parse_cluster(cluster)
    return [p - (2 * c.workspace_bytes(i) + 2**20) for i, p in enumerate(est.peak_bytes)]


def assert_per_card(got: list[int], want: list[int]) -> None:
    for card, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= 0.005 * w, (card, g / 2**20, w / 2**20, f"{100 * (g - w) / w:+.2f}%")


@pytest.fixture(autouse=True)
def no_scratch(monkeypatch):
    """The CUDA kernels' scratch, which the CPU's kernels in the reference never allocate."""
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", False)


def features(n: int) -> torch.Tensor:
    return torch.randn(n, D)


# ---- reentrant checkpointing with a layer outside the checkpoints -----------------------------
class Stack(nn.Module):
    """A Linear on the batch (no checkpoint, its input not detached), then four blocks, each
    its own reentrant checkpoint: the broadcast's backward runs once per segment, and once
    for the first Linear."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return x


@pytest.mark.parametrize("split", [[8, 8], pytest.param([2, 6, 4, 4], marks=pytest.mark.slow)],
                         ids=lambda s: "-".join(map(str, s)))
def test_reentrant_checkpoint_behind_an_input_layer(split):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = dataparallel_peaks(Stack, features, split)
    assert_per_card(simulated(Stack, features, split), want)


# ---- trainable parameters the forward never uses -----------------------------------------------
class Unused(nn.Module):
    """Four Linear(4096), two of them never used: their copies get zero gradients on every
    card, summed onto card 0."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        return self.layers[2](self.layers[0](x))


@pytest.mark.parametrize("split", [[8, 8], [4, 4, 4, 4]], ids=lambda s: "-".join(map(str, s)))
def test_unused_parameters(split):
    assert_per_card(simulated(Unused, features, split), dataparallel_peaks(Unused, features, split))


# ---- frozen weights: a LoRA-like model ------------------------------------------------------------
class LoRALinear(nn.Module):
    def __init__(self, rank: int = 8):
        super().__init__()
        self.base = nn.Linear(D, D).requires_grad_(False)
        self.a = nn.Linear(D, rank, bias=False)
        self.b = nn.Linear(rank, D, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


class LoRA(nn.Module):
    """Four frozen Linear(4096) with rank-8 adapters."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[LoRALinear() for _ in range(4)])

    def forward(self, x):
        return self.layers(x)


def adamw(params):
    return torch.optim.AdamW(params, foreach=True)


@pytest.mark.parametrize("split", [[8, 8], [4, 4, 4, 4]], ids=lambda s: "-".join(map(str, s)))
def test_frozen_weights_lora(split):
    want = dataparallel_peaks(LoRA, features, split, optimizer=adamw)
    got = simulated(LoRA, features, split, optimizer=adamw)
    assert_per_card(got, want)
    # the frozen weights' zeros and their sums: card 0 holds far more than its one copy of them
    frozen = 4 * (D * D * 4 + D * 4)
    assert got[0] > 2.9 * frozen


def test_frozen_weights_leave_the_model_as_it_was():
    model = LoRA()
    before = {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()}
    simulated(model, features, [4, 4], optimizer=adamw)
    assert {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()} == before


# ---- HF Llama with gradient checkpointing -----------------------------------------------------------
VOCAB = 8000


def llama(reentrant: bool):
    """A Llama whose every weight matrix is at least 10 MiB (comm does not flatten it into a
    bucket), gradient checkpointing enabled as a user does."""
    def make():
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=VOCAB, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=128,
            attn_implementation="eager", use_cache=False))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # gradient_checkpointing_enable is deprecated in 5.x
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return make


def tokens(n: int) -> dict:
    ids = torch.randint(0, VOCAB, (n, 16))
    # with an attention mask, HF's mask code reads no tensor value (the reference runs on meta)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("split", [[2, 2], [1, 1, 1, 1]], ids=lambda s: "-".join(map(str, s)))
def test_hf_llama_gradient_checkpointing(split, reentrant):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = dataparallel_peaks(llama(reentrant), tokens, split, model_loss=True)
    assert_per_card(simulated(llama(reentrant), tokens, split), want)
