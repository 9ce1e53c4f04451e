"""The fastest split: time fits per card and the split that maximises samples per second.

- :class:`TimeFit`: A card's time for its chunk: ``fixed_seconds + per_sample_seconds * c`` (0 at ``c = 0``).
- :func:`fit_time`: Least-squares affine fit of (chunk, seconds) over chunks > 0; ``None`` without a point.
- :class:`SplitTime`: A split with its modelled step time.
- :class:`StepModel`: A step's time as :mod:`this module <dptune.solve.time>` models it (seconds).
- :func:`fastest_split`: The fastest split (the model: docs/concepts/design-notes.md); ``None`` when no split fits the caps.
- :func:`step_seconds`: The model's step time of ``split``; ``times[i][c]``: card i's time at chunk c; ``linear[i]``: seconds per sample of card i spent outside the ...
- :class:`AccumulationPlan`: A global batch as ``micro_batches`` steps of the same split (gradient accumulation).
- :func:`fastest_accumulation`: The number of micro-batches and the split that finish ``global_batch`` fastest (the model: docs/concepts/design-notes.md); ``times_of(b)``: the cards' time curves ...

Design notes: docs/concepts/design-notes.md, "dptune/solve/time.py".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

__all__ = ["TimeFit", "fit_time", "SplitTime", "StepModel", "fastest_split", "step_seconds",
           "AccumulationPlan", "fastest_accumulation", "micro_batch_counts"]

#: Beyond this many cards the subsets tried are the nested ones (the slowest cards dropped first).
MAX_EXHAUSTIVE_CARDS = 12


@dataclass(frozen=True)
class TimeFit:
    """A card's time for its chunk: ``fixed_seconds + per_sample_seconds * c`` (0 at ``c = 0``)."""

    fixed_seconds: float
    per_sample_seconds: float
    points: int = 0
    max_error_seconds: float = 0.0

    def predict(self, chunk: int) -> float:
        return 0.0 if chunk <= 0 else self.fixed_seconds + self.per_sample_seconds * chunk

    def to_dict(self) -> dict[str, Any]:
        return dict(fixed_seconds=self.fixed_seconds, per_sample_seconds=self.per_sample_seconds,
                    points=self.points, max_error_seconds=self.max_error_seconds)


def fit_time(points: Sequence[tuple[int, float]]) -> Optional[TimeFit]:
    """Least-squares affine fit of (chunk, seconds) over chunks > 0; ``None`` without a point.

    One distinct chunk gives a line through the origin (no fixed cost known). The slope and
    the fixed cost are kept >= 0 (time never falls with more samples)."""
    pts = [(float(c), float(t)) for c, t in points if c > 0]
    if not pts:
        return None
    xs = {x for x, _ in pts}
    if len(xs) == 1:
        x = next(iter(xs))
        t = sum(y for _, y in pts) / len(pts)
        return TimeFit(0.0, t / x, points=len(pts))
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx)
    fixed = my - slope * mx
    if fixed < 0:                      # refit through the origin
        fixed, slope = 0.0, sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    err = max(abs(fixed + slope * x - y) for x, y in pts)
    return TimeFit(fixed, slope, points=n, max_error_seconds=err)


@dataclass(frozen=True)
class StepModel:
    """A step's time as :mod:`this module <dptune.solve.time>` models it (seconds)."""

    cards: tuple[TimeFit, ...]
    serial: TimeFit = TimeFit(0.0, 0.0)     # against the whole batch
    overhead: Callable[[frozenset[int]], float] = field(default=lambda s: 0.0, compare=False)
    gather_per_sample: float = 0.0          # per sample on a card other than the output card
    host: Callable[[frozenset[int]], float] = field(default=lambda s: 0.0, compare=False)

    @property
    def linear(self) -> list[float]:
        """Seconds per sample of each card outside the parallel work (the gather onto card 0)."""
        return [0.0] + [self.gather_per_sample] * (len(self.cards) - 1)

    @property
    def serial_pair(self) -> tuple[float, float]:
        return (self.serial.fixed_seconds, self.serial.per_sample_seconds)

    def seconds(self, split: Sequence[int]) -> float:
        return step_seconds([[f.predict(c) for c in range(max(split) + 1)] for f in self.cards],
                            split, self.overhead, self.serial_pair, self.linear, self.host)

    def fastest(self, caps: Sequence[int], batch: Optional[int], min_chunk: int = 1,
                every_card: bool = False, max_batch: Optional[int] = None) -> Optional["SplitTime"]:
        """:func:`fastest_split` on this model within ``caps``."""
        return fastest_split(self.curves(caps), batch, overhead=self.overhead,
                             serial=self.serial_pair, min_chunk=min_chunk, every_card=every_card,
                             linear=self.linear, max_batch=max_batch, host=self.host)

    def fastest_accumulation(self, caps_of: Callable[[int], Sequence[int]], global_batch: int,
                             min_chunk: int = 1, every_card: bool = False,
                             max_micro_batches: Optional[int] = None) -> Optional["AccumulationPlan"]:
        """:func:`fastest_accumulation` on this model; ``caps_of(b)``: the cards' memory caps
        at micro-batch ``b``."""
        return fastest_accumulation(lambda b: self.curves(caps_of(b)), global_batch,
                                    overhead=self.overhead, serial=self.serial_pair,
                                    min_chunk=min_chunk, every_card=every_card, linear=self.linear,
                                    max_micro_batches=max_micro_batches, host=self.host)

    def curves(self, caps: Sequence[int]) -> list[list[float]]:
        """Each card's time at chunks ``0..caps[i]``."""
        return [[f.predict(c) for c in range(max(cap, 0) + 1)] for f, cap in zip(self.cards, caps)]


@dataclass(frozen=True)
class SplitTime:
    """A split with its modelled step time."""

    chunk_sizes: tuple[int, ...]
    step_seconds: float

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def samples_per_second(self) -> float:
        return self.batch_size / self.step_seconds if self.step_seconds > 0 else math.inf

    @property
    def dropped(self) -> tuple[int, ...]:
        """Cards given no samples."""
        return tuple(i for i, c in enumerate(self.chunk_sizes) if c == 0)


def step_seconds(times: Sequence[Sequence[float]], split: Sequence[int],
                 overhead: Callable[[frozenset[int]], float] = lambda s: 0.0,
                 serial: tuple[float, float] = (0.0, 0.0),
                 linear: Optional[Sequence[float]] = None,
                 host: Callable[[frozenset[int]], float] = lambda s: 0.0) -> float:
    """The model's step time of ``split``; ``times[i][c]``: card i's time at chunk c;
    ``linear[i]``: seconds per sample of card i spent outside the cards' parallel work
    (DataParallel's gather of card i's outputs onto card 0, one card after another);
    ``host(S)``: the host's time to issue the step on the cards ``S`` (the step is at least
    that)."""
    used = frozenset(i for i, c in enumerate(split) if c > 0)
    if not used:
        return 0.0
    b = sum(split)
    extra = sum(g * c for g, c in zip(linear, split)) if linear is not None else 0.0
    return max(host(used), overhead(used) + serial[0] + serial[1] * b + extra
               + max(times[i][split[i]] for i in used))


def _subsets(n: int, order: Sequence[int], every_card: bool) -> list[tuple[int, ...]]:
    if every_card:
        return [tuple(range(n))]
    if n <= MAX_EXHAUSTIVE_CARDS:
        return [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
    return [tuple(sorted(order[:k])) for k in range(1, n + 1)]


def fastest_split(times: Sequence[Sequence[float]], batch: Optional[int] = None, *,
                  overhead: Callable[[frozenset[int]], float] = lambda s: 0.0,
                  serial: tuple[float, float] = (0.0, 0.0), min_chunk: int = 1,
                  every_card: bool = False, linear: Optional[Sequence[float]] = None,
                  max_batch: Optional[int] = None,
                  host: Callable[[frozenset[int]], float] = lambda s: 0.0) -> Optional[SplitTime]:
    """The fastest split (the model: docs/concepts/design-notes.md); ``None`` when no split fits the caps.

    ``times[i]`` lists card i's time at chunks ``0..cap_i`` (its memory cap is
    ``len(times[i]) - 1``; the value at 0 is not used). Curves are made nondecreasing (more
    samples never take less time). ``min_chunk``: a card gets 0 or at least this many
    samples (2 under BatchNorm); ``every_card``: no card may be dropped (DDP ranks);
    ``linear[i]``: seconds per sample of card i added to the step (see :func:`step_seconds`);
    ``max_batch`` (with ``batch=None``): the most samples per second with at most that many;
    ``host(S)``: the host's time for the cards ``S``, a floor on the step (the same for every
    split over ``S``: for a fixed batch the shortest device time is still the answer; for the
    best rate each level's step is floored by it).
    """
    import numpy as np

    n = len(times)
    curves = [np.maximum.accumulate(np.asarray(list(t[1:]), dtype=float)) for t in times]
    caps = [len(c) for c in curves]
    speed_order = sorted(range(n), key=lambda i: curves[i][-1] / caps[i] if caps[i] else math.inf)
    best: Optional[SplitTime] = None
    for subset in _subsets(n, speed_order, every_card):
        if any(caps[i] < min_chunk for i in subset):
            continue
        g = [float(linear[i]) if linear is not None else 0.0 for i in subset]
        fixed = overhead(frozenset(subset)) + serial[0]
        floor = host(frozenset(subset))
        if any(g):
            sol = _linear(curves, subset, batch, min_chunk, fixed, serial[1], g, max_batch, floor)
        elif batch is not None:
            sol = _fixed_batch(curves, subset, batch, min_chunk)
        else:
            sol = _free_batch(curves, subset, min_chunk, fixed, serial[1], max_batch, floor)
        if sol is None:
            continue
        split = [0] * n
        for i, c in zip(subset, sol):
            split[i] = int(c)
        t = step_seconds([[0.0, *c] for c in curves], split, overhead, serial, linear, host)
        cand = SplitTime(tuple(split), t)
        if best is None or _better(cand, best, batch is None):
            best = cand
    return best


def _better(a: SplitTime, b: SplitTime, rate: bool) -> bool:
    if rate:
        return a.samples_per_second > b.samples_per_second * (1 + 1e-12)
    return a.step_seconds < b.step_seconds * (1 - 1e-12)


def _counts(curves: list, subset: Sequence[int], level: Any) -> Any:
    """For each card of ``subset``: how many chunks finish within ``level`` (its largest)."""
    import numpy as np

    return np.stack([np.searchsorted(curves[i], level, side="right") for i in subset])


def _fixed_batch(curves: list, subset: Sequence[int], batch: int, m: int) -> Optional[list[int]]:
    """The split of ``batch`` over ``subset`` with the smallest largest card time."""
    import numpy as np

    if m * len(subset) > batch or sum(len(curves[i]) for i in subset) < batch:
        return None
    floor = max(curves[i][m - 1] for i in subset)      # every card at least m
    levels = np.unique(np.concatenate([curves[i][m - 1:] for i in subset]))
    levels = levels[levels >= floor]
    lo, hi = 0, len(levels) - 1
    while lo < hi:                                      # the first level where enough fit
        mid = (lo + hi) // 2
        if int(_counts(curves, subset, levels[mid]).sum()) >= batch:
            hi = mid
        else:
            lo = mid + 1
    chunks = [int(x) for x in _counts(curves, subset, levels[lo])]
    surplus = sum(chunks) - batch
    # any card may give back samples (its time only falls), one at a time: the slowest last
    # sample first; among equally slow ones (ties, within a relative 1e-9) the card with less
    # room (the smaller memory cap), then the later card, so ties favour the larger card and
    # equal cards end within one sample of each other
    while surplus > 0:
        last = [curves[subset[j]][chunks[j] - 1] if chunks[j] > m else -math.inf
                for j in range(len(subset))]
        top = max(last)
        if top == -math.inf:
            break
        tied = [j for j in range(len(subset)) if last[j] >= top - 1e-9 * abs(top)]
        k = min(tied, key=lambda j: (len(curves[subset[j]]), -j))
        chunks[k] -= 1
        surplus -= 1
    return chunks


def _free_batch(curves: list, subset: Sequence[int], m: int, fixed: float, per_sample: float,
                max_batch: Optional[int] = None, floor: float = 0.0) -> Optional[list[int]]:
    """The chunks over ``subset`` with the most samples per second: at each candidate level
    (a card's own time value), every card takes the most samples it finishes within it (at
    most ``max_batch`` in all: more samples within the same level only raise the rate);
    ``fixed`` and ``per_sample`` are the step's costs outside the cards (for this subset),
    ``floor`` the host's time (the step is at least that)."""
    import numpy as np

    if max_batch is not None and m * len(subset) > max_batch:
        return None
    least = max(curves[i][m - 1] for i in subset)       # every card at least m (not the host's floor)
    levels = np.unique(np.concatenate([curves[i][m - 1:] for i in subset]))
    levels = levels[levels >= least]
    counts = _counts(curves, subset, levels)            # cards x levels
    b = counts.sum(axis=0).astype(float)
    if max_batch is not None:
        b = np.minimum(b, float(max_batch))
    t = np.maximum(levels + fixed + per_sample * b, floor)
    rate = np.where(t > 0, b / np.where(t > 0, t, 1.0), np.inf)
    chunks = [int(x) for x in counts[:, int(np.argmax(rate))]]
    surplus = sum(chunks) - int(b[int(np.argmax(rate))])
    for k in range(len(chunks)):         # any card may give back samples: its time only falls
        take = min(surplus, chunks[k] - m)
        chunks[k] -= take
        surplus -= take
    return chunks


def _linear(curves: list, subset: Sequence[int], batch: Optional[int], m: int, fixed: float,
            per_sample: float, g: Sequence[float], max_batch: Optional[int] = None,
            floor: float = 0.0) -> Optional[list[int]]:
    """With costs per sample outside the parallel work (``g``), every candidate level L is
    tried: each card may take up to its count at L; for a fixed batch the samples beyond ``m``
    each go to the cards of smallest ``g`` first; for the best rate (a linear-fractional
    objective) the cards of smallest ``g + per_sample`` take all they can, the others ``m``,
    for the best prefix. L bounds the slowest card's time, so the best (L, allocation) is
    exact (the caller recomputes the step time of the allocation); ``floor``: the host's time,
    the least step (the same for every split of a fixed batch, so left out there)."""
    import numpy as np

    if batch is not None and (m * len(subset) > batch or sum(len(curves[i]) for i in subset) < batch):
        return None
    least = max(curves[i][m - 1] for i in subset)       # every card at least m (not the host's floor)
    levels = np.unique(np.concatenate([curves[i][m - 1:] for i in subset]))
    levels = levels[levels >= least]
    counts = _counts(curves, subset, levels).astype(float)        # cards x levels
    order = sorted(range(len(subset)), key=lambda j: g[j])
    if batch is not None:
        alloc = np.full(counts.shape, float(m))
        left = np.full(levels.shape, float(batch - m * len(subset)))
        for j in order:
            take = np.clip(left, 0.0, counts[j] - m)
            alloc[j] += take
            left -= take
        cost = levels + (np.asarray(g)[:, None] * alloc).sum(axis=0)
        cost = np.where(left > 0, np.inf, cost)
        k = int(np.argmin(cost))
        return None if not np.isfinite(cost[k]) else [int(x) for x in alloc[:, k]]
    if max_batch is not None and m * len(subset) > max_batch:
        return None
    best_rate, best_alloc = -1.0, None
    for prefix in range(len(subset) + 1):
        alloc = np.full(counts.shape, float(m))
        for j in order[:prefix]:
            alloc[j] = counts[j]
        if max_batch is not None:     # the largest g give back first (smallest g filled first)
            over = alloc.sum(axis=0) - max_batch
            for j in reversed(order[:prefix]):
                take = np.clip(over, 0.0, alloc[j] - m)
                alloc[j] -= take
                over -= take
        b = alloc.sum(axis=0)
        t = np.maximum(levels + fixed + per_sample * b + (np.asarray(g)[:, None] * alloc).sum(axis=0),
                       floor)
        rate = np.where(t > 0, b / np.where(t > 0, t, 1.0), np.inf)
        k = int(np.argmax(rate))
        if rate[k] > best_rate:
            best_rate, best_alloc = float(rate[k]), [int(x) for x in alloc[:, k]]
    return best_alloc


@dataclass(frozen=True)
class AccumulationPlan:
    """A global batch as ``micro_batches`` steps of the same split (gradient accumulation)."""

    micro_batches: int
    split: SplitTime                      # one micro-batch

    @property
    def global_batch(self) -> int:
        return self.micro_batches * self.split.batch_size

    @property
    def seconds(self) -> float:
        """The modelled time of the whole global batch."""
        return self.micro_batches * self.split.step_seconds

    @property
    def samples_per_second(self) -> float:
        return self.global_batch / self.seconds if self.seconds > 0 else math.inf


def micro_batch_counts(global_batch: int, max_micro_batches: Optional[int] = None) -> list[int]:
    """The numbers of equal micro-batches ``global_batch`` divides into (its divisors), in
    increasing order, at most ``max_micro_batches``."""
    if global_batch < 1:
        raise ValueError(f"the global batch must be >= 1, got {global_batch}")
    small = [k for k in range(1, math.isqrt(global_batch) + 1) if global_batch % k == 0]
    ks = sorted(set(small) | {global_batch // k for k in small})
    return [k for k in ks if max_micro_batches is None or k <= max_micro_batches]


def fastest_accumulation(times_of: Callable[[int], Sequence[Sequence[float]]], global_batch: int, *,
                         overhead: Callable[[frozenset[int]], float] = lambda s: 0.0,
                         serial: tuple[float, float] = (0.0, 0.0), min_chunk: int = 1,
                         every_card: bool = False, linear: Optional[Sequence[float]] = None,
                         max_micro_batches: Optional[int] = None,
                         host: Callable[[frozenset[int]], float] = lambda s: 0.0
                         ) -> Optional[AccumulationPlan]:
    """The number of micro-batches and the split that finish ``global_batch`` fastest (see the
    module docstring); ``times_of(b)``: the cards' time curves at micro-batch ``b``, each as
    long as that card's memory cap at ``b`` allows (as :func:`fastest_split` takes them).
    ``None`` when no micro-batch size fits. Ties go to fewer micro-batches."""
    best: Optional[AccumulationPlan] = None
    for k in micro_batch_counts(global_batch, max_micro_batches):
        sol = fastest_split(times_of(global_batch // k), global_batch // k, overhead=overhead,
                            serial=serial, min_chunk=min_chunk, every_card=every_card, linear=linear,
                            host=host)
        if sol is None:
            continue
        plan = AccumulationPlan(k, sol)
        if best is None or plan.seconds < best.seconds * (1 - 1e-12):
            best = plan
    return best
