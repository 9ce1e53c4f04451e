"""The throughput solver against an exhaustive grid on synthetic per-card time and memory
curves (the oracle enumerates every split; it shares no code with the solver)."""

from __future__ import annotations

import itertools
import random

import pytest

from dptune.solve.time import TimeFit, fastest_split, fit_time


def grid(times, overhead, serial, m, batch=None, every_card=False, linear=None):
    """Every split within the caps: the shortest step for ``batch`` or the best rate."""
    linear = linear or [0.0] * len(times)
    options = [[0] * (not every_card) + list(range(m, len(t))) for t in times]
    best = None
    for split in itertools.product(*options):
        b = sum(split)
        if b == 0 or (batch is not None and b != batch):
            continue
        used = frozenset(i for i, c in enumerate(split) if c)
        t = (overhead(used) + serial[0] + serial[1] * b + sum(g * c for g, c in zip(linear, split))
             + max(times[i][split[i]] for i in used))
        score = -t if batch is not None else b / t
        if best is None or score > best[0]:
            best = (score, split)
    return best


def curve(cap, fixed, per, rng, noise=0.0):
    out, t = [0.0], 0.0
    for c in range(1, cap + 1):
        t = max(t, fixed + per * c + rng.uniform(0, noise))
        out.append(t)
    return out


def dp_overhead(comm):
    return lambda used: comm if used - {0} else 0.0


@pytest.mark.parametrize("seed", range(16))
def test_equals_the_grid_on_random_curves(seed):
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    times = [curve(rng.randint(2, 9), rng.uniform(0, 3), rng.uniform(0.1, 2), rng, noise=0.5)
             for _ in range(n)]
    overhead = dp_overhead(rng.uniform(0, 2))
    serial = (rng.uniform(0, 1), rng.uniform(0, 0.2))
    m = rng.choice([1, 2])
    # DataParallel's gather: a cost per sample of every card but card 0 (half the cases)
    linear = [0.0] + [rng.uniform(0, 0.5) for _ in range(n - 1)] if seed % 2 else None
    for batch in [None] + sorted({rng.randint(1, 20) for _ in range(4)}):
        want = grid(times, overhead, serial, m, batch, linear=linear)
        got = fastest_split(times, batch, overhead=overhead, serial=serial, min_chunk=m,
                            linear=linear)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert all(c == 0 or m <= c <= len(t) - 1 for c, t in zip(got.chunk_sizes, times))
        if batch is None:
            assert got.samples_per_second == pytest.approx(want[0])
        else:
            assert got.batch_size == batch
            assert got.step_seconds == pytest.approx(-want[0])


@pytest.mark.parametrize("seed", range(12))
def test_the_best_rate_up_to_a_batch_equals_the_grid(seed):
    rng = random.Random(300 + seed)
    n = rng.choice([2, 3, 4])
    times = [curve(rng.randint(2, 9), rng.uniform(0, 3), rng.uniform(0.1, 2), rng, noise=0.5)
             for _ in range(n)]
    overhead = dp_overhead(rng.uniform(0, 2))
    serial = (rng.uniform(0, 1), rng.uniform(0, 0.2))
    m = rng.choice([1, 2])
    linear = [0.0] + [rng.uniform(0, 0.5) for _ in range(n - 1)] if seed % 2 else None
    for cap in sorted({rng.randint(1, 20) for _ in range(4)}):
        rates = [grid(times, overhead, serial, m, b, linear=linear) for b in range(1, cap + 1)]
        want = max(((b + 1) / -r[0], r[1]) for b, r in enumerate(rates) if r is not None) \
            if any(rates) else None
        got = fastest_split(times, None, overhead=overhead, serial=serial, min_chunk=m,
                            linear=linear, max_batch=cap)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.batch_size <= cap
        assert got.samples_per_second == pytest.approx(want[0])


def host_grid(times, overhead, host, m, linear=None, every_card=False):
    """The best rate over every split, each step floored by the host's time for its cards."""
    linear = linear or [0.0] * len(times)
    options = [[0] * (not every_card) + list(range(m, len(t))) for t in times]
    best = None
    for split in itertools.product(*options):
        used = frozenset(i for i, c in enumerate(split) if c)
        if not used:
            continue
        t = max(host(used), overhead(used) + sum(g * c for g, c in zip(linear, split))
                + max(times[i][split[i]] for i in used))
        if best is None or sum(split) / t > best:
            best = sum(split) / t
    return best


def test_the_hosts_floor_counts_in_the_best_rate_by_hand():
    """Card 0: 1 ms + 1.4 ms a sample, card 1: 2 ms + 0.01 ms a sample (cap 100); the host
    takes 4 ms. Card 0 finishes 2 samples within the host's 4 ms (3.8 ms): 102 samples in
    4 ms. Stopping at card 1's 3 ms (card 0 at one sample) still takes the host's 4 ms for
    101."""
    times = [[0.0] + [1e-3 + 1.4e-3 * c for c in range(1, 11)],
             [0.0] + [2e-3 + 1e-5 * c for c in range(1, 101)]]
    got = fastest_split(times, None, every_card=True, host=lambda used: 4e-3)
    assert got is not None and got.chunk_sizes == (2, 100)
    assert got.samples_per_second == pytest.approx(102 / 4e-3)


@pytest.mark.parametrize("seed", range(12))
def test_the_best_rate_under_a_host_floor_equals_the_grid(seed):
    rng = random.Random(700 + seed)
    n = rng.choice([2, 3])
    times = [curve(rng.randint(2, 9), rng.uniform(0, 3), rng.uniform(0.1, 2), rng, noise=0.5)
             for _ in range(n)]
    overhead = dp_overhead(rng.uniform(0, 2))
    per_card = [rng.uniform(0, 4) for _ in range(n)]
    base = rng.uniform(0, 6)
    host = lambda used: base + sum(per_card[i] for i in used)    # noqa: E731
    m = rng.choice([1, 2])
    linear = [0.0] + [rng.uniform(0, 0.5) for _ in range(n - 1)] if seed % 2 else None
    every = seed % 3 == 0
    want = host_grid(times, overhead, host, m, linear, every)
    got = fastest_split(times, None, overhead=overhead, min_chunk=m, linear=linear, host=host,
                        every_card=every)
    assert (got is None) == (want is None)
    if got is not None:
        assert got.samples_per_second == pytest.approx(want)


@pytest.mark.parametrize("seed", range(4))
def test_every_card_as_ddp_ranks_equals_the_grid(seed):
    rng = random.Random(100 + seed)
    times = [curve(rng.randint(3, 8), rng.uniform(0, 1), rng.uniform(0.1, 1), rng) for _ in range(3)]
    ring = lambda used: 0.3 * (len(used) - 1) / len(used)   # noqa: E731
    for batch in (None, 9, 12):
        want = grid(times, ring, (0.0, 0.0), 1, batch, every_card=True)
        got = fastest_split(times, batch, overhead=ring, every_card=True)
        if want is None:                 # more than the caps hold
            assert got is None and batch is not None and batch > sum(len(t) - 1 for t in times)
            continue
        assert got is not None
        assert 0 not in got.chunk_sizes
        score = got.samples_per_second if batch is None else -got.step_seconds
        assert score == pytest.approx(want[0])


def test_a_card_worth_dropping():
    # two fast cards and one slow card with a large fixed cost: the fixed batch of 12 is
    # faster on the two fast cards alone, and so is the best rate
    fast = [0.0] + [1.0 + 0.1 * c for c in range(1, 11)]
    slow = [0.0] + [5.0 + 1.0 * c for c in range(1, 11)]
    times = [fast, fast, slow]
    for batch in (12, None):
        want = grid(times, lambda s: 0.0, (0.0, 0.0), 1, batch)
        got = fastest_split(times, batch)
        assert got is not None and want is not None
        assert got.dropped == (2,)
        assert want[1][2] == 0
        score = got.samples_per_second if batch is None else -got.step_seconds
        assert score == pytest.approx(want[0])
    # but with every card forced in (DDP ranks), it cannot be dropped
    forced = fastest_split(times, 12, every_card=True)
    assert forced is not None and forced.dropped == ()


def test_memory_caps_bind_the_fast_card():
    # a fast card that holds only 3 samples and a slow one that holds 20
    fast = [0.0] + [0.1 * c for c in range(1, 4)]
    slow = [0.0] + [1.0 * c for c in range(1, 21)]
    got = fastest_split([fast, slow], 10)
    assert got is not None and got.chunk_sizes == (3, 7)


def test_fit_time_recovers_an_affine_curve_and_clamps_noise():
    f = fit_time([(2, 1.4), (4, 1.8), (8, 2.6)])
    assert f is not None
    assert f.fixed_seconds == pytest.approx(1.0) and f.per_sample_seconds == pytest.approx(0.2)
    assert f.predict(0) == 0.0 and f.predict(5) == pytest.approx(2.0)
    one = fit_time([(4, 2.0)])
    assert one == TimeFit(0.0, 0.5, points=1)
    falling = fit_time([(1, 3.0), (2, 1.0)])       # noise: time never falls with more samples
    assert falling is not None and falling.per_sample_seconds >= 0 and falling.fixed_seconds >= 0
    assert fit_time([(0, 1.0)]) is None


# ---- a fixed global batch with accumulation ----------------------------------------------------

def accumulation_grid(time_at, cap_at, n, global_batch, overhead, serial, m):
    """Every number of equal micro-batches k (k divides the global batch) and every split of
    G/k within the caps at G/k: the least time for the whole global batch, k steps."""
    best = None
    for k in range(1, global_batch + 1):
        if global_batch % k:
            continue
        b = global_batch // k
        options = [[0] + list(range(m, cap_at(i, b) + 1)) for i in range(n)]
        for split in itertools.product(*options):
            if sum(split) != b:
                continue
            used = frozenset(i for i, c in enumerate(split) if c)
            step = (overhead(used) + serial[0] + serial[1] * b
                    + max(time_at(i, split[i]) for i in used))
            if best is None or k * step < best[0] - 1e-12:
                best = (k * step, k, split)
    return best


def synthetic(rng, n, slow_card=None):
    """Per-card time (fixed + per sample, with noise, nondecreasing) and memory caps that
    shrink on card 0 as the micro-batch grows (it holds the gathered outputs)."""
    fixed = [rng.uniform(0.2, 2) for _ in range(n)]
    per = [rng.uniform(0.05, 1) for _ in range(n)]
    if slow_card is not None:
        fixed[slow_card], per[slow_card] = 20.0, 5.0
    bumps = [[rng.uniform(0, 0.3) for _ in range(64)] for _ in range(n)]
    base = [rng.randint(3, 10) for _ in range(n)]

    def time_at(i, c):
        return max(fixed[i] + per[i] * x + bumps[i][x] for x in range(1, c + 1)) if c else 0.0

    def cap_at(i, b):
        return max(0, base[i] - (b // 4 if i == 0 else 0))

    return time_at, cap_at


@pytest.mark.parametrize("seed", range(12))
def test_accumulation_equals_the_grid(seed):
    from dptune.solve.time import fastest_accumulation

    rng = random.Random(500 + seed)
    n = rng.choice([2, 3])
    slow = rng.randrange(n) if seed % 3 == 0 else None
    time_at, cap_at = synthetic(rng, n, slow)
    overhead = dp_overhead(rng.uniform(0, 2))
    serial = (rng.uniform(0, 1), rng.uniform(0, 0.1))
    m = rng.choice([1, 2])
    for global_batch in sorted({rng.randint(6, 36) for _ in range(3)}):
        want = accumulation_grid(time_at, cap_at, n, global_batch, overhead, serial, m)
        got = fastest_accumulation(
            lambda b: [[time_at(i, c) for c in range(cap_at(i, b) + 1)] for i in range(n)],
            global_batch, overhead=overhead, serial=serial, min_chunk=m)
        if want is None:
            assert got is None
            continue
        assert got is not None and got.global_batch == global_batch
        b = got.split.batch_size
        assert all(c == 0 or m <= c <= cap_at(i, b) for i, c in enumerate(got.split.chunk_sizes))
        assert got.seconds == pytest.approx(want[0])


def test_accumulation_drops_a_slow_card_and_splits_when_memory_binds():
    """Hand-made: card 2 is slow (10 + 10 s per sample), cards 0 and 1 take 1 s per sample and
    hold 6 samples each; a global batch of 24 cannot run in one step on cards 0 and 1 (12 at
    most), so it runs as 2 micro-batches of [6, 6, 0]: 2 x 6 s = 12 s. With card 2 in one step
    (its cap 12, [6, 6, 12]), a step takes 130 s; 3 micro-batches of 8 ([4, 4, 0]) take 12 s as
    well, so fewer micro-batches win the tie."""
    from dptune.solve.time import fastest_accumulation

    per = [1.0, 1.0, 10.0]
    fixed = [0.0, 0.0, 10.0]
    caps = [6, 6, 12]

    def times(b):
        return [[fixed[i] * (c > 0) + per[i] * c for c in range(caps[i] + 1)] for i in range(3)]

    plan = fastest_accumulation(times, 24)
    assert (plan.micro_batches, plan.split.chunk_sizes, plan.seconds) == (2, (6, 6, 0), 12.0)
    assert plan.samples_per_second == 2.0
    assert fastest_accumulation(times, 24, max_micro_batches=1).split.chunk_sizes == (6, 6, 12)


def test_micro_batch_counts_are_the_divisors():
    from dptune.solve.time import micro_batch_counts

    assert micro_batch_counts(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_counts(13) == [1, 13]
    assert micro_batch_counts(36, max_micro_batches=5) == [1, 2, 3, 4]


# ---- the probing loop (search.throughput.fastest) on a synthetic cluster -------------------------

class Synthetic:
    """Cards with affine memory (``mem0 + per_sample * c``, card 0 also ``gather * B``) and
    affine time (``fixed + per * c``; ``comm`` when a card but 0 has samples); a probe reports
    what a timed backend would, each card's own time included."""

    def __init__(self, rng, n, slow=None):
        self.n = n
        self.mem0 = [rng.randint(100, 300) for _ in range(n)]
        self.per_mem = [rng.randint(10, 40) for _ in range(n)]
        self.gather = rng.randint(0, 5)
        self.budgets = [rng.randint(600, 1500) for _ in range(n)]
        self.fixed = [rng.uniform(0.1, 1) for _ in range(n)]
        self.per = [rng.uniform(0.02, 0.3) for _ in range(n)]
        if slow is not None:
            self.fixed[slow], self.per[slow] = 5.0, 3.0
        self.comm = rng.uniform(0, 0.5)

    def memory(self, i, c, b):
        return self.mem0[i] + self.per_mem[i] * c + (self.gather * b if i == 0 else 0)

    def step(self, split):
        used = [i for i, c in enumerate(split) if c]
        return (self.comm if any(i for i in used) else 0.0) + max(
            self.fixed[i] + self.per[i] * split[i] for i in used)

    def fits(self, split):
        b = sum(split)
        return all(self.memory(i, c, b) <= self.budgets[i] for i, c in enumerate(split)
                   if i == 0 or c)

    def probe(self, split):
        from dptune.backends.base import ProbeResult
        from dptune.types import StepTime, TimeSource

        b = sum(split)
        cards = tuple(self.fixed[i] + self.per[i] * c if c else 0.0 for i, c in enumerate(split))
        step = self.step(split)
        return ProbeResult(tuple(split), tuple(self.memory(i, c, b) for i, c in enumerate(split)),
                           time=StepTime(cards, step, TimeSource.ESTIMATED,
                                         transfer_seconds=step - max(cards)))

    def memory_fits(self):
        from dptune.solve.memory import Fit

        return [Fit(self.mem0[i], self.per_mem[i], self.gather if i == 0 else 0.0)
                for i in range(self.n)]

    def splits(self, b):
        for split in itertools.product(*[range(b + 1)] * self.n):
            if sum(split) == b and self.fits(split):
                yield split


def _fastest(sim, batch, **kw):
    from dptune.search.throughput import fastest
    from dptune.split import even_split

    start = [sim.probe(even_split(batch, sim.n))]
    return fastest(sim.probe, sim.budgets, batch, start, sim.memory_fits(), start[0],
                   max_probes=8, **kw)


@pytest.mark.parametrize("seed", range(8))
def test_fastest_for_a_global_batch_matches_the_grid(seed):
    rng = random.Random(900 + seed)
    sim = Synthetic(rng, rng.choice([2, 3]), slow=0 if seed % 4 == 1 else None)
    global_batch = rng.choice([24, 36, 48])
    want = min((global_batch // b * sim.step(s), s) for b in range(1, global_batch + 1)
               if global_batch % b == 0 for s in sim.splits(b))
    out = _fastest(sim, 8, global_batch=global_batch)
    best = out.best.chunk_sizes
    assert sim.fits(best) and global_batch % sum(best) == 0
    assert out.micro_batches == global_batch // sum(best)
    assert out.micro_batches * sim.step(best) == pytest.approx(want[0])


@pytest.mark.parametrize("seed", range(8))
def test_fastest_up_to_a_batch_matches_the_grid(seed):
    """The most samples per second with at most ``batch`` samples, each card's chunk within its
    memory at ``batch`` (the caps the search documents: card 0's at the whole batch)."""
    rng = random.Random(950 + seed)
    sim = Synthetic(rng, rng.choice([2, 3]), slow=1 if seed % 3 == 0 else None)
    batch = rng.randint(10, 30)
    while not any(True for _ in sim.splits(batch)):     # the largest batch that fits, at most
        batch -= 1
    within = [s for b in range(1, batch + 1) for s in itertools.product(range(b + 1), repeat=sim.n)
              if sum(s) == b and all(sim.memory(i, c, batch) <= sim.budgets[i]
                                     for i, c in enumerate(s) if i == 0 or c)]
    want = max(sum(s) / sim.step(s) for s in within)
    out = _fastest(sim, batch, up_to=True)
    best = out.best.chunk_sizes
    assert sim.fits(best) and sum(best) <= batch
    assert sum(best) / sim.step(best) == pytest.approx(want)
