"""CUDA's per-op scratch in the simulator (dptune/backends/simulated/scratch.py), against
torch's own rules and hand counts.

The rule for a matrix operand is ``prepare_matrix_for_cublas`` in torch's
``aten/src/ATen/native/cuda/Blas.cpp``: a 2-D operand that is dense, or strided as a column-
or row-major matrix (stride 1 in one dimension and at least the other size in the other),
goes to cuBLAS as it is; any other is cloned contiguous for the call."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dptune.backends.simulated import SimulatedBackend, estimate_memory, parse_cluster
from dptune.backends.simulated.scratch import _blas_copy, conv_workspace_bound

R = 512


def rnd(n: int) -> int:
    return -(-n // R) * R


@pytest.mark.parametrize("make, copied", [
    (lambda: torch.ones(()).expand(64, 10), True),            # the gradient of out.sum()
    (lambda: torch.ones(10, 64).t(), False),                 # a transposed matrix: column-major
    (lambda: torch.ones(64, 10), False),
    (lambda: torch.ones(64, 20)[:, :10], False),             # rows strided by 20 >= 10
    (lambda: torch.ones(64, 20)[:, ::2], True),              # stride 2 in both: neither layout
    (lambda: torch.ones(1, 10).expand(64, 10), True),        # rows repeated (stride 0)
])
def test_which_matrix_operands_cublas_gets_a_copy_of(make, copied):
    assert _blas_copy(make()) is copied


IN, OUT, B = 8, 4096, 64


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.lin(x)


def _estimate(scratch: bool, monkeypatch):
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", scratch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return estimate_memory(Wide(), lambda b: torch.randn(b, IN), [B], "1x24GB")


def test_the_sum_losss_gradient_is_copied_for_the_weight_gradients_mm(monkeypatch):
    ws = 2 * parse_cluster("1x24GB").workspace_bytes(0) + 2**20
    w, x, y, scalar = rnd(IN * OUT * 4), rnd(B * IN * 4), rnd(B * OUT * 4), R
    # without scratch (the CPU's kernels): when the weight's gradient is made, the weight
    # and its gradient, the batch (saved), the output (held through the step), the loss and
    # its gradient (0-dim, the storage of the expanded gradient the mm reads)
    plain = _estimate(False, monkeypatch)
    assert plain.peak_bytes == [ws + 2 * w + x + y + 2 * scalar]
    # on CUDA that mm (input^T @ grad) gets the (B, OUT) gradient of out.sum(), a 0-dim
    # tensor expanded (strides 0, 0): cuBLAS is given a contiguous copy of it for the call
    cuda = _estimate(True, monkeypatch)
    assert cuda.peak_bytes == [ws + 2 * w + x + y + 2 * scalar + y]
    assert cuda.breakdown[0]["other"] == ws + y


def test_convolutions_take_a_workspace_bound_in_both_directions(monkeypatch):
    conv = nn.Conv2d(3, 8, 3, padding=1)
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = estimate_memory(conv, lambda b: torch.randn(b, 3, 16, 16), [2], "1x24GB")
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = estimate_memory(conv, lambda b: torch.randn(b, 3, 16, 16), [2], "1x24GB")
    x, y = torch.empty(2, 3, 16, 16), torch.empty(2, 8, 16, 16)
    bound = conv_workspace_bound(x, y)
    # at least the largest workspace the H200 gave a convolution of tensors under 1 MB
    # (SmallResNet's 512-channel layers: 12,845,447 bytes, benchmarks/measured/h200-2026-11-27)
    assert bound >= 12_845_447
    # the backward's copy of the expanded gradient of out.sum() (2, 8, 16, 16), and the bound
    assert est.peak_bytes[0] - plain.peak_bytes[0] >= bound
    assert est.peak_bytes[0] - plain.peak_bytes[0] <= bound + rnd(2 * 8 * 16 * 16 * 4)
