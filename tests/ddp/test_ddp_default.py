"""The DDP plan's default objective: the fastest per-rank batches that fit, never slower than
equal batches where memory does not bind, and each rank's reason in the plan (object, text,
JSON)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch
import torch.nn as nn

from dptune import ddp
from dptune.backends.simulated import parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
from dptune.ddp.result import RankReason
from dptune.ddp.throughput import equal_split
from dptune.step.presets import adamw
from dptune.step.workload import Workload


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10))


def vectors(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


def _ms(note: str, label: str) -> float:
    return float(re.search(label + r"[^:]*?:? ([0-9.]+) ms", note).group(1))  # type: ignore[union-attr]


def _per_s(note: str) -> float:
    """The plan's own samples per second in a speed note."""
    return float(re.search(r"this plan [^,]*?, ([0-9,]+) samples/s", note).group(1).replace(",", ""))  # type: ignore[union-attr]


def test_default_on_the_issue_case_is_equal_batches_and_not_slower():
    # 24GB+24GB+12GB, a tiny MLP: memory does not bind and the cards are equally fast (the
    # simulator's default speed for a card named by its memory), so equal batches are fastest;
    # 'balance' gave [44, 45, 1]
    plan = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90, simulate="2x24GB,12GB")
    assert plan.objective == "throughput"
    assert plan.batch_sizes == [30, 30, 30]
    assert all(r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
               for r in plan.ranks)
    assert all(r.reason is not None and r.reason is not RankReason.MEMORY_CAP for r in plan.ranks)
    speed = next(n for n in plan.notes if n.startswith("speed (estimated)"))
    assert _ms(speed, "this plan") <= _ms(speed, r"equal batches \[30, 30, 30\]")
    assert any("the default" in n for n in plan.notes)
    balance = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90, simulate="2x24GB,12GB",
                       objective="balance")
    assert balance.batch_sizes[2] < 5
    assert {r.reason for r in balance.ranks} == {RankReason.MEMORY_BALANCE}
    # the default is at least as fast as the memory-balanced plan (estimated samples/s)
    slow = next(n for n in balance.notes if n.startswith("speed (estimated)"))
    assert _per_s(speed) >= _per_s(slow)


def _exact_cap(model, spec: str, rank: int, headroom: int) -> int:
    """The largest batch rank ``rank`` fits, by bisection on the simulator (not the planner)."""
    cluster = parse_cluster(spec)
    budget = cluster.devices[rank].budget_bytes(headroom)
    sim = SimulatedDDPRank(Workload(model, vectors, None, adamw), card_of(cluster, rank))
    lo, hi = 1, 1 << 20
    try:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if sim.estimate([mid]).peak_bytes[0] <= budget:
                lo = mid
            else:
                hi = mid - 1
    finally:
        sim.close()
    return lo


def test_default_where_memory_binds_caps_that_rank_and_says_so():
    spec = "2x24GB,24GB,used=2:23.5GB"      # rank 2 has 0.5 GB: the batch does not fit there
    # the allocated level: the cap's oracle bisects the simulator's allocated peaks
    plan = ddp.plan(wide(), vectors, optimizer=adamw, global_batch=9000, simulate=spec, headroom=0,
                    budget_level="allocated")
    b = plan.batch_sizes
    cap = _exact_cap(wide, spec, 2, 0)
    assert sum(b) == 9000 and cap < 3000
    assert b[2] <= cap and b[2] >= cap - cap // 100        # at its cap (within the fit's 1%)
    assert abs(b[0] - b[1]) <= 1 and b[0] > b[2]           # the other two share the rest
    assert plan.ranks[2].reason is RankReason.MEMORY_CAP
    assert plan.ranks[0].reason is not RankReason.MEMORY_CAP
    assert plan.ranks[2].measured_peak_bytes <= plan.ranks[2].budget_bytes
    lines = plan.summary().splitlines()
    assert any(line.startswith("rank  batch") and line.endswith("why") for line in lines)
    row2 = next(line for line in lines if line.strip().startswith("2 "))
    assert row2.rstrip().endswith("memory cap")
    again = ddp.DDPPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and plan.to_dict()["ranks"][2]["reason"] == "memory cap"


def test_default_without_step_times_gives_batches_as_equal_as_memory_allows():
    # FSDP has no time estimate: the ranks are taken as equally fast
    plan = ddp.plan(lambda: nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)),
                    lambda n: torch.randn(n, 16), optimizer=adamw, global_batch=31,
                    simulate="32GB,24GB,12GB", strategy="fsdp")
    assert plan.batch_sizes == [11, 10, 10]
    assert {r.reason for r in plan.ranks} == {RankReason.EQUAL}
    assert any("taken as equally fast" in n for n in plan.notes)


@pytest.mark.parametrize("m", [1, 2])
def test_equal_split_is_the_smallest_largest_batch_by_brute_force(m):
    for caps in itertools.product(range(0, 7), repeat=3):
        for batch in range(0, 19):
            got = equal_split(caps, batch, m)
            splits = [s for s in itertools.product(*(range(m, c + 1) for c in caps))
                      if sum(s) == batch]
            if not splits:
                assert got is None, (caps, batch)
                continue
            assert got is not None, (caps, batch)
            s = got.chunk_sizes
            assert sum(s) == batch and all(m <= x <= c for x, c in zip(s, caps))
            assert max(s) == min(max(t) for t in splits)
            free = [x for x, c in zip(s, caps) if x < c]      # ranks below their cap
            assert not free or max(s) - min(free) <= 1


def test_cli_plan_default_is_the_fastest_with_reasons(tmp_path, capsys):
    from dptune.cli import main

    code = main(["plan", "--model", "dptune.examples.models:MLP", "--simulate", "2x24GB,12GB",
                 "--batch-size", "90", "--out", str(tmp_path / "p.json"), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["objective"] == "throughput"
    assert all(r["reason"] for r in printed["ranks"])
