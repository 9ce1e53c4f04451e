"""The length plan's throughput for DDP ranks (:mod:`dptune.lengths.ddp_speed`): the fastest
per-rank batches of a bucket equal an exhaustive grid, on synthetic ranks (every batch of
every rank enumerated) and on the simulated cluster (each rank's own step timed at every
batch up to its memory cap, the grid over all of them); and the command line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune.backends.base import ProbeResult
from dptune.lengths.ddp_speed import fastest_ranks
from dptune.types import StepTime, TimeSource


@dataclasses.dataclass(frozen=True)
class Outcome:            # the fields of a search outcome fastest_ranks reads and replaces
    best: ProbeResult
    probes: tuple


class Ranks:
    """Rank r: peak ``base + mem[r] * b`` bytes, card time ``fixed[r] + slope[r] * b``
    seconds, host time ``host[r]``; the all-reduce a ring of ``grad`` bytes at ``bw``."""

    def __init__(self, mem, fixed, slope, host, grad=4_000_000, bw=10e9, base=1000):
        self.mem, self.fixed, self.slope, self.host = mem, fixed, slope, host
        self.grad, self.bw, self.base = grad, bw, base
        self.calls = 0

    def allreduce(self, n):
        return 2 * (n - 1) / n * self.grad / self.bw       # the ring's bytes, by hand

    def probe(self, split):
        self.calls += 1
        card = tuple(f + s * b if b else 0.0 for f, s, b in zip(self.fixed, self.slope, split))
        host = tuple(h if b else 0.0 for h, b in zip(self.host, split))
        n = sum(1 for b in split if b)
        step = self.allreduce(n) + max(max(card), max(host))
        peaks = tuple(self.base + m * b for m, b in zip(self.mem, split))
        return ProbeResult(tuple(split), peaks, time=StepTime(card, step, TimeSource.ESTIMATED,
                                                             card_host_seconds=host))


def grid_best(ranks, caps, m=1):
    """The most samples per second over every batch of every rank (1..cap each), by numpy
    broadcasting: the step is the all-reduce plus the slowest of the cards and the hosts."""
    n = len(caps)
    axes = [np.arange(m, c + 1) for c in caps]
    mesh = np.meshgrid(*axes, indexing="ij")
    card = np.max([ranks.fixed[r] + ranks.slope[r] * mesh[r] for r in range(n)], axis=0)
    step = ranks.allreduce(n) + np.maximum(card, max(ranks.host))
    rate = sum(mesh) / step
    k = np.unravel_index(int(np.argmax(rate)), rate.shape)
    return float(rate[k]), tuple(int(mesh[r][k]) for r in range(n))


def plan_of(ranks, budgets, m=1):
    caps = [(b - ranks.base) // mem for b, mem in zip(budgets, ranks.mem)]
    first = [ranks.probe([m] * len(caps)), ranks.probe(caps)]      # what the search probed
    out, notes = fastest_ranks(Outcome(first[1], tuple(first)), ranks.probe, budgets, m,
                               ranks.grad, ranks.bw)
    return caps, out, notes


def rate_of(r: ProbeResult) -> float:
    return r.batch_size / r.time.step_seconds


def test_a_slow_rank_is_held_back_and_the_grid_agrees():
    """Ranks 0 and 1 at 1 ms + 0.1 ms a sample, rank 2 ten times slower per sample: at the
    memory caps (40 each) rank 2 takes 41 ms, the others 5 ms; by hand, rank 2 takes what it
    finishes within the others' 5 ms, 4 samples (1 ms + 4 x 1 ms): 84 samples in 5 ms plus
    the all-reduce, against 120 in 41 ms. The grid says the same."""
    ranks = Ranks(mem=[100, 100, 100], fixed=[1e-3] * 3, slope=[1e-4, 1e-4, 1e-3], host=[5e-4] * 3)
    budgets = [5000] * 3
    caps, out, notes = plan_of(ranks, budgets)
    assert caps == [40, 40, 40]
    best_rate, best_split = grid_best(ranks, caps)
    assert best_split == (40, 40, 4)
    assert out.best.chunk_sizes == best_split
    assert rate_of(out.best) == pytest.approx(best_rate, rel=1e-12)
    assert rate_of(out.best) > 2 * rate_of(out.probes[1])            # the caps' rate
    assert "rank 2 4 of 40" in notes[0] and "[40, 40, 4]" in notes[0]
    assert "padded tokens/s" not in notes[0]            # no length given


def test_a_host_bound_step_fills_every_rank():
    """The hosts take 50 ms, longer than any card at its cap: more samples cost nothing, so
    every rank is at its memory cap."""
    ranks = Ranks(mem=[100, 50, 200], fixed=[1e-3] * 3, slope=[1e-4, 2e-4, 1e-3], host=[0.05] * 3)
    caps, out, _ = plan_of(ranks, [5000, 5000, 8000])
    assert out.best.chunk_sizes == tuple(caps) == grid_best(ranks, caps)[1]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 3), mem=st.lists(st.integers(50, 400), min_size=3, max_size=3),
       fixed=st.lists(st.floats(1e-4, 5e-3), min_size=3, max_size=3),
       slope=st.lists(st.floats(1e-5, 2e-3), min_size=3, max_size=3),
       host=st.floats(0.0, 4e-3), grad=st.integers(0, 10**8), m=st.sampled_from([1, 2]))
def test_synthetic_ranks_equal_the_exhaustive_grid(n, mem, fixed, slope, host, grad, m):
    """Affine ranks (the fits are exact): the plan's rate is the grid's best, and every batch
    it gives is within its rank's budget and at least the smallest."""
    ranks = Ranks(mem[:n], fixed[:n], slope[:n], [host] * n, grad=grad)
    budgets = [6000] * n
    caps, out, _ = plan_of(ranks, budgets, m)
    best_rate, _ = grid_best(ranks, caps, m)
    assert rate_of(out.best) == pytest.approx(best_rate, rel=1e-9)
    assert all(m <= b <= c for b, c in zip(out.best.chunk_sizes, caps))
    assert all(p <= b for p, b in zip(out.best.peak_bytes, budgets))
    assert ranks.calls <= 2 + 6


def test_no_step_time_keeps_the_largest_batches():
    r = ProbeResult((4, 4), (10, 10))
    out, notes = fastest_ranks(Outcome(r, (r,)), lambda s: ProbeResult(tuple(s), (10, 10)),
                               [100, 100], 1, 0, 1e9)
    assert out.best is r and "no DDP probe carries a step time" in notes[0]


# ---- the simulated cluster -----------------------------------------------------------------
SPEC = ("1x420MB,1x430MB,1x425MB,context=384MiB,tflops=0:100,tflops=1:100,tflops=2:3,"
        "bandwidth=2:30GB/s,host=1us")


@pytest.mark.slow
def test_simulated_ranks_equal_the_grid_over_every_batch():
    """Three simulated DDP ranks of a tiny GPT (rank 2 a slow card), one bucket at length 128.
    The oracle, apart from the plan: each rank's largest batch within its budget (its own
    step's peak at b fits, at b + 1 does not), each rank's step timed at every batch up to it
    (the others at one sample), and the grid over all those batches with the step composed by
    hand (the ring all-reduce of the gradient buckets, then the slowest card or host)."""
    from dptune.backends.simulated.ddp import SimulatedDDP
    from dptune.lengths import plan_lengths
    from dptune.lengths.ddp_speed import DDPRanks
    from dptune.step.workload import Workload

    from tests.lengths.test_lengths_search import LENGTHS, gpt, gpt_sample

    plan = plan_lengths(gpt, gpt_sample, LENGTHS, [128], simulate=SPEC, headroom=0, ddp=True,
                        budget_level="allocated", objective="throughput")
    chosen = plan.buckets[0].chunk_sizes
    wl = Workload(gpt, lambda n: gpt_sample(n, 128))
    sim = SimulatedDDP(wl, SPEC)
    budgets = [d.budget_bytes(0) for d in sim.devices]
    caps = []
    for r in range(3):
        lo, hi = 1, 2                       # fits at lo, over at hi (doubling, then bisection)
        while sim.rank(r).estimate([hi]).peak_bytes[0] <= budgets[r]:
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if sim.rank(r).estimate([mid]).peak_bytes[0] <= budgets[r] else (lo, mid)
        caps.append(lo)
    sim.close()
    assert all(1 <= c <= cap for c, cap in zip(chosen, caps))
    ranks = DDPRanks(wl, SPEC)
    card = [[0.0] * (cap + 1) for cap in caps]
    hosts = []
    for r, cap in enumerate(caps):
        for b in range(1, cap + 1):
            t = ranks.probe([b if q == r else 1 for q in range(3)]).time
            card[r][b] = t.card_seconds[r]
        hosts.append(t.card_host_seconds[r])
    allreduce = 2 * 2 / 3 * ranks.grad_bytes() / ranks.speed.link.bandwidth
    ranks.close()
    mesh = np.meshgrid(*[np.arange(1, c + 1) for c in caps], indexing="ij")
    slowest = np.max([np.asarray(card[r])[mesh[r]] for r in range(3)], axis=0)
    rate = sum(mesh) / (allreduce + np.maximum(slowest, max(hosts)))
    t_chosen = allreduce + max(max(card[r][b] for r, b in enumerate(chosen)), max(hosts))
    assert sum(chosen) / t_chosen >= float(rate.max()) * (1 - 1e-3)
    assert chosen[2] < caps[2] and chosen[:2] == tuple(caps[:2])    # the slow card held back
    assert any("DDP ranks' fastest batches" in n for n in plan.notes)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["search", "plan"])
def test_the_command_line_gives_each_bucket_the_ranks_fastest_batches(tmp_path, command, capsys):
    """``dptune search --lengths F --ddp --objective throughput`` and ``dptune plan --lengths
    F`` (its default objective, throughput): per bucket, each rank's batch and the step's
    tokens per second, in lengths.json and on stdout."""
    from dptune.cli import main
    from dptune.errors import EXIT_OK

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [20] * 6 + [100] * 2))
    out = tmp_path / "rep"
    flags = (["--ddp", "--objective", "throughput", "--no-plots", "-q"] if command == "search"
             else [])
    code = main([command, "--model", "tests.support.lengths_models:gpt", "--simulate", SPEC,
                 "--headroom", "0", "--optimizer", "none", "--budget-level", "allocated",
                 "--sample", "tests.support.lengths_models:batch", "--lengths", str(lengths),
                 "--buckets", "32", "--out", str(out), *flags])
    assert code == EXIT_OK
    saved = json.loads((out / "lengths.json").read_text())
    assert saved["ddp"] and len(saved["buckets"]) == 2
    assert all(min(b["chunk_sizes"]) >= 1 for b in saved["buckets"])
    notes = saved["notes"]
    assert sum("DDP ranks' fastest batches" in n for n in notes) == 2
    assert any(n.startswith("speed: length <= 20: step") and "length <= 100: step" in n for n in notes)
    if command == "plan":        # the printed plan: each bucket's batches, then their speed
        printed = capsys.readouterr().out.splitlines()
        assert sum(ln.startswith("note: length <= ") and "padded tokens/s" in ln
                   for ln in printed) == 2
        assert any(ln.startswith("speed: length <= 20: step") for ln in printed)


def test_ranks_of_one_card_type_are_timed_at_their_own_speed():
    """Three cards of one type share a simulator; card 2 is given 3 TFLOPS and 30 GB/s. Each
    rank's time at batch 8 is its own card's, whatever order they were probed in: ranks 0
    and 1 alike, rank 2 as a one-card cluster of its speed times it, and slower."""
    from dptune.lengths.ddp_speed import DDPRanks
    from dptune.step.workload import Workload

    from tests.lengths.test_lengths_search import gpt, gpt_sample

    wl = Workload(gpt, lambda n: gpt_sample(n, 32))
    ranks = DDPRanks(wl, "3x4GB,tflops=2:3,bandwidth=2:30GB/s")
    alone = DDPRanks(wl, "1x4GB,tflops=0:3,bandwidth=0:30GB/s")
    try:
        ranks.probe([1, 1, 8])                   # rank 2 first, then the others at 8
        t = ranks.probe([8, 8, 8]).time
        slow = alone.probe([8]).time
    finally:
        ranks.close()
        alone.close()
    assert t.card_seconds[0] == t.card_seconds[1]
    assert t.card_seconds[2] == pytest.approx(slow.card_seconds[0], rel=1e-12)
    assert t.card_seconds[2] > t.card_seconds[0]
    assert t.card_host_seconds[2] == pytest.approx(slow.card_host_seconds[0])
