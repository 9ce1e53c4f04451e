"""The estimate says where a bound, not a measurement, sets a card's peak: cuDNN's convolution
workspace, charged as 14 MiB plus the larger of the convolution's input and output."""

from __future__ import annotations

import torch
import torch.nn as nn

from dptune import estimate_memory
from dptune.backends.simulated import SimulatedBackend
from dptune.units import format_bytes

MiB = 2**20


def conv() -> nn.Module:
    return nn.Conv2d(3, 8, 3)


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


def test_a_convolution_at_the_peak_is_named():
    est = estimate_memory(conv, images, [4, 4], "2x24GB")
    # by hand: a chunk's output (4, 8, 30, 30) fp32 is larger than its input (4, 3, 32, 32)
    bound = 14 * MiB + 4 * 8 * 30 * 30 * 4
    note = next(n for n in est.notes if n.startswith("a bound, not a measurement"))
    assert f"card 0: {format_bytes(bound)}, card 1: {format_bytes(bound)}" in note
    assert all(p > bound for p in est.peak_bytes)


def test_no_note_without_the_bound(monkeypatch):
    linear = estimate_memory(lambda: nn.Linear(64, 64), lambda n: torch.randn(n, 64), [4, 4], "2x24GB")
    assert not any("a bound, not a measurement" in n for n in linear.notes)
    monkeypatch.setattr(SimulatedBackend, "_cuda_scratch", False)   # no kernel scratch charged
    est = estimate_memory(conv, images, [4, 4], "2x24GB")
    assert not any("a bound, not a measurement" in n for n in est.notes)
