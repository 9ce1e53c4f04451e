"""Attention on the simulated cluster: CUDA's kernel choice, and the tensors each one saves."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from dptune._torch_private import fake_tensor_mode
from dptune.backends.simulated.sdpa import SdpaCall, SdpaFlags, sdpa_mode, select_kernel
from dptune.backends.simulated import (
    DEFAULT_CAPABILITY,
    SimulatedBackend,
    estimate_memory,
    parse_cluster,
)
from dptune.step.workload import Workload

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


def call(b: int = 2, h: int = 4, lq: int = 128, d: int = 64, dtype: torch.dtype = BF16, *,
         lk: int | None = None, hk: int | None = None, **kw) -> SdpaCall:
    lk = lq if lk is None else lk
    hk = h if hk is None else hk
    base = SdpaCall(q_shape=(b, h, lq, d), k_shape=(b, hk, lk, d), v_shape=(b, hk, lk, d),
                    dtypes=(dtype,) * 3, requires_grad=True, element_size=dtype.itemsize)
    return dataclasses.replace(base, **kw)


A100, V100, T4, A10, L4, H100 = (8, 0), (7, 0), (7, 5), (8, 6), (8, 9), (9, 0)


# ---- the pure choice ----------------------------------------------------------------------
@pytest.mark.parametrize("c, cap, kernel", [
    (call(dtype=BF16), A100, "flash"),                              # bf16, no mask
    (call(dtype=FP16, dropout_p=0.1), A100, "flash"),               # dropout is fine for flash
    (call(dtype=FP32, dropout_p=0.1), A100, "efficient"),           # fp32: no flash
    (call(dtype=FP32), V100, "efficient"),
    (call(dtype=FP16), V100, "efficient"),                          # flash needs sm 8.0
    (call(dtype=BF16), V100, "math"),                               # no bf16 below sm 8.0
    (call(dtype=FP32, d=6), A100, "math"),                          # head size not a multiple of 4
    (call(dtype=FP32, d=6), T4, "efficient"),                       # fp32 without tensor cores: 1
    (call(dtype=FP16, d=12), T4, "math"),                           # fp16 needs a multiple of 8
    (call(dtype=BF16, mask_shape=(2, 1, 128, 128)), A100, "efficient"),   # flash takes no mask
    (call(dtype=BF16, d=200), A10, "efficient"),                    # sm 8.6 training, head 200
    (call(dtype=BF16, d=200, requires_grad=False), A10, "flash"),   # ... fine for inference
    (call(dtype=BF16, d=256), A10, "flash"),                        # (224, 256] without dropout
    (call(dtype=BF16, d=256, dropout_p=0.1), L4, "efficient"),
    (call(dtype=BF16, is_causal=True, lq=64, lk=128), A100, "efficient"),  # non-square causal
    (call(dtype=BF16, d=512), A100, "efficient"),                   # flash: head <= 256
    (call(dtype=BF16), H100, "cudnn"),                              # cuDNN first on sm 9.0
    (call(dtype=BF16, dropout_p=0.1), H100, "flash"),               # 0.1 is not a multiple of 1/16
    (call(dtype=BF16, dropout_p=0.125), H100, "cudnn"),
    (call(dtype=BF16, d=192), H100, "flash"),                       # cuDNN backward: 128/256 only
    (call(dtype=BF16, lk=1, lq=1), H100, "flash"),                  # cuDNN: key length 1
    (call(dtype=FP32), H100, "efficient"),
    (call(dtype=BF16, hk=2), A100, "math"),                         # heads differ, no gqa
    (call(dtype=BF16, hk=2, enable_gqa=True), A100, "flash"),
    (call(dtype=FP32, hk=2, enable_gqa=True), A100, "math"),        # efficient: no gqa
    (call(dtype=BF16, hk=2, enable_gqa=True, mask_shape=(2, 1, 128, 128)), A100, "math"),
    (call(dtype=BF16, hk=2, enable_gqa=True, mask_shape=(2, 1, 128, 128)), H100, "cudnn"),
    (call(dtype=BF16, last_strides=(2, 1, 1)), A100, "math"),       # last dim not contiguous
    (call(dtype=FP32, storage_offsets=(2, 0, 0)), A100, "math"),    # misaligned on sm 8.0
    (call(dtype=FP32, storage_offsets=(2, 0, 0)), V100, "efficient"),
    (dataclasses.replace(call(dtype=BF16), q_shape=(2, 128, 64)), A100, "math"),   # 3-D
])
def test_kernel_choice(c, cap, kernel):
    assert select_kernel(c, cap) == kernel


def test_flags_and_priority_order():
    c = call(dtype=BF16)
    assert select_kernel(c, A100, SdpaFlags(flash=False)) == "efficient"
    assert select_kernel(c, A100, SdpaFlags(flash=False, efficient=False)) == "math"
    assert select_kernel(c, A100, SdpaFlags(flash=False, efficient=False, math=False)) == "cudnn"
    assert select_kernel(call(dtype=FP32), A100, SdpaFlags(efficient=False, math=False)) == "error"
    assert select_kernel(c, H100, SdpaFlags(cudnn_deprioritized=True)) == "flash"
    assert select_kernel(c, H100, SdpaFlags(deterministic=True)) == "flash"
    # a user-set order is kept as it is
    assert select_kernel(c, H100, SdpaFlags(order=("efficient", "flash", "math", "cudnn"))) == "efficient"


def test_flags_follow_torch_switches():
    assert SdpaFlags.from_torch() == SdpaFlags()
    with sdpa_kernel([SDPBackend.MATH]):
        f = SdpaFlags.from_torch()
        assert (f.flash, f.efficient, f.cudnn, f.math) == (False, False, False, True)
        assert select_kernel(call(dtype=BF16), A100, f) == "math"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION], set_priority=True):
        assert select_kernel(call(dtype=BF16), A100, SdpaFlags.from_torch()) == "efficient"
    assert SdpaFlags.from_torch() == SdpaFlags()


# ---- the tensors each kernel keeps for the backward -----------------------------------------
def saved_by_attention(dtype: torch.dtype, dropout: float, cap, *, mask: bool = False,
                       b: int = 2, h: int = 3, t: int = 40, d: int = 16) -> list[tuple]:
    """(shape, dtype) of every tensor autograd saves in one attention call, on a card of ``cap``."""
    saved: list[tuple] = []
    chosen: list[str] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(x.shape), x.dtype))
        return x

    with fake_tensor_mode(), sdpa_mode(lambda _t: cap, lambda k, c: chosen.append(k)):
        q, k, v = (torch.empty(b, h, t, d, dtype=dtype, requires_grad=True) for _ in range(3))
        m = torch.ones(t, t, dtype=torch.bool).tril() if mask else None
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=dropout)
    return [chosen[0]] + saved


def test_fp32_with_dropout_on_a100_keeps_output_and_logsumexp_not_the_matrix():
    kernel, *saved = saved_by_attention(FP32, 0.1, A100)
    assert kernel == "efficient"
    qkv = ((2, 3, 40, 16), FP32)
    assert saved.count(qkv) == 4                       # query, key, value, output
    assert ((2, 3, 64), FP32) in saved                 # logsumexp, rows padded to 32
    assert not [s for s, _ in saved if s[-2:] == (40, 40)]   # no B×H×T×T tensor


def test_bf16_without_mask_is_flash_and_keeps_no_matrix():
    kernel, *saved = saved_by_attention(BF16, 0.0, A100)
    assert kernel == "flash"
    assert saved.count(((2, 3, 40, 16), BF16)) == 4
    assert ((2, 3, 40), FP32) in saved                 # logsumexp
    assert not [s for s, _ in saved if s[-2:] == (40, 40)]


def test_efficient_with_a_boolean_mask_keeps_the_additive_bias():
    kernel, *saved = saved_by_attention(BF16, 0.0, A100, mask=True)
    assert kernel == "efficient"
    assert ((2, 3, 40, 40), BF16) in saved             # the expanded 0/-inf bias (a view of T×T)


def test_math_path_on_v100_bf16_keeps_the_attention_matrix():
    kernel, *saved = saved_by_attention(BF16, 0.1, V100)
    assert kernel == "math"
    # upcast to fp32 for the math path (allow_fp16_bf16_reduction_math_sdp is off by default)
    assert ((2, 3, 40, 40), FP32) in saved
    assert ((2, 3, 40, 40), torch.bool) in saved        # the dropout mask (native_dropout)
    assert ((6, 40, 40), FP32) in saved                 # dropout output, input of the 2nd matmul


def test_host_tensors_keep_the_cpu_choice():
    """A tensor on the host is not a card tensor: the mode leaves the call alone."""
    chosen: list[str] = []
    with fake_tensor_mode(), sdpa_mode(lambda _t: None, lambda k, c: chosen.append(k)):
        q = torch.empty(1, 2, 8, 8)
        F.scaled_dot_product_attention(q, q, q)
    assert chosen == []


# ---- end to end on the simulated cluster ----------------------------------------------------
class Block(nn.Module):
    """A bare causal self-attention block with attention dropout (GPT-2 style)."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.1, dtype: torch.dtype = FP32):
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(d, 3 * d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0,
                                           is_causal=True)
        return y.float().sum()


B, T, D, H = 4, 256, 64, 4
MATRIX = B * H * T * T * 4          # one fp32 attention matrix of the whole batch, in bytes


def block_estimate(spec: str, dtype: torch.dtype = FP32):
    return estimate_memory(lambda: Block(D, H, dtype=dtype), lambda n: torch.randn(n, T, D, dtype=dtype),
                           [B], spec, loss_fn=lambda out, batch: out)


def test_simulated_a100_runs_efficient_and_the_math_path_costs_the_matrices():
    eff = block_estimate("A100-80GB")
    assert any("efficient x1 (sm 8.0)" in n for n in eff.notes)
    assert eff.breakdown[0]["activations"] < MATRIX // 2
    with sdpa_kernel([SDPBackend.MATH]):
        math_ = block_estimate("A100-80GB")
    assert any("math x1" in n for n in math_.notes)
    # softmax output, dropout output (fp32) and the bool dropout mask stay alive for the backward
    assert math_.breakdown[0]["activations"] >= 2 * MATRIX + MATRIX // 4
    assert math_.peak_bytes[0] - eff.peak_bytes[0] >= 2 * MATRIX


def test_per_card_capability_in_a_mixed_cluster():
    e = estimate_memory(lambda: Block(D, H, dtype=BF16), lambda n: torch.randn(n, T, D, dtype=BF16),
                        [2, 2], "A100-80GB,V100-32GB", loss_fn=lambda out, batch: out.sum())
    note = next(n for n in e.notes if "attention" in n)
    assert "flash x1 (sm 8.0)" in note and "math x1 (sm 7.0)" in note
    assert e.peak_bytes[1] > e.peak_bytes[0] - 32 * 1024 * 1024   # V100 pays for the matrix


def test_capability_from_the_card_table_and_the_stated_default():
    c = parse_cluster("2xH100,L4,T4,24GB")
    assert c.capabilities == ((9, 0), (9, 0), (8, 9), (7, 5), DEFAULT_CAPABILITY)
    assert c.describe_capability() == "sm 8.0 assumed"
    assert parse_cluster("4xA100").describe_capability() == ""
    assert parse_cluster("4x24GB,cc=8.6").capabilities == ((8, 6),) * 4
    assert parse_cluster("4x24GB,cc=8.6").describe_capability() == ""
    backend = SimulatedBackend(Workload(nn.Linear(2, 2), lambda n: torch.randn(n, 2)), "4x24GB")
    assert backend.describe() == "4x24GB (simulated, sm 8.0 assumed)"


# ---- transformers: attn_implementation "sdpa" and "eager" ----------------------------------
def tiny_gpt2(impl: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=100,
                     attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation=impl)


def test_hf_sdpa_runs_cuda_kernels_and_eager_is_the_math_path():
    t = 128

    def sample(n: int) -> dict:
        ids = torch.randint(0, 100, (n, t))
        return {"input_ids": ids, "labels": ids}

    sdpa = estimate_memory(tiny_gpt2("sdpa"), sample, [4], "A100-80GB")
    eager = estimate_memory(tiny_gpt2("eager"), sample, [4], "A100-80GB")
    note = next(n for n in sdpa.notes if "attention" in n)
    assert "efficient x2 (sm 8.0)" in note            # fp32 with a causal mask (or dropout): efficient
    assert not [n for n in eager.notes if "attention" in n]   # eager: plain matmuls, nothing to pick
    per_layer = 4 * 4 * t * t * 4                    # B×H×T×T fp32
    # eager keeps each layer's softmax (fp32) and its dropout mask (bool) for the backward
    assert eager.peak_bytes[0] - sdpa.peak_bytes[0] >= 2 * (per_layer + per_layer // 4)


def test_grouped_query_attention_in_fp32_runs_the_math_path_on_each_card():
    """A Llama-style model passes ``enable_gqa=True`` with fewer key/value heads: CUDA's
    memory-efficient kernel takes no grouped heads, so fp32 runs the math path (bf16: flash)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=1, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                      max_position_embeddings=64)

    def sample(n: int) -> dict:
        ids = torch.randint(0, 100, (n, 64))
        return {"input_ids": ids, "labels": ids}

    def run(amp):
        return estimate_memory(
            lambda: LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa"), sample,
            [2, 4], "2xA100-80GB", amp=amp)

    fp32, bf16 = run(None), run("bf16")
    assert "math x2" in next(n for n in fp32.notes if "attention" in n)
    assert "flash x2" in next(n for n in bf16.notes if "attention" in n)
