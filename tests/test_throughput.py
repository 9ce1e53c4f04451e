"""The throughput solver against an exhaustive grid on synthetic per-card time and memory
curves (the oracle enumerates every split; it shares no code with the solver)."""

from __future__ import annotations

import itertools
import random

import pytest

from dptune.throughput import TimeFit, fastest_split, fit_time


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
