"""Inside a real DDP job (gloo, 2 and 3 ranks), each rank times its own card and the plan is
the fastest that fits: the ranks' cards are CPUs with a memory model and a clock the test
sets (``tests/support/ddp_time_workers.py``), a forward and a backward of ``b`` samples
lasting ``fixed + per_sample * b`` seconds each on that card.

The references are the hand counts of those clocks and a brute-force grid over every
per-rank split of the global batch on the same curves, within each rank's memory cap (the
largest batch whose peak, ``BASE + PER_SAMPLE * b`` plus the rank's DDP buckets, is within
its budget)."""

from __future__ import annotations

import itertools

import pytest

import ddp_time_workers as tw

MS = 1e-3
GiB = 1 << 30
# per world size: each rank's fixed cost and cost per sample (seconds, forward and backward
# each), the global batch; rank 1 is the slowest per sample everywhere
SPEEDS = {2: ([2 * MS, 2 * MS], [1 * MS, 3 * MS], 40),
          3: ([2 * MS, 2 * MS, 4 * MS], [1 * MS, 3 * MS, 0.5 * MS], 60)}
TIGHT = tw.BASE + 20 * tw.MiB          # a card with room for 19 samples (plus the buckets)
ROOM = tw.BASE + 30 * tw.MiB           # 29 samples
# gradient accumulation: a global batch more than one step holds (per world size: the cards'
# memory, the samples per optimizer step)
ACCUMULATE = {2: ([TIGHT, ROOM], 120), 3: ([ROOM, ROOM, TIGHT], 180)}


def _totals(world: int, tight: bool) -> list[int]:
    """Every card 1 GiB; with ``tight`` the fastest card per sample has little memory."""
    totals = [GiB] * world
    if tight:
        fastest = min(range(world), key=lambda r: SPEEDS[world][1][r])
        totals[fastest] = TIGHT
    return totals


def _jobs(world: int) -> list:
    fixed, per, batch = SPEEDS[world]
    common = dict(fixed=fixed, per_sample=per, global_batch=batch)
    return [
        ("timed_plan:fast", dict(common, totals=_totals(world, False), objective="throughput")),
        ("timed_plan:default", dict(common, totals=_totals(world, True))),
        ("timed_plan:untimed", dict(common, totals=_totals(world, False), objective="throughput",
                                    untimed=1)),
        ("timed_plan:untimed_default", dict(common, totals=_totals(world, False), untimed=1)),
        ("timed_plan:accumulate", dict(common, totals=ACCUMULATE[world][0],
                                       global_batch=ACCUMULATE[world][1], micro_batches="auto")),
    ]


pytestmark = pytest.mark.slow     # real gloo processes: several seconds a job


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def job(request):
    world = request.param
    return world, tw.launch(world, _jobs(world), timeout=240)


def _plans(out, world: int, label: str) -> dict:
    got = [out[r][label] for r in range(world)]
    assert all("error" not in g for g in got), got
    first = got[0]["plan"]
    assert all(g["plan"] == first for g in got[1:])          # every rank: the same plan
    return first


def _card_seconds(world: int, r: int, b: int) -> float:
    """Rank r's forward and backward of b samples, by hand from its clock."""
    fixed, per, _ = SPEEDS[world]
    return 2 * (fixed[r] + per[r] * b)


def _cap(plan: dict, r: int) -> int:
    """Rank r's largest batch within its budget, from the memory model."""
    rank = plan["ranks"][r]
    return (rank["budget_bytes"] - rank["ddp_bytes"] - tw.BASE) // tw.PER_SAMPLE


def _brute_force(world: int, caps: list[int], batch: int) -> tuple[float, set]:
    """The shortest step of every split of ``batch`` (each rank 1..cap) and the splits
    reaching it."""
    best, arg = float("inf"), set()
    for split in itertools.product(*(range(1, c + 1) for c in caps)):
        if sum(split) != batch:
            continue
        t = max(_card_seconds(world, r, b) for r, b in enumerate(split))
        if t < best - 1e-12:
            best, arg = t, {split}
        elif abs(t - best) <= 1e-12:
            arg.add(split)
    return best, arg


def _check_fastest(world: int, plan: dict) -> list[int]:
    sizes = plan["batch_sizes"]
    batch = SPEEDS[world][2]
    # every probe that ran carries its rank's time, the clock's hand count (the fits' points)
    timed = [p for p in plan["probes"] if p["peak_bytes"] is not None]
    assert timed and all(p["seconds"] == pytest.approx(_card_seconds(world, p["rank"], p["batch_size"]),
                                                       rel=1e-9) for p in timed)
    caps = [min(_cap(plan, r), batch) for r in range(world)]
    best, arg = _brute_force(world, caps, batch)
    got = max(_card_seconds(world, r, b) for r, b in enumerate(sizes))
    assert got == pytest.approx(best, rel=1e-9)
    assert tuple(sizes) in arg, (sizes, sorted(arg))
    for rank in plan["ranks"]:                                # measured within budget
        assert rank["measured_peak_bytes"] is not None
        assert rank["measured_peak_bytes"] <= rank["budget_bytes"]
    assert any(n.startswith("speed (measured): ") for n in plan["notes"])
    assert any(n.startswith("step times measured on each rank's card") for n in plan["notes"])
    return sizes


def test_the_slower_rank_gets_fewer_samples_and_the_split_is_the_fastest(job):
    world, out = job
    plan = _plans(out, world, "timed_plan:fast")
    assert plan["objective"] == "throughput"
    sizes = _check_fastest(world, plan)
    assert sizes[1] == min(sizes) and sizes[1] < sizes[0]     # rank 1: the slowest per sample
    # the plan is faster than equal batches, by the hand counts
    n, batch = world, SPEEDS[world][2]
    even = [batch // n + (1 if r < batch % n else 0) for r in range(n)]
    assert max(_card_seconds(world, r, b) for r, b in enumerate(sizes)) < \
        max(_card_seconds(world, r, b) for r, b in enumerate(even))


def test_the_default_is_the_fastest_within_a_binding_memory_cap(job):
    world, out = job
    plan = _plans(out, world, "timed_plan:default")
    assert plan["objective"] == "throughput"
    sizes = _check_fastest(world, plan)
    fastest = min(range(world), key=lambda r: SPEEDS[world][1][r])
    assert sizes[fastest] == _cap(plan, fastest) == 19        # held by its memory, not its speed
    assert plan["ranks"][fastest]["reason"] == "memory cap"
    assert any("the default" in n for n in plan["notes"])


def test_a_rank_whose_timing_fails_fails_every_rank_with_the_same_message(job):
    world, out = job
    got = [out[r]["timed_plan:untimed"] for r in range(world)]
    assert all(g.get("error") == "BackendUnavailableError" for g in got), got
    assert len({g["message"] for g in got}) == 1
    message = got[0]["message"]
    assert "rank 1: the step was not timed" in message and "objective='balance'" in message
    assert all(g["seconds"] < 60 for g in got)                 # no rank waited for a timeout
    # by default the plan goes on, the ranks taken as equally fast, and says why
    plan = _plans(out, world, "timed_plan:untimed_default")
    batch = SPEEDS[world][2]
    assert max(plan["batch_sizes"]) - min(plan["batch_sizes"]) <= 1 and sum(plan["batch_sizes"]) == batch
    assert any("rank 1: the step was not timed" in n and "equally fast" in n for n in plan["notes"])
    assert not any(n.startswith("speed (") for n in plan["notes"])


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def test_a_global_batch_with_accumulation_takes_the_fastest_micro_batches(job):
    """Every number of micro-batches k that divides the global batch G and every split of
    G/k within the caps, by brute force: the plan's k·(slowest rank) is the least (ties go
    to fewer micro-batches)."""
    world, out = job
    plan = _plans(out, world, "timed_plan:accumulate")
    G = ACCUMULATE[world][1]
    k, sizes = plan["micro_batches"], plan["batch_sizes"]
    assert k * sum(sizes) == G and k > 1
    caps = [_cap(plan, r) for r in range(world)]
    assert sum(caps) < G                                     # one step cannot hold it
    best = {}
    for kk in _divisors(G):
        if G // kk >= world and sum(caps) >= G // kk:
            t, arg = _brute_force(world, caps, G // kk)
            best[kk] = (kk * t, arg)
    least = min(v[0] for v in best.values())
    first = min(kk for kk, v in best.items() if v[0] <= least * (1 + 1e-9))
    assert k == first, ({kk: v[0] for kk, v in best.items()}, k)
    assert tuple(sizes) in best[k][1]
    assert k * max(_card_seconds(world, r, b) for r, b in enumerate(sizes)) == pytest.approx(least)
    # not simply the fewest micro-batches that fit: the case is chosen so that it is slower
    fewest = min(best)
    assert best[fewest][0] > least
    assert any(n.startswith(f"global batch {G} per optimizer step: {k} micro-batches")
               for n in plan["notes"])


def test_a_plan_on_real_cards_says_its_peaks_are_measured(job):
    world, out = job
    plan = _plans(out, world, "timed_plan:fast")
    level = next(n for n in plan["notes"] if n.startswith("budgets checked against the reserved"))
    assert "max_memory_reserved" in level and "a model of the caching allocator" not in level
    assert any(n.startswith("a rank's batch certified") and "expandable_segments:True" in n
               for n in plan["notes"])
