"""``estimate_memory`` answers at the three levels the tuner's probes have: the allocated
peak, the reserved peak (the allocator model's replay) and the total use per card."""

from __future__ import annotations

import pytest

import torch
import torch.nn as nn

from dptune import Tuner, estimate_memory
from dptune.budget import FixedCosts
from dptune.backends.simulated import parse_cluster

CLUSTER = "2x24GB"
SEGMENT = 2 * 1024 * 1024          # the caching allocator reserves whole 2 MiB pages


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))


def sample(n: int) -> torch.Tensor:
    return torch.randn(n, 512)


def adamw(p):
    return torch.optim.AdamW(p)


@pytest.mark.slow
def test_the_three_levels_are_the_tuners():
    est = estimate_memory(mlp(), sample, [40, 24], CLUSTER, optimizer=adamw)
    assert est.allocated_bytes == est.peak_bytes
    assert est.reserved_bytes is not None and est.total_bytes is not None
    cluster = parse_cluster(CLUSTER)
    nccl = FixedCosts().nccl_for(2)
    for card, (a, r, t) in enumerate(zip(est.peak_bytes, est.reserved_bytes, est.total_bytes)):
        assert a <= r and r % SEGMENT == 0, (card, a, r)
        assert t == r + cluster.devices[card].context_bytes + nccl
    # the tuner's probe of the same split, at its default level (reserved), has the same figures
    result = Tuner(mlp(), sample, batch_size=64, simulate=CLUSTER, optimizer=adamw,
                   verbose=False).fit()
    even = next(p for p in result.probes if list(p.chunk_sizes) == [32, 32])
    again = estimate_memory(mlp(), sample, [32, 32], CLUSTER, optimizer=adamw)
    assert list(even.allocated_peak_bytes) == again.peak_bytes
    assert list(even.reserved_bytes) == again.reserved_bytes
    assert list(even.total_bytes) == again.total_bytes
    assert list(even.peak_bytes) == [t - d.context_bytes for t, d in
                                     zip(again.total_bytes, cluster.devices)]   # what it checked


def test_the_allocator_setting_changes_the_reserved_level_only():
    plain = estimate_memory(mlp(), sample, [16, 16], CLUSTER)
    expandable = estimate_memory(mlp(), sample, [16, 16], CLUSTER,
                                 allocator="expandable_segments:True", nccl_bytes="100MiB")
    assert expandable.peak_bytes == plain.peak_bytes
    cluster = parse_cluster(CLUSTER)
    assert expandable.total_bytes == [r + d.context_bytes + 100 * 2**20 for r, d in
                                      zip(expandable.reserved_bytes, cluster.devices)]
