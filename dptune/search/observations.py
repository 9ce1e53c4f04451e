"""What the probes showed: per-card points and the brackets they put around each card's cap.

Facts the search rests on (checked on the simulator, see ``benchmarks/search.py``): a card
``i >= 1`` depends only on its own chunk (and costs nothing with none); card 0 depends on its
own chunk and on the whole batch (it gathers the outputs); every card is non-decreasing in
each of these. So one probe tells every card something:

- a card measured within its budget at chunk ``c`` fits at every chunk ``<= c``;
- a card measured over its budget (or out of memory) at ``c`` is over at every chunk ``>= c``;
- card 0 measured within budget at ``(c, B)`` fits at every ``(c' <= c, B' <= B)``; over at
  ``(c, B)``, it is over at every ``(c' >= c, B' >= B)``.

On real cards an out-of-memory probe stops the step: only the failing card is known to be
over, and the other cards' peaks are lower bounds (over budget when the bound already is,
unknown otherwise). The simulator runs the whole step, so every card is known there.

Alike cards (``alike``: groups of cards ``i >= 1`` the caller names as the same card with the
same budget, see :mod:`dptune.search.alike`) have one memory curve: each of them holds the
points measured on every card of its group. A group whose cards were measured at one chunk
with different peaks is not alike after all: its cards then hold their own points only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.types import card_in_use
from dptune.units import format_bytes

#: A bracket over a flat step is asked at its roundest chunk when its upper end reads at most
#: this share of the budget above the step (a segment or a few; a larger rise spans steps a
#: chord can place).
FLAT_RISE = 0.01

#: A rise at one sample this many times the slope below it is a staircase's step edge.
EDGE_RATIO = 4

#: A card whose figure falls by more than this share of its budget (and by at least
#: :data:`FRAGMENTED_MIN` bytes) while its work grows is read as fragmented: at the reserved
#: level the caching allocator's cached but free blocks, not the work, set its figure (the
#: benchmarks' BatchNorm CNN reads 3.4 GB less at one more sample). A staircase of the work
#: never falls; the margin leaves room for a real card's repeat-to-repeat spread.
FRAGMENTED_SHARE = 0.01
FRAGMENTED_MIN = 64 * 1024 * 1024


def fall_limit(budget: int) -> int:
    """How far a card's figure may fall as its work grows before it is read as fragmented
    (:data:`FRAGMENTED_SHARE` of its budget, at least :data:`FRAGMENTED_MIN`)."""
    return max(FRAGMENTED_MIN, int(FRAGMENTED_SHARE * budget))


def first_fall(points: Sequence[tuple[tuple[int, ...], int]], limit: int
               ) -> Optional[tuple[int, int]]:
    """The first pair ``(a, b)`` of indices into ``points`` (``(work, figure)``, the work a
    tuple: a card's chunk, card 0's chunk and batch, a rank's batch) where the work grows from
    ``a`` to ``b`` (every coordinate at least as large, one larger) and the figure falls by
    more than ``limit`` bytes; ``None`` when none does."""
    for ia, (wa, fa) in enumerate(points):
        for ib, (wb, fb) in enumerate(points):
            if fa - fb > limit and wb != wa and all(x <= y for x, y in zip(wa, wb)):
                return ia, ib
    return None


def on_one_step(points: Sequence[tuple[int, int]]) -> bool:
    """The last two ``(work, figure)`` points read the same figure at different work: both
    on one flat step of a staircase (the reserved level rises in whole segments)."""
    return len(points) >= 2 and points[-1][1] == points[-2][1] and points[-1][0] != points[-2][0]


def at_step_edge(points: Sequence[tuple[int, int]]) -> bool:
    """The last two ``(work, figure)`` points are one sample apart and the figure rose between
    them by more than :data:`EDGE_RATIO` times its slope from the lowest point below: one
    sample crossed a step's edge of a staircase (a block's size passed a multiple of the
    allocator's rounding), so the new step is flat above it and a line through the two points
    would guess next to them."""
    if len(points) < 3:
        return False
    lo, hi = sorted(points[-2:])
    if hi[0] - lo[0] != 1 or hi[1] <= lo[1]:
        return False
    far = min(points[:-2])
    if far[0] >= lo[0]:
        return False
    slope = (lo[1] - far[1]) / (lo[0] - far[0])
    return hi[1] - lo[1] > EDGE_RATIO * max(slope, 0.0)


def _flat_span(points: Sequence[tuple[int, int]], at: Optional[tuple[int, int]]
               ) -> Optional[tuple[int, int, int]]:
    """``(a, b, W)``: the least and the most work of the points reading the figure of the
    point ``at``, and the smallest power of two ``W`` that holds them in one step ``(m W, (m
    + 1) W]``; ``None`` when no other point reads that figure (or the least work is 0)."""
    if at is None:
        return None
    a = min(w for w, f in points if f == at[1])
    b = max(w for w, f in points if f == at[1])
    if a >= b or a <= 0:
        return None
    w = 1
    while -(-a // w) != -(-b // w):
        w *= 2
    return a, b, w


def step_end(points: Sequence[tuple[int, int]], lo: int, hi: Optional[int]) -> Optional[int]:
    """Where the flat step under the largest ``(work, figure)`` point likely ends: the points
    reading its figure span ``[a, b]``; a staircase's steps are ``(m W, (m + 1) W]`` for a
    power of two ``W`` (a block crossing a multiple of the allocator's rounding), the smallest
    ``W`` that holds ``a`` and ``b`` in one step gives the nearest end, ``ceil(b / W) W``
    (``b + 1``, the one-more test, when ``b`` is that end). ``None`` when no two points share
    the figure or the end is not inside ``(lo, hi)``. A larger true ``W`` ends the step at a
    multiple of this one: the next such probe doubles ``W``."""
    span = _flat_span(points, max(points) if points else None)
    if span is None:
        return None
    a, b, w = span
    end = -(-b // w) * w
    end = b + 1 if end == b else end
    return end if end > lo and (hi is None or end < hi) else None


def step_start(points: Sequence[tuple[int, int]], lo: int, hi: Optional[int]) -> Optional[int]:
    """Where the flat step over the smallest ``(work, figure)`` point likely starts (the mirror
    of :func:`step_end`, for probes over budget): the points reading its figure span
    ``[a, b]``; the smallest power of two ``W`` that holds them in one step ``(m W, (m + 1)
    W]`` gives its nearest start ``m W + 1``. When ``a`` is that start, ``a`` may start its
    step or a wider one starts lower: the middle one of the starts that wider powers of two
    give above ``lo + 1`` (``a - 1``, the last sample of the step below, when there is none).
    ``None`` when no two points share the figure or the start is not inside ``(lo, hi)``."""
    span = _flat_span(points, min(points) if points else None)
    if span is None:
        return None
    a, b, w = span
    start = (-(-a // w) - 1) * w + 1
    if start == a:          # a may start its step, or a wider step starts lower: the middle
        starts = [a]        # of the starts the wider powers of two put above lo
        while True:
            w *= 2
            s2 = (-(-a // w) - 1) * w + 1
            if s2 <= lo + 1:
                break
            if s2 != starts[-1]:    # a step twice as wide may start at a too: wider still
                starts.append(s2)
        start = starts[len(starts) // 2] if len(starts) > 1 else a - 1
        start = a - 1 if start == a else start
    return start if start > lo and (hi is None or start < hi) else None


def roundest(lo: int, hi: int, min_chunk: int = 1) -> Optional[int]:
    """The chunk strictly between ``lo`` and ``hi`` with the most trailing zero bits (the
    nearest the middle among those); ``lo + 1`` instead when ``lo`` is rounder than all of them
    (``lo`` likely the last chunk of its step: the one-more test); ``None`` when there is no
    chunk between. A staircase's steps rise where a block's size crosses a multiple of the
    allocator's rounding (2 MiB for large blocks): for an activation of ``c`` samples of
    ``s`` bytes each, at chunks that are multiples of ``2 MiB / s``, a power of two when ``s``
    has a large power-of-two factor (feature widths usually do). Only a choice of the next
    probe inside a flat step, where the fits cannot place the edge."""
    first = max(lo + 1, min_chunk)
    if first >= hi:
        return None
    best = _roundest_in(first, hi - 1, (lo + hi) / 2)
    if lo >= min_chunk and lo > 0 and _trailing_zeros(lo) > _trailing_zeros(best):
        return first
    return best


def round_middle(lo: int, hi: int, min_chunk: int = 1) -> Optional[int]:
    """A bisection step for a staircase: the batch with the most trailing zero bits in the
    middle half of ``(lo, hi)`` (the nearest the middle among those), so each probe keeps at
    most three quarters of the bracket and lands where steps rise (see :func:`roundest`).
    ``None`` when there is nothing between."""
    first = max(lo + 1, min_chunk)
    if first >= hi:
        return None
    quarter = (hi - lo) // 4
    return _roundest_in(max(first, lo + quarter), max(first, hi - 1 - quarter), (lo + hi) / 2)


def roundest_near(x: int, lo: int, hi: int, width: int) -> int:
    """The batch with the most trailing zero bits within ``width`` of ``x`` and strictly
    inside ``(lo, hi)`` (the nearest ``x`` among those); ``x`` must be inside."""
    return _roundest_in(max(lo + 1, x - width), min(hi - 1, x + width), x)


def _roundest_in(a: int, b: int, mid: float) -> int:
    """The integer of ``[a, b]`` with the most trailing zero bits, the nearest ``mid``."""
    for k in range(b.bit_length(), -1, -1):     # the largest power of two with a multiple in
        step = 1 << k
        c = -(-a // step) * step
        if c <= b:
            below = c + (max(0, int(mid) - c) // step) * step    # the multiples nearest mid
            return min((x for x in (below, below + step) if a <= x <= b), key=lambda x: (abs(x - mid), x))
    return a


def _trailing_zeros(x: int) -> int:
    return (x & -x).bit_length() - 1


__all__ = ["Point", "Bracket", "Observations", "next_chunk", "roundest", "round_middle", "roundest_near", "step_end", "step_start", "on_one_step",
           "at_step_edge", "fall_limit", "first_fall", "FLAT_RISE", "FRAGMENTED_SHARE", "FRAGMENTED_MIN"]


def next_chunk(c: int, min_chunk: int) -> int:
    """The next chunk a card may take after ``c`` (BatchNorm: 0, then ``min_chunk``)."""
    return max(c + 1, min_chunk) if c == 0 else c + 1


@dataclass(frozen=True)
class Point:
    """One card in one probe: its chunk, the batch, its peak and what the peak shows."""

    chunk: int
    batch: int
    peak_bytes: int
    over: bool          # over budget or out of memory on this card
    exact: bool         # a measurement; False: a lower bound (another card failed first)
    probe: int = -1     # which probe (0-based, in the order run)


@dataclass(frozen=True)
class Bracket:
    """A card's cap kept as ``[lo, hi)``: ``lo`` measured within budget, ``hi`` measured over.

    ``what`` is ``"chunk"`` (a card's own chunk) or ``"batch"`` (card 0 in the largest-batch
    search: the whole batch along the line where the other cards sit at their caps).
    ``hi`` is ``None`` until something was measured over. Closed: ``hi`` is the next value
    after ``lo`` (one more sample was measured not to fit).
    """

    card: int
    lo: int
    hi: Optional[int]
    what: str = "chunk"
    min_chunk: int = 1

    @property
    def closed(self) -> bool:
        if self.hi is None:
            return False
        step = next_chunk(self.lo, self.min_chunk) if self.what == "chunk" else self.lo + 1
        return self.hi <= step

    @property
    def width(self) -> Optional[int]:
        return None if self.hi is None else self.hi - self.lo

    def to_dict(self) -> dict[str, object]:
        return dict(card=self.card, lo=self.lo, hi=self.hi, what=self.what,
                    min_chunk=self.min_chunk, closed=self.closed)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Bracket":
        return cls(card=int(d["card"]), lo=int(d["lo"]),
                   hi=None if d.get("hi") is None else int(d["hi"]), what=str(d.get("what", "chunk")),
                   min_chunk=int(d.get("min_chunk", 1)))

    def describe(self) -> str:
        hi = "?" if self.hi is None else str(self.hi)
        what = f"card {self.card}" if self.what == "chunk" else "whole batch"
        return f"{what} [{self.lo}, {hi}){'' if self.closed else ' open'}"


class Observations:
    """Every probe, and per card the points it gave (the search's only memory)."""

    def __init__(self, budgets: Sequence[int], *, exact_on_oom: bool, min_chunk: int = 1,
                 alike: Sequence[Sequence[int]] = ()):
        self.budgets = list(budgets)
        self.n = len(self.budgets)
        self.exact_on_oom = exact_on_oom
        self.min_chunk = min_chunk
        self.probes: list[ProbeResult] = []
        #: per card the points measured on it; ``points``: with its alike cards' points
        self.own: list[list[Point]] = [[] for _ in range(self.n)]
        self.points: list[list[Point]] = [[] for _ in range(self.n)]
        self.by_split: dict[tuple[int, ...], ProbeResult] = {}
        self.claimed: tuple[tuple[int, ...], ...] = tuple(tuple(g) for g in alike)
        #: the groups of alike cards the probes agree with (see the module docstring)
        self.groups: tuple[tuple[int, ...], ...] = self.claimed

    # ---- recording -------------------------------------------------------------------
    def add(self, r: ProbeResult) -> None:
        self.probes.append(r)
        self.by_split[tuple(r.chunk_sizes)] = r
        self._add_points(r, len(self.probes) - 1, range(self.n))

    def add_prior(self, r: ProbeResult, cards: Sequence[int]) -> None:
        """What a probe of another search showed ``cards`` (whose memory does not depend on
        what that search changed, e.g. where the outputs are gathered): their points only,
        with ``probe=-1`` (not one of this search's probes, never returned)."""
        self._add_points(r, -1, cards)

    def _add_points(self, r: ProbeResult, k: int, cards: Sequence[int]) -> None:
        b = r.batch_size
        for i, (c, p) in enumerate(zip(r.chunk_sizes, r.peak_bytes)):
            if (i > 0 and c == 0) or i not in cards:
                continue               # no replica ran there: nothing measured
            p = int(p)
            if r.feasible or self.exact_on_oom:
                over = p > self.budgets[i] or r.oom_device == i
                self.own[i].append(Point(c, b, p, over, True, k))
            elif r.oom_device == i:
                self.own[i].append(Point(c, b, max(p, self.budgets[i] + 1), True, False, k))
            elif p > self.budgets[i]:   # a lower bound already over budget
                self.own[i].append(Point(c, b, p, True, False, k))
        self._pool()

    def add_bound(self, r: ProbeResult) -> None:
        """Record only what ``r`` shows over budget, as lower bounds, not as a probe of this
        search: ``r`` was measured elsewhere on a surface at most as high as this one (the same
        split at a shorter length: memory only grows with the length), so a card over budget
        there is over here too. Never a fit, never an answer."""
        b = r.batch_size
        for i, (c, p) in enumerate(zip(r.chunk_sizes, r.peak_bytes)):
            if card_in_use(i, c) and (int(p) > self.budgets[i] or r.oom_device == i):
                self.own[i].append(Point(c, b, max(int(p), self.budgets[i] + 1), True, False))
        self._pool()

    def _pool(self) -> None:
        """``points`` from ``own``: each card of an alike group holds its group's points."""
        self.groups = tuple(g for g in self.claimed if self.agree(g))
        self.points = [list(p) for p in self.own]
        for g in self.groups:
            merged = [p for i in g for p in self.own[i]]
            for i in g:
                self.points[i] = list(merged)

    def agree(self, group: Sequence[int]) -> bool:
        """No chunk measured on two cards of ``group`` with different peaks."""
        seen: dict[int, int] = {}
        for i in group:
            for p in self.own[i]:
                if p.exact and p.chunk > 0 and seen.setdefault(p.chunk, p.peak_bytes) != p.peak_bytes:
                    return False
        return True

    def within_budget(self, r: ProbeResult) -> bool:
        """Measured to fit every card in use within its budget."""
        return r.within_budget(self.budgets)

    def shares(self, r: ProbeResult) -> list[float]:
        return [(p / b if b > 0 else float("inf")) if card_in_use(i, c) else 0.0
                for i, (p, b, c) in enumerate(zip(r.peak_bytes, self.budgets, r.chunk_sizes))]

    # ---- what is known ------------------------------------------------------------------
    def fit_points(self, i: int) -> list[Point]:
        return [p for p in self.points[i] if p.exact and not p.over]

    def over_points(self, i: int) -> list[Point]:
        return [p for p in self.points[i] if p.over]

    def flat_over(self, i: int) -> bool:
        """Card ``i``'s last two points over budget read the same figure at different
        chunks: a flat step of a staircase (the reserved level rises in whole segments),
        where a fit or a chord through them guesses next to the end it came from and walks
        a few samples a probe (the largest-batch search halves card 0's bracket there).
        Over budget only: within budget, the bracket's upper end may lie far off."""
        pts = [p for p in self.points[i] if p.exact and p.over and p.chunk > 0]
        return on_one_step([(p.chunk, p.peak_bytes) for p in pts])

    def flat_within(self, i: int, hi_peak: Optional[int] = None) -> bool:
        """Card ``i``'s two largest chunks measured within budget (card 0: its last two points
        within budget, its figure depends on the batch too) read the same figure: the
        bracket's lower end sits on a flat step of a staircase (the reserved level rises in
        whole segments). Where ``hi_peak`` (the figure at the bracket's upper end) is given,
        that end must also lie at most :data:`FLAT_RISE` of the budget above it: about one
        segment's rise, whose edge a fit through the points cannot place (it guesses next to
        the lower end and walks a few samples a probe); the roundest chunk of the bracket
        can (:func:`roundest`)."""
        pts = [p for p in self.points[i] if p.exact and not p.over and p.chunk > 0]
        if i > 0:       # by chunk, one point each (its last measured)
            pts = list({p.chunk: p for p in sorted(pts, key=lambda p: p.chunk)}.values())
        work = [(p.chunk, p.peak_bytes) for p in pts]
        if not (on_one_step(work) or at_step_edge(work)):
            return False
        return hi_peak is None or hi_peak - pts[-1].peak_bytes <= FLAT_RISE * self.budgets[i]

    def flat_end(self, i: int, lo: int, hi: Optional[int]) -> Optional[int]:
        """Card ``i``'s chunk where the flat step under its largest chunk measured within
        budget likely ends (:func:`step_end`), inside ``(lo, hi)``; ``None`` when no two of its
        chunks within budget read that figure. Card 0's points at any batch count (its
        figure's part that grows with the batch is taken as flat there too)."""
        pts = [(p.chunk, p.peak_bytes) for p in self.fit_points(i) if p.exact and p.chunk > 0]
        return step_end(pts, lo, hi)

    def not_monotone(self, alike: Sequence[Sequence[int]] = ()) -> Optional[str]:
        """Where the points contradict the monotone surface the certificate rests on: a card
        measured within budget above a chunk it was measured over at (card 0: at a chunk
        and a batch both at least as large). The reserved level can do this (fragmentation
        decides whether a freed block is reused). ``alike``: groups of cards ``i >= 1`` said
        to be the same card (:mod:`dptune.search.alike`); one of them within budget above a
        chunk another was over at contradicts it too, as long as the group's figures agree
        wherever two of its cards were measured at one chunk. ``None`` when nothing
        contradicts it."""
        groups = [tuple(g) for g in alike if self.agree(g)]
        for i in range(self.n):
            mates = next((g for g in groups if i in g), (i,))
            overs = [(j, o) for j in mates for o in self.own[j] if o.over and o.exact]
            for f in (p for p in self.own[i] if p.exact and not p.over):
                for j, o in overs:
                    if o.chunk <= f.chunk and (i > 0 or o.batch <= f.batch) and o.chunk > 0:
                        who = "is" if j == i else f"card {j}, the same card, is"
                        return (f"card {i} fits at {f.chunk} samples"
                                f"{f' of {f.batch}' if i == 0 else ''} and {who} over at "
                                f"{o.chunk}{f' of {o.batch}' if i == 0 else ''}")
        return self.fragmented()

    def fragmented(self) -> Optional[str]:
        """Where fragmentation, not the work, sets a card's figure: the figure falls as the
        card's work grows (card 0: its chunk and the batch both at least as large, one of them
        larger) by more than :data:`FRAGMENTED_SHARE` of its budget (at least
        :data:`FRAGMENTED_MIN`), within budget or not. A certificate's "one more sample is
        over" then proves nothing about larger chunks. The simulator's allocator model has a
        BatchNorm CNN's card at 23,760 MiB reserved with 3,052 samples and 20,320 MiB with
        3,053 (15.8 GB allocated at both). (The part over the allocated peak falling is no
        sign: a larger step's new blocks may fill cached free space while the figure still
        grows, as card 0's gathered outputs do.) ``None`` when no card shows it."""
        for i in range(self.n):
            pts = [p for p in self.own[i] if p.exact and p.chunk > 0]
            fall = first_fall([((p.chunk, p.batch) if i == 0 else (p.chunk,), p.peak_bytes)
                               for p in pts], fall_limit(self.budgets[i]))
            if fall is not None:
                a, b = (pts[k] for k in fall)
                at = [f"{p.chunk} samples{f' of {p.batch}' if i == 0 else ''}" for p in (a, b)]
                return (f"card {i} reads {format_bytes(a.peak_bytes)} at {at[0]} and "
                        f"{format_bytes(b.peak_bytes)} at {at[1]}: its figure falls as "
                        "its work grows")
        return None

    def bracket(self, i: int) -> Bracket:
        """Card ``i >= 1``'s cap: the largest chunk measured within budget, the smallest over."""
        overs = [p.chunk for p in self.over_points(i)]
        hi = min(overs) if overs else None
        fits = [p.chunk for p in self.fit_points(i) if hi is None or p.chunk < hi]
        return Bracket(card=i, lo=max(fits, default=0), hi=hi, min_chunk=self.min_chunk)

    def card_fits(self, i: int, c: int) -> bool:
        """Card ``i >= 1`` is known to fit with chunk ``c``."""
        return c == 0 or any(p.chunk >= c for p in self.fit_points(i))

    def card_over(self, i: int, c: int) -> bool:
        return c > 0 and any(p.chunk <= c for p in self.over_points(i))

    def card0_fits(self, c: int, batch: int) -> bool:
        return any(p.chunk >= c and p.batch >= batch for p in self.fit_points(0))

    def card0_over(self, c: int, batch: int) -> bool:
        return any(p.chunk <= c and p.batch <= batch for p in self.over_points(0))

    def split_fits(self, split: Sequence[int]) -> bool:
        """Every card is known to fit this split (from measured points, never from a fit)."""
        b = sum(split)
        return self.card0_fits(split[0], b) and all(
            self.card_fits(i, c) for i, c in enumerate(split) if i > 0)

    def fit_witness(self, split: Sequence[int]) -> Optional[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Why ``split`` is known to fit without being probed: per card the lowest peak
        measured within budget at a point that dominates it (a card ``i >= 1`` at a chunk at
        least as large; card 0 at a chunk and a batch at least as large), which bounds that
        card's peak from above, and the probes (0-based) those points come from. ``None``
        when some card is not covered. A card with no samples (``i >= 1``) has peak 0.
        """
        b = sum(split)
        peaks: list[int] = []
        used: set[int] = set()
        for i, c in enumerate(split):
            if i > 0 and c == 0:
                peaks.append(0)
                continue
            dom = [p for p in self.fit_points(i)       # this search's probes only
                   if p.probe >= 0 and p.chunk >= c and (i > 0 or p.batch >= b)]
            if not dom:
                return None
            best = min(dom, key=lambda p: (p.peak_bytes, -p.probe))
            peaks.append(best.peak_bytes)
            used.add(best.probe)
        return tuple(peaks), tuple(sorted(used))

    def split_over(self, split: Sequence[int]) -> bool:
        """Some card is known to be over its budget with this split."""
        b = sum(split)
        return self.card0_over(split[0], b) or any(
            self.card_over(i, c) for i, c in enumerate(split) if i > 0)

    def best_within(self, batch: Optional[int] = None) -> Optional[ProbeResult]:
        """The largest batch measured within budget (then the lowest largest share)."""
        ok = [(k, r) for k, r in enumerate(self.probes) if self.within_budget(r)
              and (batch is None or r.batch_size == batch)]
        if not ok:
            return None
        return min(ok, key=lambda kr: (-kr[1].batch_size, max(self.shares(kr[1])), -kr[0]))[1]
