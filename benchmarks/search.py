"""The baselines a user would run instead of dptune, and the exact optimum, on the simulator.

The exact optimum rests on a property of the simulated step (checked in
``tests/benchmarks/test_benchmarks.py``): card ``i >= 1``'s peak depends only on its own chunk ``c``
(``f(c)``, 0 when it gets no samples) and card 0's peak only on its own chunk and the whole
batch (``g(c0, B)``: the master weights, the reduced gradients and the gathered outputs live
there), not on how the other cards share the rest, nor on how many cards there are. Both
are non-decreasing. :class:`Curves` measures them on demand with 2-card probes and caches
them, so every scenario of one model shares the measurements. Then:

- the largest batch that any split fits (:func:`max_batch_optimum`): each card ``i >= 1``
  takes its largest chunk within budget ``C_i``; card 0 the rest, ``max(0, B - sum C_i)``;
  the largest ``B`` for which card 0 still fits is found by a galloping search;
- the split of a batch that minimises the largest share of budget (:func:`balance_optimum`):
  an exact integer min-max over the cards' curves, solved in a window around a seed split and
  certified optimal (no split can do better, since the curves are monotone) or widened.

A "probe" of a baseline is one training step it would run; on the real-card backend each is
a step. ``BatchNorm`` models (``min_chunk=2``) give every card 0 or at least 2 samples.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from dptune.backends.simulated import Cluster, SimulatedBackend
from dptune.parallel import gpu0_split
from dptune.split import scale_split
from dptune.step.workload import Workload

from benchmarks.certificate_answer import reachable

__all__ = ["Curves", "largest_true", "power_then_binary", "GridResult", "grid_gpu0_bsz",
           "max_batch_optimum", "BalanceOptimum", "balance_optimum", "linf_distance",
           "split_valid", "max_share", "imbalance_of"]


def split_valid(split: Sequence[int], min_chunk: int) -> bool:
    """No card has between 1 and ``min_chunk - 1`` samples (BatchNorm needs 2)."""
    return all(c == 0 or c >= min_chunk for c in split) and sum(split) > 0


def max_share(peaks: Sequence[float], budgets: Sequence[int]) -> float:
    return max(p / b for p, b in zip(peaks, budgets))


def imbalance_of(peaks: Sequence[float], budgets: Sequence[int], split: Sequence[int]) -> float:
    """max/min share of budget over the cards in use (card 0 always is), as dptune reports it."""
    s = [p / b for i, (p, b) in enumerate(zip(peaks, budgets)) if i == 0 or split[i] > 0]
    return max(s) / min(s) if min(s) > 0 else math.inf


class Curves:
    """``f(c)`` (card ``i >= 1``) and ``g(c0, B)`` (card 0) of one model, measured with 2-card
    probes on the simulator and cached; ``probes`` counts the steps simulated."""

    def __init__(self, workload: Workload, min_chunk: int = 1):
        self.backend = SimulatedBackend(workload, Cluster.uniform(2, 10**15, name="curves"))
        self.workspace_bytes = self.backend.cluster.workspace_bytes(0)
        self.min_chunk = min_chunk
        self.probes = 0
        self.seconds = 0.0
        self._f: dict[int, int] = {0: 0}
        self._g: dict[tuple[int, int], int] = {}

    def check_cluster(self, cluster: Cluster) -> None:
        """The curves hold for cards with the same cuBLAS workspace (non-Hopper vs Hopper)."""
        for i in range(len(cluster)):
            if cluster.workspace_bytes(i) != self.workspace_bytes:
                raise ValueError(f"card {i} of {cluster.describe()} has another cuBLAS workspace "
                                 "than the curves were measured with; use separate Curves")

    def _estimate(self, split: list[int]) -> list[int]:
        if not split_valid(split, self.min_chunk):
            raise ValueError(f"split {split} is not valid for this model (min chunk {self.min_chunk})")
        t0 = time.perf_counter()
        peaks = self.backend.estimate(split).peak_bytes
        self.seconds += time.perf_counter() - t0
        self.probes += 1
        return peaks

    def f(self, c: int) -> int:
        """Peak of a card other than card 0 given ``c`` samples (bytes)."""
        if c not in self._f:
            p0, p1 = self._estimate([0, c])
            self._f[c] = p1
            self._g[(0, c)] = p0
        return self._f[c]

    def g(self, c0: int, batch_size: int) -> int:
        """Peak of card 0 given ``c0`` samples of a batch of ``batch_size`` (bytes)."""
        key = (c0, batch_size)
        if key not in self._g:
            rest = batch_size - c0
            p0, p1 = self._estimate([c0, rest])
            self._g[key] = p0
            if rest > 0:
                self._f.setdefault(rest, p1)
        return self._g[key]

    def peaks(self, split: Sequence[int]) -> list[int]:
        """Per-card peaks of a split on any cluster with these cards (bytes)."""
        b = sum(split)
        return [self.g(split[0], b)] + [self.f(c) for c in split[1:]]

    def fits(self, split: Sequence[int], budgets: Sequence[int]) -> bool:
        return split_valid(split, self.min_chunk) and all(
            p <= bud for p, bud in zip(self.peaks(split), budgets))


# ---- searches over integers ------------------------------------------------------------------

def largest_true(pred: Callable[[int], bool], lo: int, guess: Optional[int] = None) -> int:
    """Largest ``x >= lo`` with ``pred(x)``, for ``pred`` true up to a point and false after.

    ``pred(lo)`` is taken as true and never evaluated. Gallops from ``guess`` (doubling steps
    up or down), then bisects; an exact guess costs two evaluations.
    """
    x = max(lo + 1, guess if guess is not None else lo + 1)
    if pred(x):
        good, step = x, 1
        while pred(good + step):
            good += step
            step *= 2
        bad = good + step
    else:
        bad, step = x, 1
        while bad - step > lo and not pred(bad - step):
            bad -= step
            step *= 2
        good = max(lo, bad - step)
    while bad - good > 1:
        mid = (good + bad) // 2
        if pred(mid):
            good = mid
        else:
            bad = mid
    return good


def power_then_binary(fits: Callable[[int], bool], init: int) -> tuple[int, list[tuple[int, bool]]]:
    """Lightning's ``scale_batch_size(mode="binsearch")``: double the batch from ``init`` until
    it does not fit, then bisect between the last that fit and the first that did not.

    Returns the largest batch found to fit (0 if ``init`` does not) and the trials in order,
    one probe each. (Lightning also caps the trials at ``max_trials=25``; not applied here.)
    """
    trials: list[tuple[int, bool]] = []

    def run(b: int) -> bool:
        ok = fits(b)
        trials.append((b, ok))
        return ok

    b, low, high = init, 0, None
    while high is None:
        if run(b):
            low, b = b, 2 * b
        else:
            high = b
    while high - low > 1:
        mid = (low + high) // 2
        if run(mid):
            low = mid
        else:
            high = mid
    return low, trials


@dataclass
class GridResult:
    """The best ``gpu0_bsz`` of a grid: lowest largest share of budget among the splits that fit."""

    batch_size: int
    points: int                      # grid points: the probes a user scanning the grid runs
    gpu0_bsz: Optional[int]          # None when no point of the grid fits
    chunk_sizes: Optional[list[int]]
    max_share: float
    evaluated: int                   # grid points actually evaluated here

    @property
    def fits(self) -> bool:
        return self.gpu0_bsz is not None


def grid_gpu0_bsz(peaks: Callable[[list[int]], Sequence[float]], budgets: Sequence[int],
                  batch_size: int, min_chunk: int = 1, full: bool = True) -> GridResult:
    """Hand tuning of the old class: for a batch ``B`` on ``n`` cards try
    ``gpu0_bsz = 0 .. ceil(B/n)`` (the rest shared evenly by the others, as
    :func:`dptune.parallel.gpu0_split` does) and keep the one with the lowest largest share of
    budget that fits. ``peaks(split)`` measures a split (one probe).

    ``full=True`` evaluates every point, as a user does. ``full=False`` gives the same answer
    with a bisection: card 0's share grows with ``gpu0_bsz`` and the others' shrink, so the
    lowest maximum is at their crossing (exact for non-decreasing per-card curves; the test
    checks it against the full grid). ``points`` is the grid's size either way.
    """
    n = len(budgets)
    grid = [g for g in range(0, -(-batch_size // n) + 1)
            if split_valid(gpu0_split(g, batch_size, n), min_chunk)]
    cache: dict[int, tuple[float, float]] = {}

    def eval_(g: int) -> tuple[float, float]:   # (card 0's share, the others' largest)
        if g not in cache:
            split = gpu0_split(g, batch_size, n)
            s = [p / b for p, b in zip(peaks(split), budgets)]
            cache[g] = (s[0], max(s[1:]) if n > 1 else 0.0)
        return cache[g]

    if full:
        candidates = grid
    else:   # smallest grid index where card 0 is at least the others; the best is there or before
        lo, hi = 0, len(grid)
        while lo < hi:
            mid = (lo + hi) // 2
            s0, rest = eval_(grid[mid])
            if s0 >= rest:
                hi = mid
            else:
                lo = mid + 1
        candidates = [grid[k] for k in (lo - 1, lo) if 0 <= k < len(grid)]
    best: Optional[int] = None
    best_share = math.inf
    for g in candidates:
        share = max(eval_(g))
        if share <= 1.0 and share < best_share:
            best, best_share = g, share
    if best is None:
        best_share = min((max(eval_(g)) for g in candidates), default=math.inf)
    return GridResult(batch_size=batch_size, points=len(grid), gpu0_bsz=best,
                      chunk_sizes=gpu0_split(best, batch_size, n) if best is not None else None,
                      max_share=best_share, evaluated=len(cache))


# ---- the exact optimum --------------------------------------------------------------------

def _in(x: int, intervals: Sequence[tuple[int, int]]) -> bool:
    return any(a <= x <= b for a, b in intervals)


def _fill(total: int, caps: Sequence[int], min_chunk: int) -> Optional[list[int]]:
    """Chunks ``0`` or ``min_chunk..caps[i]`` summing to ``total``, earlier cards fullest."""
    out: list[int] = []
    for i, cap in enumerate(caps):
        rest = reachable(caps[i + 1:], min_chunk)
        v = next((v for v in range(min(cap, total), -1, -1)
                  if (v == 0 or v >= min_chunk) and _in(total - v, rest)), None)
        if v is None:
            return None
        out.append(v)
        total -= v
    return out


def card_capacity(curves: Curves, budget: int, guess: Optional[int] = None) -> int:
    """Largest chunk a card other than card 0 takes within ``budget`` (0 if not even ``min_chunk``)."""
    m = curves.min_chunk
    c = largest_true(lambda c: curves.f(c) <= budget, m - 1, guess)
    return c if c >= m else 0


def max_batch_optimum(curves: Curves, budgets: Sequence[int], guess: Optional[int] = None,
                      guess_split: Optional[Sequence[int]] = None) -> tuple[int, list[int]]:
    """The largest batch that some split fits into every budget, and that split (exact)."""
    m = curves.min_chunk
    caps = [card_capacity(curves, b, guess_split[i + 1] if guess_split else None)
            for i, b in enumerate(budgets[1:])]
    reach = reachable(caps, m)

    def card0(batch: int) -> Optional[int]:
        """The fewest samples card 0 can take of this batch (None if none works)."""
        c0 = max(0, batch - sum(caps))
        while c0 <= batch:
            if (c0 == 0 or c0 >= m) and _in(batch - c0, reach):
                return c0
            c0 += 1
        return None

    def ok(batch: int) -> bool:
        c0 = card0(batch)
        return c0 is not None and curves.g(c0, batch) <= budgets[0]

    best = largest_true(ok, 0, guess)
    if best == 0:
        return 0, [0] * len(budgets)
    c0 = card0(best)
    assert c0 is not None
    rest = scale_split(caps, best - c0) if best > c0 else [0] * len(caps)
    if not split_valid([c0] + rest, m) or any(c > cap for c, cap in zip(rest, caps)):
        rest = _fill(best - c0, caps, m)   # an optimal split, fullest cards first
    assert rest is not None
    return best, [c0] + rest


@dataclass
class BalanceOptimum:
    """The split of a batch with the lowest largest share of budget (exact)."""

    batch_size: int
    chunk_sizes: list[int]
    max_share: float
    window: int                                   # half-width of the window that certified it
    # per card: largest chunk of the window within max_share (a lower bound of the largest
    # chunk within it when it is the window's edge)
    caps: list[int] = field(default_factory=list)


def balance_optimum(curves: Curves, budgets: Sequence[int], batch_size: int,
                    seed: Sequence[int], window: int = 2) -> BalanceOptimum:
    """Exact integer min-max of the per-card shares over splits of ``batch_size``.

    Solves the problem restricted to chunks within ``window`` of ``seed`` (a dynamic program
    over reachable sums at each candidate level), then certifies it: with non-decreasing
    curves, no split can have every share below the found level when, for each card, the
    chunks with a lower share end inside the window and their largest values sum to less than
    the batch. Otherwise the window is re-centred on the solution and doubled.
    """
    n, B, m = len(budgets), batch_size, curves.min_chunk
    if sum(seed) != B or len(seed) != n or not split_valid(seed, m):
        raise ValueError(f"seed {list(seed)} is not a valid split of {B} over {n} cards")

    def share(i: int, c: int) -> float:
        if i == 0:
            return curves.g(c, B) / budgets[0]
        return curves.f(c) / budgets[i]

    center = list(seed)
    k = window
    while True:
        values: list[dict[int, float]] = []
        for i in range(n):
            lo, hi = max(0, center[i] - k), min(B, center[i] + k)
            values.append({c: share(i, c) for c in range(lo, hi + 1) if c == 0 or c >= m})
        levels = sorted({v for vals in values for v in vals.values()})

        def solve(level: float, values: list[dict[int, float]] = values) -> Optional[list[int]]:
            reach: list[dict[int, int]] = [{0: 0}]    # sum -> chunk of the last card
            for vals in values:
                nxt: dict[int, int] = {}
                for s in reach[-1]:
                    for c, v in vals.items():
                        if v <= level and s + c <= B and s + c not in nxt:
                            nxt[s + c] = c
                reach.append(nxt)
            if B not in reach[-1]:
                return None
            split, s = [], B
            for i in range(n, 0, -1):
                c = reach[i][s]
                split.append(c)
                s -= c
            return split[::-1]

        lo_i, hi_i = 0, len(levels) - 1    # the seed is in the window: the top level is feasible
        while lo_i < hi_i:
            mid = (lo_i + hi_i) // 2
            if solve(levels[mid]) is not None:
                hi_i = mid
            else:
                lo_i = mid + 1
        level = levels[lo_i]
        split = solve(level)
        assert split is not None
        certified, ub_sum = True, 0
        for vals in values:
            cs = sorted(vals)
            lo, hi = cs[0], cs[-1]
            if hi < B and vals[hi] < level:
                certified = False   # card i's chunks below the level may go past the window
                break
            below = [c for c in cs if vals[c] < level]
            if not below and lo == 0:
                ub_sum = -1          # card i is at or above the level whatever it gets
                break
            ub_sum += max(below) if below else lo - 1
        if certified and ub_sum < B:
            caps = [max(c for c, v in vals.items() if v <= level) for vals in values]
            return BalanceOptimum(batch_size=B, chunk_sizes=split, max_share=level, window=k, caps=caps)
        center, k = split, k * 2


def linf_distance(split: Sequence[int], caps: Sequence[int], batch_size: int) -> int:
    """Fewest samples per card by which ``split`` must change to reach a split with every card
    ``i`` at most ``caps[i]`` (an optimal split, when the caps are the optimum's), in the largest
    change over the cards. With :attr:`BalanceOptimum.caps` (lower bounds at a window's edge)
    it is an upper bound. (The BatchNorm gap at 1 sample is not taken into account.)"""
    for k in range(0, batch_size + 1):
        lo = [max(0, c - k) for c in split]
        hi = [min(cap, c + k) for c, cap in zip(split, caps)]
        if all(a <= b for a, b in zip(lo, hi)) and sum(lo) <= batch_size <= sum(hi):
            return k
    return batch_size
