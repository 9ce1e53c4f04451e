"""Pure arithmetic of the search: per-card affine fits and the splits they imply (no torch).

The model of one card's peak memory (int bytes) is affine in its own chunk ``c`` and, on the
output card (card 0), also in the whole batch ``B``::

    m_i(c, B) = intercept_i + slope_i * c + batch_slope_i * B      (batch_slope_i = 0 for i > 0)

A card other than card 0 given no samples is skipped by ``BalancedDataParallel`` and costs
nothing (``m_i(0, B) = 0``); card 0 always holds the master weights, so it pays its intercept
(and the batch term) even with no samples.

A card's *share* is its memory over its budget (card memory - memory taken by others -
headroom). :func:`solve_balance` finds the integer split of a batch that minimises the largest
share. (The largest batch some split fits, and the even split's, are searched by probes in
:mod:`dptune.search`; the closed-form versions only tests use live in ``tests/support/oracles.py``.)

``min_chunk_nonzero=2`` is the BatchNorm rule: a chunk of exactly 1 sample cannot be trained
through BatchNorm, so each card gets 0 or at least 2. ``caps[i]`` is the largest chunk card i
may get (``None`` for no cap); the tuner derives caps from probes that ran out of memory.

``every_card=True`` is the DDP rule: every card is a rank that runs each step, so each gets
at least ``min_chunk_nonzero`` samples (no zeros) and pays its intercept; with no
``batch_slope_bytes`` the cards are then independent of each other.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from dptune.errors import NoFeasibleSplitError
from dptune.types import card_in_use
from dptune.units import format_bytes

__all__ = [
    "Fit", "fit_affine", "predict", "shares_of",
    "solve_balance", "over_budget", "bisect_last",
]

#: A fitted slope below this (noise can make it 0 or negative) is treated as this, in bytes.
MIN_SLOPE_BYTES = 1.0

Caps = Optional[Sequence[Optional[int]]]


@dataclass(frozen=True)
class Fit:
    """Card memory as an affine function of its chunk, and of the whole batch on card 0.

    ``predict(c, B) = intercept_bytes + slope_bytes * c + batch_slope_bytes * B``
    (``batch_slope_bytes`` is 0 except on the output card, which gathers the whole batch).
    ``zero_bytes``: card 0 with no samples runs no replica, a step rather than a point of the
    line; where it was measured it is given here (at the batch of the fit, in bytes).
    ``max_error_bytes`` is the largest residual over the points fitted.
    """

    intercept_bytes: float
    slope_bytes: float
    batch_slope_bytes: float = 0.0
    max_error_bytes: float = 0.0
    points: int = 0
    zero_bytes: Optional[float] = None

    def predict(self, chunk: int, batch_size: int) -> float:
        if chunk == 0 and self.zero_bytes is not None:
            return self.zero_bytes
        return self.intercept_bytes + self.slope_bytes * chunk + self.batch_slope_bytes * batch_size

    def to_dict(self) -> dict[str, Any]:
        return dict(intercept_bytes=self.intercept_bytes, slope_bytes=self.slope_bytes,
                    batch_slope_bytes=self.batch_slope_bytes,
                    max_error_bytes=self.max_error_bytes, points=self.points,
                    zero_bytes=self.zero_bytes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Fit":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# ---- fitting ---------------------------------------------------------------------------


def bisect_last(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """The largest x in [lo, hi] with ``pred(x)``, for ``pred`` true up to a point then false
    (``lo`` itself is not tested; ``lo`` is returned when ``hi <= lo``)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo

def _solve_linear(a: list[list[float]], b: list[float]) -> Optional[list[float]]:
    """Gaussian elimination with partial pivoting; ``None`` when (nearly) singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    scale = max((abs(x) for row in a for x in row), default=0.0) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    for k in range(col, n + 1):
                        m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_affine(points: Sequence[Sequence[float]], *, batch_term: bool = False) -> Fit:
    """Least-squares affine fit of peak bytes to chunk size (and, with ``batch_term``, batch).

    ``points`` are ``(chunk, peak_bytes)`` or ``(chunk, batch_size, peak_bytes)``. Without
    ``batch_term`` the fit is ``peak = intercept + slope * chunk``: at a fixed batch the batch
    term of card 0 is then folded into the intercept, so the fit holds at that batch only.
    With ``batch_term`` the points must span at least two batch sizes, not all on one line of
    (chunk, batch); otherwise :class:`ValueError`. Two points with the same chunk cannot fix a
    slope: :class:`ValueError` too.
    """
    pts = [(float(p[0]), float(p[1]) if len(p) == 3 else 0.0, float(p[-1])) for p in points]
    if not pts:
        raise ValueError("no points to fit")
    if batch_term:
        # normal equations of [1, c, B] -> m, centred for conditioning
        n = len(pts)
        mc = sum(p[0] for p in pts) / n
        mb = sum(p[1] for p in pts) / n
        mm = sum(p[2] for p in pts) / n
        xs = [(p[0] - mc, p[1] - mb, p[2] - mm) for p in pts]
        scc = sum(x[0] * x[0] for x in xs)
        sbb = sum(x[1] * x[1] for x in xs)
        scb = sum(x[0] * x[1] for x in xs)
        det = scc * sbb - scb * scb
        if n < 3 or det <= 1e-9 * max(scc * sbb, 1e-300):
            raise ValueError("points do not separate the chunk from the batch; "
                             "need points at two batch sizes, not all on one line")
        scm = sum(x[0] * x[2] for x in xs)
        sbm = sum(x[1] * x[2] for x in xs)
        sol = _solve_linear([[scc, scb], [scb, sbb]], [scm, sbm])
        if sol is None:  # pragma: no cover - guarded by det above
            raise ValueError("degenerate points")
        slope, bslope = sol
        intercept = mm - slope * mc - bslope * mb
    else:
        n = len(pts)
        mc = sum(p[0] for p in pts) / n
        mm = sum(p[2] for p in pts) / n
        scc = sum((p[0] - mc) ** 2 for p in pts)
        if scc == 0.0:
            raise ValueError("all points have the same chunk size; the slope is unknown")
        slope = sum((p[0] - mc) * (p[2] - mm) for p in pts) / scc
        bslope = 0.0
        intercept = mm - slope * mc
    fit = Fit(intercept_bytes=intercept, slope_bytes=slope, batch_slope_bytes=bslope)
    err = max(abs(fit.predict(c, b) - m) for c, b, m in pts)  # type: ignore[arg-type]
    return Fit(intercept_bytes=intercept, slope_bytes=slope, batch_slope_bytes=bslope,
               max_error_bytes=err, points=len(pts))


# ---- predictions -----------------------------------------------------------------------

def _card_bytes(fit: Fit, card: int, chunk: int, batch_size: int) -> float:
    if card > 0 and chunk == 0:
        return 0.0
    if chunk == 0 and fit.zero_bytes is not None:
        return fit.zero_bytes
    return fit.intercept_bytes + max(fit.slope_bytes, MIN_SLOPE_BYTES) * chunk \
        + fit.batch_slope_bytes * batch_size


def predict(fits: Sequence[Fit], split: Sequence[int], batch_size: Optional[int] = None
            ) -> list[float]:
    """Predicted peak bytes per card for a split (``batch_size`` defaults to its sum).

    A card other than card 0 given no samples is predicted at 0 bytes.
    """
    b = sum(split) if batch_size is None else batch_size
    return [_card_bytes(f, i, c, b) for i, (f, c) in enumerate(zip(fits, split))]


def shares_of(peaks: Sequence[float], budgets: Sequence[int], split: Sequence[int]
              ) -> list[float]:
    """Share of budget per card; 0 for unused cards (other than card 0)."""
    out = []
    for i, (p, b, c) in enumerate(zip(peaks, budgets, split)):
        if i > 0 and c == 0:
            out.append(0.0)
        else:
            out.append(p / b if b > 0 else math.inf)
    return out


# ---- errors ----------------------------------------------------------------------------

def over_budget(card: int, shortfall_bytes: float, batch_size: int) -> NoFeasibleSplitError:
    """No split of ``batch_size`` is predicted to fit: ``card`` is short by this much."""
    short = max(0, int(math.ceil(shortfall_bytes)))
    return NoFeasibleSplitError(
        f"no split of batch size {batch_size} is predicted to fit: card {card} is "
        f"{format_bytes(short)} over its budget", shortfall_bytes=short)


# ---- balance ---------------------------------------------------------------------------

def _cap(caps: Caps, i: int, hi: int) -> int:
    if caps is None or caps[i] is None:
        return hi
    return max(0, min(hi, int(caps[i])))  # type: ignore[arg-type]


def _cmax_at(fits: Sequence[Fit], budgets: Sequence[int], level: float, batch_size: int,
             caps: Caps, m: int, every_card: bool = False) -> Optional[list[int]]:
    """Largest chunk per card whose share stays <= level; ``None`` if card 0 cannot (with
    ``every_card``: if some card cannot take ``m`` samples)."""
    out = []
    for i, (f, bud) in enumerate(zip(fits, budgets)):
        hi = _cap(caps, i, batch_size)
        base = f.intercept_bytes + f.batch_slope_bytes * batch_size
        if bud <= 0:
            if i == 0:
                return None
            out.append(0)
            continue
        room = level * bud - base
        if i == 0 and room < 0:
            if f.zero_bytes is None or f.zero_bytes > level * bud:
                return None
            out.append(0)   # card 0 fits with no samples only (no replica there)
            continue
        slope = max(f.slope_bytes, MIN_SLOPE_BYTES)
        x = room / slope
        c = hi if x >= hi else max(0, int(math.floor(x)))
        if c < m:
            if every_card:
                return None
            c = 0
        out.append(c)
    return out


def _choose_cards(cmax: Sequence[int], batch_size: int, m: int) -> Optional[list[int]]:
    """Cards to use so that some chunks in {0} U [m, cmax_i] sum to batch_size.

    Returns the largest such set (the cards with the largest cmax), or ``None``.
    """
    if batch_size == 0:
        return []
    order = sorted((i for i, c in enumerate(cmax) if c >= max(m, 1)), key=lambda i: (-cmax[i], i))
    best = None
    total = 0
    for k, i in enumerate(order, start=1):
        total += cmax[i]
        if m * k <= batch_size <= total:
            best = order[:k]
    return best


def _construct(fits: Sequence[Fit], budgets: Sequence[int], cmax: Sequence[int],
               batch_size: int, m: int) -> Optional[list[int]]:
    cards = _choose_cards(cmax, batch_size, m)
    if cards is None:
        return None
    split = [0] * len(cmax)
    for i in cards:
        split[i] = cmax[i]
    excess = sum(split) - batch_size
    lo = max(m, 1)

    def key(i: int) -> float:  # share after the card's current chunk (heaviest first)
        b = budgets[i]
        return -(_card_bytes(fits[i], i, split[i], batch_size) / b if b > 0 else math.inf)

    heap = [(key(i), i) for i in cards if split[i] > lo]
    heapq.heapify(heap)
    while excess > 0:
        _, i = heapq.heappop(heap)
        split[i] -= 1
        excess -= 1
        if split[i] > lo:
            heapq.heappush(heap, (key(i), i))
    return split


def solve_balance(fits: Sequence[Fit], budgets: Sequence[int], batch_size: int, *,
                  min_chunk_nonzero: int = 1, caps: Caps = None, strict: bool = True,
                  every_card: bool = False) -> list[int]:
    """The integer split of ``batch_size`` that minimises the largest predicted share.

    Exact for the affine model: bisection on the share level finds the smallest level at
    which each card's largest allowed chunk adds up to the batch; the chunks are then taken
    down from the heaviest cards first. Zeros are allowed; with ``min_chunk_nonzero=m`` no
    card gets 1..m-1. With ``strict`` a split whose largest share exceeds 1 (over budget)
    raises :class:`NoFeasibleSplitError` with ``shortfall_bytes``; without, it is returned.
    Also raises when no split is possible at all (caps or the BatchNorm rule). With
    ``every_card`` no card gets 0 (see the module docstring).
    """
    n = len(fits)
    if len(budgets) != n or n == 0:
        raise ValueError("need one fit and one budget per card")
    if batch_size < 0:
        raise ValueError(f"batch size must be >= 0, got {batch_size}")
    m = max(1, int(min_chunk_nonzero))
    if budgets[0] <= 0:
        raise over_budget(0, -budgets[0] + max(0.0, _card_bytes(fits[0], 0, 0, batch_size)),
                          batch_size)
    hi = _top_level(fits, budgets, batch_size, caps, m, every_card)
    level = _lowest_level(fits, budgets, batch_size, caps, m, every_card, hi)
    cmax = _cmax_at(fits, budgets, level, batch_size, caps, m, every_card)
    assert cmax is not None
    split = _construct(fits, budgets, cmax, batch_size, m)
    assert split is not None and sum(split) == batch_size
    if strict:
        _check_within(fits, budgets, split, batch_size)
    return split


def _top_level(fits: Sequence[Fit], budgets: Sequence[int], batch_size: int, caps: Caps,
               m: int, every_card: bool) -> float:
    """A share level at which some split is possible (every card at its cap); raises
    :class:`NoFeasibleSplitError` when no split is possible at any level."""
    n = len(fits)
    top = [_cap(caps, i, batch_size) for i in range(n)]
    hi = max([_card_bytes(fits[i], i, top[i], batch_size) / budgets[i]
              for i in range(n) if budgets[i] > 0 and card_in_use(i, top[i])] + [0.0])
    hi = max(hi, 0.0) * (1 + 1e-12) + 1e-300
    if every_card:
        low = [i for i in range(n) if top[i] < m or budgets[i] <= 0]
        if low or batch_size < m * n:
            why = (f"every card must get at least {m} samples" if batch_size < m * n else
                   f"card {low[0]} may take fewer than {m} samples")
            raise NoFeasibleSplitError(
                f"no split of batch size {batch_size} is possible: {why}. Try a larger "
                "batch_size or fewer cards.", shortfall_bytes=None)
        hi = max(hi, max(_card_bytes(fits[i], i, m, batch_size) / budgets[i] for i in range(n)) * (1 + 1e-12))
    cmax = _cmax_at(fits, budgets, hi, batch_size, caps, m, every_card)
    if cmax is None or _choose_cards(cmax, batch_size, m) is None:
        why = (f"the cards may take at most {sum(top)} samples together" if sum(top) < batch_size
               else f"no card may get fewer than {m} samples unless it gets none")
        raise NoFeasibleSplitError(
            f"no split of batch size {batch_size} is possible: {why}. Try a smaller batch_size "
            "or more cards.", shortfall_bytes=None)
    return hi


def _lowest_level(fits: Sequence[Fit], budgets: Sequence[int], batch_size: int, caps: Caps,
                  m: int, every_card: bool, hi: float) -> float:
    """Bisection on the share level: the lowest at which the cards' largest allowed chunks
    still add up to the batch (``hi`` is known to)."""
    lo = min([0.0] + [_card_bytes(fits[0], 0, 0, batch_size) / budgets[0]]) - 1.0
    for _ in range(400):
        mid = (lo + hi) / 2
        if not (lo < mid < hi):
            break
        c = _cmax_at(fits, budgets, mid, batch_size, caps, m, every_card)
        if c is not None and _choose_cards(c, batch_size, m) is not None:
            hi = mid
        else:
            lo = mid
    return hi


def _check_within(fits: Sequence[Fit], budgets: Sequence[int], split: Sequence[int],
                  batch_size: int) -> None:
    """Raise :func:`over_budget` for the card furthest over its budget, if any is."""
    peaks = predict(fits, split, batch_size)
    over = [(p - b) if card_in_use(i, split[i]) else -math.inf
            for i, (p, b) in enumerate(zip(peaks, budgets))]
    worst = max(range(len(fits)), key=lambda i: over[i])
    if over[worst] > 0:
        raise over_budget(worst, over[worst], batch_size)
