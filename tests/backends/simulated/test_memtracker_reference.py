"""The simulator's single-card step against an independent accounting: PyTorch's own
``torch.distributed._tools.mem_tracker.MemTracker`` (a private module, imported here as
``tests/test_oom.py`` imports ``torch._utils``), run under ``FakeTensorMode`` on the same step.

The same step on both sides: fp32, the model's weights and the optimizer's state live before
the step (after a warm-up step, gradients ``None``), the batch copied onto the card, forward,
the loss (the model's own ``loss``, else the output's sum), backward, ``optimizer.step()``
with ``foreach=True`` (torch's default on CUDA, which dptune uses), the output kept alive
through the optimizer step. MemTracker runs on fake CPU tensors (the backward of fake CUDA
tensors aborts the process in a CPU-only build of torch: there is no CUDA device guard), so

- it sees the CPU build's kernels: the models take no dropout and HF's ``"eager"`` attention
  (plain matmuls and softmax), where the simulated card and the CPU run the same kernels
  (with dropout or ``"sdpa"`` the simulator runs CUDA's kernels instead, by design);
- its rule for CUDA storages (each rounded up to ``_PYTORCH_MIN_ALLOCATE`` = 512 bytes, the
  caching allocator's block) is applied to every storage, so that both sides give the figure
  ``torch.cuda.max_memory_allocated`` would.

Known differences, exact: dptune's workspaces (alive through the step; torch's
``CublasHandlePool.cpp`` keeps a cuBLAS workspace per (handle, stream) and a handle per thread:
one for the forward's thread and one for the autograd engine's thread, 8 MiB + 128 KiB each on
a non-Hopper card, and cuBLASLt's of 1 MiB, ``CUBLASLT_WORKSPACE_SIZE``'s default) are removed
from its figure; the scratch CUDA's kernels take inside an op (a contiguous copy of a matrix
operand cuBLAS cannot read, cuDNN's workspace: ``dptune.backends.simulated.scratch``), which
the CPU's fake kernels never allocate, is left out of dptune's run (``_cuda_scratch``); and AdamW keeps one 0-dim fp32
``step`` per parameter tensor on the host (torch does so for non-capturable optimizers even
with CUDA parameters), which the simulator does not charge to the card and MemTracker on CPU
tensors counts: 512 bytes each once rounded.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.distributed._tools import mem_tracker

from dptune._torch_private import fake_tensor_mode
from dptune.backends.simulated import SimulatedBackend, estimate_memory, parse_cluster
from dptune.examples.hf import gpt2_batch, tiny_gpt2
from dptune.examples.models import SmallResNet

# MemTracker's module hooks warn on BERT's backward ("Module is None. Skipping PRE_BW hook")
pytestmark = pytest.mark.filterwarnings("ignore:Module is None:UserWarning")

CLUSTER = "1x24GB"
BATCH = 4
OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
              "adamw": lambda p: torch.optim.AdamW(p, foreach=True)}


def gpt2() -> nn.Module:
    model = tiny_gpt2(use_cache=False)               # no dropout
    model.config._attn_implementation = "eager"
    return model


def bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager"))


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="eager"))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        attn_implementation="eager", use_cache=False))


def cnn() -> nn.Module:
    return SmallResNet(widths=(8, 16), blocks=1, num_classes=10, image_size=32)   # BatchNorm


def lm_batch(n: int) -> dict:
    return gpt2_batch(n, seq_len=32)


def image_batch(n: int) -> dict:
    return {"pixel_values": torch.randn(n, 3, 32, 32), "labels": torch.zeros(n, dtype=torch.long)}


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


MODELS = {"gpt2": (gpt2, lm_batch), "bert": (bert, lm_batch), "vit": (vit, image_batch),
          "llama": (llama, lm_batch), "cnn": (cnn, images)}


def loss_of(out):
    loss = out.get("loss") if isinstance(out, dict) else None
    return loss if loss is not None else out.sum()


def fake_copy(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device) with fake CPU parameters and buffers; tied weights stay
    tied (``Module.to_empty`` would untie them)."""
    new: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                mod._parameters[name] = new[id(p)]
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = new.setdefault(id(b), torch.empty_like(b, device="cpu"))
    return model


def memtracker_peak(factory, sample, optimizer) -> tuple[int, int]:
    """MemTracker's peak over the step (bytes) and the number of parameter tensors."""
    with torch.device("meta"):
        model = factory()
    with fake_tensor_mode(allow_non_fake_inputs=True):
        model = fake_copy(model).train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = optimizer(params)
        for p in params:                     # the warm-up step creates the optimizer's state
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = sample(BATCH)
        tracker = mem_tracker.MemTracker()
        tracker.track_external(model, opt)
        with tracker:
            if isinstance(batch, dict):      # the batch copied onto the card
                chunk = {k: v.clone() for k, v in batch.items()}
                out = model(**chunk)
            else:
                chunk = batch.clone()
                out = model(chunk)
            del chunk
            loss_of(out).backward()
            opt.step()                       # out and the loss are still alive here
        peak = tracker.get_tracker_snapshot("peak")
    return peak[torch.device("cpu")]["Total"], len(params)


@pytest.fixture
def cuda_rounding(monkeypatch):
    """MemTracker's rule for CUDA storages applied to the fake CPU ones."""
    block = mem_tracker._PYTORCH_MIN_ALLOCATE

    def rounded(self) -> int:
        return math.ceil(self.size * self.element_size / block) * block

    monkeypatch.setattr(mem_tracker._WeakRefInfo, "_calculate_mem_consumed", rounded)


# `make test` runs the CNN (AdamW and SGD: SGD's step against the reference) and GPT-2 with
# AdamW; the other transformer models (seconds each, the same reference) run in `make test-slow`
CASES = [pytest.param(model, opt, id=f"{model}-{opt}",
                      marks=pytest.mark.slow if (opt == "sgd" and model != "cnn")
                      or (opt == "adamw" and model in ("llama", "vit", "bert")) else ())
         for model in MODELS for opt in OPTIMIZERS]


@pytest.mark.parametrize("model, opt", CASES)
def test_single_card_peak_equals_memtrackers(model, opt, cuda_rounding, monkeypatch):
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", False)
    factory, sample = MODELS[model]
    reference, n_params = memtracker_peak(factory, sample, OPTIMIZERS[opt])
    est = estimate_memory(factory, sample, [BATCH], CLUSTER, optimizer=OPTIMIZERS[opt])
    simulated = est.peak_bytes[0] - (2 * parse_cluster(CLUSTER).workspace_bytes(0) + 2**20)
    host_steps = 512 * n_params if opt == "adamw" else 0
    assert simulated == reference - host_steps
