"""The planners' benchmarks at a budget level: the level options and the pure helpers that
read a plan's probes and notes (which ranks and buckets are certified, and why not)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import config
from benchmarks.ddp import open_brackets, rank_certified, scan_agrees
from benchmarks.lengths import uncertified_bucket_notes
from dptune.budget import DEFAULT_HEADROOM, DEFAULT_LEVEL, BudgetLevel
from dptune.lengths.plan import BucketPlan, LengthPlan
from dptune.search.ranks import RankProbe


def test_level_options_default_to_dptunes_level_and_its_headroom():
    ap = argparse.ArgumentParser()
    config.add_level_options(ap)
    args = ap.parse_args([])
    assert args.level == DEFAULT_LEVEL.value == config.LEVELS[0]
    budget = config.level_budget(args.level, args.headroom)
    assert budget.level is BudgetLevel.RESERVED and budget.reserved is not None
    assert budget.headroom_bytes == DEFAULT_HEADROOM[BudgetLevel.RESERVED]
    other = config.level_budget(*vars(ap.parse_args(["--level", "allocated"])).values())
    assert other.reserved is None and other.headroom_bytes == DEFAULT_HEADROOM[BudgetLevel.ALLOCATED]
    assert config.level_budget("reserved", "1GiB").headroom_bytes == 2**30


def _p(rank: int, b: int, fits: bool) -> RankProbe:
    return RankProbe(rank=rank, batch_size=b, peak_bytes=b, fits=fits)


def test_a_rank_is_certified_by_its_own_probes_at_its_batch_and_one_more():
    probes = [_p(0, 10, True), _p(0, 11, False), _p(1, 10, True), _p(1, 13, False),
              _p(2, 7, True), _p(1, 11, True)]
    # rank 1 fits at 11 but its batch is 10; rank 2 was never measured at 8; rank 0 only at 10/11
    assert rank_certified(probes, [10, 10, 7]) == [True, False, False]
    assert rank_certified(probes, [10, 11, 7]) == [True, False, False]
    assert open_brackets(probes, [10, 11, 7]) == [
        "rank 1: planned 11, fits at 11, over at 13", "rank 2: planned 7, fits at 7, over at None"]


def test_the_scan_agrees_only_when_every_batch_fits_up_to_the_cap_and_none_above():
    assert scan_agrees(lambda b: b <= 20, 20, 4)
    assert not scan_agrees(lambda b: b <= 20 or b == 23, 20, 4)    # fits again above a failure
    assert not scan_agrees(lambda b: b <= 20 and b != 18, 20, 4)   # a hole below the cap
    assert scan_agrees(lambda b: b <= 2, 2, 4)                      # starts at batch 1


def test_the_notes_of_uncertified_buckets_only():
    def bucket(length: int, certified: bool) -> BucketPlan:
        return BucketPlan(lo=0, length=length, samples=10, chunk_sizes=(2, 2), peak_bytes=(1, 1),
                          binding_card=0, certified=certified)
    plan = LengthPlan(buckets=(bucket(128, True), bucket(512, False)), devices=("a", "b"),
                      budget_bytes=(1, 1), notes=("budgets checked against the reserved level",
                                                  "length <= 128: fine", "length <= 512: open",
                                                  "length <= 5120: another"))
    assert uncertified_bucket_notes(plan) == ["length <= 512: open"]


@pytest.mark.slow
def test_ddp_caps_at_the_reserved_level_are_below_the_allocated_ones():
    """The reserved figure (the allocator's segments plus NCCL) is never below the allocated
    peak, so at one headroom a rank's cap at the reserved level is at most its allocated cap;
    the scan around each reserved cap runs the batches there one by one."""
    import torch
    import torch.nn as nn

    from benchmarks.ddp import exact_caps, scan_caps
    from dptune.step.workload import Workload

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))

    def batch(b: int) -> torch.Tensor:
        return torch.randn(b, 64)

    spec, room = "4GB,4GB,used=1:1GB", 256 * 2**20
    allocated = exact_caps(Workload(net, batch), spec, room)
    reserved, _ = scan_caps(Workload(net, batch), spec, room,
                                  config.level_budget("reserved").reserved, width=2)
    assert all(0 < r <= a for r, a in zip(reserved, allocated)) and reserved[0] > reserved[1]
