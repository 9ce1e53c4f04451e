"""Local fits of each card's memory, used only to choose the next point inside a bracket.

Nothing here decides an answer: a fit proposes, a probe measures, the brackets keep the
result. The rules that keep fits honest:

- no fit spans chunk 0: a card with no samples runs no replica (card 0 still pays for the
  weights, gradients, optimizer state and the gathered outputs), a step, not a slope;
- card 0's cost per sample of the whole batch (``g``) comes only from two probes that gave
  card 0 the same chunk; its cost per sample of its own chunk from probes at different chunks
  after ``g * batch`` is taken off;
- a secant uses the two measured points nearest the target (the curves are a maximum of a
  few affine pieces, so a far point misleads);
- before any card ``i >= 1`` is measured at two chunks, a slope is taken across the cards
  (a first probe that gave them different chunks), and only when every card lies on one line
  (cards that run the same replica cost alike per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from dptune.search.observations import Observations, Point

__all__ = ["Line", "secant", "chord_cap", "CardFits"]

#: A slope across the cards is taken only when every card lies this close (relative) to it.
POOLED_TOLERANCE = 0.02

#: A fitted slope below this (a plateau) is treated as this, in bytes per sample.
MIN_SLOPE_BYTES = 1.0


@dataclass(frozen=True)
class Line:
    """``intercept + slope * x`` in bytes."""

    intercept: float
    slope: float

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x


def secant(pts: Sequence[tuple[int, float]], target: int, across_steps: bool = False) -> Optional[Line]:
    """The line through the point nearest ``target`` and the next nearest with another x
    (None if fewer). When ``target`` lies far from both, the second point is taken at least
    a quarter of that distance away (a slope over a sample or two, extrapolated far, turns
    the allocator's rounding into a large error). ``across_steps``: when the two read the
    same figure (one flat step of the reserved level's staircase), the nearest point with
    another figure is taken instead, where there is one."""
    if not pts:
        return None
    order = sorted(pts, key=lambda p: (abs(p[0] - target), -p[0]))
    a = order[0]
    reach = abs(target - a[0]) // 4
    b = next((p for p in order if abs(p[0] - a[0]) >= max(reach, 1)), None)
    if b is None:
        b = next((p for p in order if p[0] != a[0]), None)
    if b is None:
        return None
    if across_steps and b[1] == a[1]:    # both on one flat step of a staircase: its slope says nothing
        b = next((p for p in order if p[0] != a[0] and p[1] != a[1]), b)
    slope = (b[1] - a[1]) / (b[0] - a[0])
    return Line(a[1] - slope * a[0], slope)


def chord_cap(lo: tuple[int, float], hi: tuple[int, float], budget: float) -> int:
    """Where the chord between a point within budget and one over it crosses the budget."""
    (c0, p0), (c1, p1) = lo, hi
    if p1 <= p0:
        return (c0 + c1) // 2
    return c0 + int((budget - p0) / (p1 - p0) * (c1 - c0))


class CardFits:
    """Per-card predictions from the observations as they stand (rebuilt after each probe)."""

    def __init__(self, obs: Observations, across_steps: bool = False):
        self.obs = obs
        #: secants near a target step off a flat step (:func:`secant`); the balance's
        #: solver, which reads a flat line as free room, asks for it
        self.across_steps = across_steps
        self.n = obs.n
        self.g = self._batch_slope()
        others = [s for s in (self._slope(i) for i in range(1, self.n)) if s is not None]
        pooled = None if others else self._pooled_slope()
        #: True when the slope is taken across the cards (none measured at two chunks)
        self.pooled = pooled is not None
        self.median_slope: Optional[float] = sorted(others)[len(others) // 2] if others \
            else pooled

    # ---- card 0's cost per sample of the whole batch ------------------------------------
    def _batch_slope(self) -> Optional[float]:
        if self.n == 1:
            return 0.0          # chunk and batch move together: one slope holds both
        pts = [p for p in self.obs.points[0] if p.exact]
        # the pair with the widest batch gap (then the latest): a gap of a few samples turns
        # the allocator's rounding into a slope that is then extrapolated over thousands
        best: Optional[tuple[int, float]] = None     # (batch gap, slope)
        for k, p in enumerate(pts):
            for q in pts[:k]:
                if q.chunk == p.chunk and q.batch != p.batch:
                    s = (p.peak_bytes - q.peak_bytes) / (p.batch - q.batch)
                    if best is None or abs(p.batch - q.batch) >= best[0]:
                        best = (abs(p.batch - q.batch), s)
        return None if best is None else max(0.0, best[1])

    # ---- cards >= 1 -------------------------------------------------------------------
    def _exact(self, i: int) -> list[Point]:
        return [p for p in self.obs.points[i] if p.exact and p.chunk > 0]

    def _slope(self, i: int) -> Optional[float]:
        pts = self._exact(i)
        line = secant([(p.chunk, float(p.peak_bytes)) for p in pts],
                      max((p.chunk for p in pts), default=0))
        return None if line is None else line.slope

    def _pooled_slope(self) -> Optional[float]:
        """No card ``i >= 1`` measured at two chunks yet: the slope across the cards (a
        first probe that gave them different chunks; cards that run the same replica cost
        alike per sample, a guess that only chooses the next probe). With the points at two
        chunks only, the 2% check tests that the cards at one chunk agree."""
        pts = [(p.chunk, float(p.peak_bytes)) for i in range(1, self.n) for p in self._exact(i)]
        line = secant(pts, max((c for c, _ in pts), default=0))
        if line is None or any(abs(line.at(c) - y) > POOLED_TOLERANCE * y for c, y in pts):
            return None     # the cards do not lie on one line: not alike, no slope across
        return line.slope

    def card_line(self, i: int, target: int) -> Optional[Line]:
        """Card ``i >= 1`` near chunk ``target``: a secant, or one point and the others' slope
        (turned up through a failed probe's lower bound: :meth:`_lifted`)."""
        pts = [(p.chunk, float(p.peak_bytes)) for p in self._exact(i)]
        line = secant(pts, target, self.across_steps)
        if line is not None:
            return self._lifted(i, Line(line.intercept, max(line.slope, MIN_SLOPE_BYTES)))
        if pts and self.median_slope is not None:
            c, m = pts[0]
            s = max(self.median_slope, MIN_SLOPE_BYTES)
            return self._lifted(i, Line(m - s * c, s))
        return None

    def _lifted(self, i: int, line: Line, batch: Optional[int] = None) -> Line:
        """``line`` (card ``i``'s figure against its chunk; card 0's at ``batch``) turned up
        about its value at the card's largest chunk measured exactly below a chunk where one
        of this search's probes ran out of memory on it, so that it passes through that
        probe's figure, when it predicted less there. On real cards a failed probe records
        the failing card's figure as a lower bound, never a fit point: a line from far below
        that missed the failure would put the card just below it again, one sample a probe.
        Card 0's figure at another batch is moved by its cost per sample of the whole batch
        (a guess: the line only chooses the next probe)."""
        g = self.g if self.g is not None else 0.0
        for o in self.obs.points[i]:
            if o.exact or not o.over or o.chunk <= 0 or o.probe < 0:
                continue    # measured, or a bound carried from another search
            below = [p.chunk for p in self.obs.points[i] if p.exact and 0 < p.chunk < o.chunk]
            y = o.peak_bytes - (g * (o.batch - batch) if i == 0 and batch is not None else 0.0)
            if not below or line.at(o.chunk) >= y:
                continue
            a = max(below)
            slope = (y - line.at(a)) / (o.chunk - a)
            line = Line(line.at(a) - slope * a, slope)
        return line

    def predict(self, i: int, c: int, batch: int) -> Optional[float]:
        """Predicted peak of card ``i`` (bytes) with chunk ``c`` in a batch; None if unknown."""
        if i == 0:
            return self.predict0(c, batch)
        if c == 0:
            return 0.0
        line = self.card_line(i, c)
        return None if line is None else line.at(c)

    # ---- card 0 -------------------------------------------------------------------------
    def card0_line(self, target: int, batch: int) -> Optional[Line]:
        """Card 0 against its own chunk at this batch (chunks >= 1; ``g * batch`` included)."""
        g = self.g if self.g is not None else 0.0
        pts = [p for p in self.obs.points[0] if p.exact and p.chunk > 0]
        if self.g is None:  # without g only points at this batch are comparable
            same = [p for p in pts if p.batch == batch]
            pts = same or pts
        adj = [(p.chunk, p.peak_bytes - g * p.batch) for p in pts]
        line = secant(adj, target, self.across_steps)
        if line is None and adj:
            near = min(adj, key=lambda a: abs(a[0] - target))
            s = self.median_slope if self.median_slope is not None else 0.0
            line = Line(near[1] - s * near[0], s)
        if line is None:
            return None
        return self._lifted(0, Line(line.intercept + g * batch, max(line.slope, MIN_SLOPE_BYTES)),
                            batch)

    def predict0(self, c: int, batch: int) -> Optional[float]:
        g = self.g if self.g is not None else 0.0
        if c == 0:
            zero = [p for p in self.obs.points[0] if p.exact and p.chunk == 0]
            if zero:
                p = min(zero, key=lambda p: abs(p.batch - batch))
                return p.peak_bytes + g * (batch - p.batch)
        line = self.card0_line(max(c, 1), batch)
        return None if line is None else line.at(c)
