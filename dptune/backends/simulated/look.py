"""Looking past a largest-batch certificate's over points on the allocator model.

At the reserved level a card's figure (the caching allocator's reserved peak plus NCCL's
buffers) can be over at a chunk and within budget again a few samples on, so "one more sample
is over" proves the largest batch only where the figure does not fall above the over point.
On simulated cards each chunk of the window above it costs a replay of the allocator, not a
probe: :func:`look_past` draws every chunk's step from two real simulated steps
(:class:`ScaledTraces`), checks the drawing against a third, replays each chunk until the
card's allocated peak alone (which the reserved one never goes below) passes its budget, and
simulates for real a chunk the drawing finds within budget before reporting it
(:class:`dptune.types.WindowCheck`). :meth:`SimulatedBackend.look_past` runs it on its own
steps; :func:`look_past_of` hands it to the search (``search.Known.look_past``) where the
budgets are at the reserved level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig, AllocatorStats, Event, replay
from dptune.budget import BudgetLevel
from dptune.types import CardWindow, WindowCheck

__all__ = ["ScaledTraces", "step_stats", "scan", "window_end", "chunks_for", "look_past", "look_past_of",
           "LOOK_EVENTS", "LOOK_MAX_CHUNKS"]

#: one card's replay traces (set-up, warm-up step, measured step), ids in order of first use
Traces = Sequence[Sequence[Event]]


@dataclass(frozen=True)
class ScaledTraces:
    """One card's replay traces (set-up, warm-up step, measured step; ids as
    :func:`canonical_traces` names them) at some chunk (:attr:`base`) and at ``span`` samples
    more (:attr:`far`), and what they replay in between and beyond: each malloc's size drawn
    on the line through the two, rounded up to the allocator's 512 bytes. Where a card's work
    grows by a fixed amount per sample (the activations of a fixed-shape model) that is the
    step within one 512-byte block per malloc (:attr:`margin` in all). :meth:`of` is ``None``
    where the two steps' mallocs and frees do not pair up, or a malloc shrinks."""

    base: tuple[tuple[Event, ...], ...]
    far: tuple[tuple[Event, ...], ...]
    span: int

    @classmethod
    def of(cls, at: Sequence[Sequence[Event]], far: Sequence[Sequence[Event]], span: int
           ) -> Optional["ScaledTraces"]:
        if span <= 0 or len(at) != len(far):
            return None
        for x, y in zip(at, far):
            if len(x) != len(y):
                return None
            for e, f in zip(x, y):
                if e.id != f.id or e.stream != f.stream or (e.delta > 0) != (f.delta > 0) \
                        or (e.delta > 0 and f.delta < e.delta):
                    return None
        return cls(tuple(tuple(t) for t in at), tuple(tuple(t) for t in far), span)

    @property
    def margin(self) -> int:
        """How far the allocated peak drawn may lie from a real step's: 512 bytes a malloc
        that grows."""
        return 512 * sum(1 for x, y in zip(self.base, self.far) for e, f in zip(x, y)
                         if e.delta > 0 and f.delta != e.delta)

    def at(self, more: int) -> list[list[Event]]:
        """The traces with ``more`` samples more than :attr:`base`'s."""
        unit = 512 * self.span
        return [[e if e.delta <= 0 or f.delta == e.delta else
                 Event(e.id, -(-(e.delta * self.span + (f.delta - e.delta) * more) // unit) * 512,
                       e.stream)
                 for e, f in zip(x, y)] for x, y in zip(self.base, self.far)]

    def stats(self, more: int, config: AllocatorConfig) -> AllocatorStats:
        """The measured step's figures with ``more`` samples more (no memory limit)."""
        return replay(self.at(more), 1 << 62, config, measure_from=len(self.base) - 1)


def step_stats(traces: Sequence[Sequence[Event]], config: AllocatorConfig) -> AllocatorStats:
    """The measured (last) step's figures of ``traces`` replayed without a memory limit."""
    return replay(traces, 1 << 62, config, measure_from=len(traces) - 1)


def scan(scaled: ScaledTraces, first: int, budget: int, nccl: int, config: AllocatorConfig,
              limit: int) -> tuple[Optional[int], Optional[int], Optional[int], int]:
    """From ``first`` samples more than ``scaled``'s base, one sample at a time: the level's
    figure (reserved peak + ``nccl``) against ``budget``. Returns ``(end, fits, fits_bytes,
    replays)``, in samples more than the base: ``fits`` the first within budget (the look
    stops there), else ``end`` the first whose allocated peak + ``nccl``, less the scaling's
    margin, is over (the sizes never shrink as the work grows, so the allocated peak never
    falls: from there every step is over); both ``None`` where ``limit`` replays ran first."""
    margin = scaled.margin
    for n in range(limit):
        k = first + n
        s = scaled.stats(k, config)
        if s.reserved_peak + nccl <= budget:
            return None, k, s.reserved_peak + nccl, n + 1
        if s.allocated_peak + nccl - margin > budget:
            return k, None, None, n + 1
    return None, None, None, limit


def window_end(scaled: ScaledTraces, budget: int, nccl: int, config: AllocatorConfig,
               limit: int) -> int:
    """The fewest samples more than the base at which the allocated peak + ``nccl`` passes
    ``budget`` (at most ``limit``): by doubling, then halving (the allocated peak never falls
    as the work grows)."""
    def over(k: int) -> bool:
        return scaled.stats(k, config).allocated_peak + nccl > budget
    lo, hi = 0, 1
    while hi < limit and not over(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) else (mid, hi)
    return hi


class _Lines:
    """How each card looked at moves: card 0 along the answer's line (its chunk and the batch
    one more sample per step; where it holds no samples it keeps none and the last card takes
    the batch's growth), each card ``i >= 1`` alone from its chunk in the answer (from its
    over point where it holds none: a card with no samples runs no replica)."""

    def __init__(self, split: Sequence[int], over: Sequence[Optional[int]]):
        self.base = [int(c) for c in split]
        n = len(self.base)
        self.looking = [i for i in range(n) if over[i] is not None]
        self.zero0 = 0 in self.looking and self.base[0] == 0 and n > 1
        self.root = [c if c > 0 or over[i] is None or i == 0 else int(over[i] or 0)
                     for i, c in enumerate(self.base)]
        self.first = {i: 1 if i == 0 else int(over[i] or 0) - self.root[i] for i in self.looking}

    def moved(self, more: dict[int, int], card0: bool) -> tuple[int, ...]:
        """The split of the drawing's base with the cards of ``more`` moved on that many
        samples (card 0's move, or the others' together)."""
        base = self.base
        if card0:
            k = more.get(0, 0)
            return tuple(base[:-1] + [base[-1] + k] if self.zero0 else [base[0] + k] + base[1:])
        return tuple([base[0]] + [c + more.get(i, 0) for i, c in enumerate(self.root) if i])

    def window(self, i: int, found: Optional[tuple[Optional[int], Optional[int], Optional[int]]]
               ) -> CardWindow:
        """Card ``i``'s window from what its scan found (``None``: not looked at)."""
        empty = i == 0 and self.zero0          # card 0 with no samples: a window of batches
        at0 = sum(self.base) if empty else self.root[i]
        start = at0 + self.first[i]
        batch0 = sum(self.base) + start - self.base[0] if i == 0 and not empty else None
        if found is None:
            return CardWindow(i, start, None, scaled=False, batch_start=batch0, no_samples=empty)
        end, fits, fits_bytes = found
        return CardWindow(i, start, None if end is None else at0 + end,
                          None if fits is None else at0 + fits, fits_bytes,
                          batch_start=batch0, no_samples=empty)


#: events a card's look may replay in all: a short step (a few layers) is looked at over more
#: chunks than ``limit`` (the benchmarks' MLP: card 0's window is 15,982 chunks)
LOOK_EVENTS = 8_000_000
#: the most chunks a card's look replays, however short its step
LOOK_MAX_CHUNKS = 65_536


def chunks_for(scaled: ScaledTraces, limit: int) -> int:
    """How many chunks a card's look may replay: ``limit``, or as many as
    :data:`LOOK_EVENTS` events allow (at most :data:`LOOK_MAX_CHUNKS`)."""
    events = max(1, sum(len(t) for t in scaled.base))
    return min(LOOK_MAX_CHUNKS, max(limit, LOOK_EVENTS // events))


def look_past(traces_of: Callable[[Sequence[int]], Sequence[Traces]], split: Sequence[int],
              over: Sequence[Optional[int]], budgets: Sequence[int], config: AllocatorConfig,
              nccl: int, limit: int) -> WindowCheck:
    """Past a largest-batch certificate's over points (the reserved level: the reserved peak
    + ``nccl`` against ``budgets``): for each card ``i >= 1`` with ``over[i]`` (the smallest
    chunk measured over), every chunk from there until the card's allocated peak alone passes
    its budget; for card 0 (``over[0]`` not ``None``), one more sample at a time along the
    answer's line, to the same end (:class:`_Lines`). ``traces_of(split)``: every card's
    replay traces of one real simulated step.

    Each chunk is replayed from the card's traces at ``split`` and at the window's far end,
    each malloc drawn on the line through the two (:class:`ScaledTraces`), the drawing
    checked against a real step one sample past ``split`` (a card whose step there differs is
    not looked at: ``scaled`` false); a chunk found to fit is simulated for real before it is
    reported. Up to eight simulated steps and a replay per chunk: at most ``limit`` chunks a
    card, more where its steps are short (:func:`chunks_for`)."""
    lines = _Lines(split, over)
    simulated: dict[tuple[int, ...], Sequence[Traces]] = {}

    def steps(more: dict[int, int]) -> dict[int, Traces]:
        """Real traces of the cards of ``more`` moved on that many samples (two simulated
        steps at most: card 0 on its line, the others together)."""
        out: dict[int, Traces] = {}
        for card0 in (True, False):
            part = {i: k for i, k in more.items() if (i == 0) == card0}
            if part:
                s = lines.moved(part, card0)
                if s not in simulated:
                    simulated[s] = traces_of(s)
                out.update({i: simulated[s][i] for i in part})
        return out

    first = lines.first
    at = steps({i: 0 for i in lines.looking})
    plus = steps({i: 1 for i in lines.looking})
    near = {i: sc for i in lines.looking if (sc := ScaledTraces.of(at[i], plus[i], 1)) is not None}
    reach = {i: chunks_for(sc, limit) for i, sc in near.items()}
    far = {i: max(first[i] + 1, window_end(sc, budgets[i], nccl, config, reach[i]))
           for i, sc in near.items()}
    ends = steps(far)
    found: dict[int, tuple[Optional[int], Optional[int], Optional[int]]] = {}
    done: dict[tuple, tuple[Optional[int], Optional[int], Optional[int], int]] = {}
    replays = 0
    for i, k in far.items():
        sc = ScaledTraces.of(at[i], ends[i], k)
        if sc is None or not _agrees(sc, plus[i], config):
            continue                  # the drawing misses a real step: not looked at
        key = (sc, budgets[i], first[i])
        if key not in done:
            done[key] = scan(sc, first[i], budgets[i], nccl, config, reach[i])
            replays += done[key][3]
        found[i] = done[key][:3]
    # a chunk the drawing says fits is simulated for real before it is reported
    for i, traces in steps({i: r[1] for i, r in found.items() if r[1] is not None}).items():
        if step_stats(traces, config).reserved_peak + nccl > budgets[i]:
            del found[i]               # the drawing was wrong there: not looked at
    return WindowCheck(tuple(lines.window(i, found.get(i)) for i in lines.looking), replays)


def _agrees(scaled: ScaledTraces, real: Traces, config: AllocatorConfig) -> bool:
    """The real step one sample past the base replays as the drawn one: the same reserved
    peak, the allocated peak within the drawing's margin."""
    want, got = scaled.stats(1, config), step_stats(real, config)
    return want.reserved_peak == got.reserved_peak and \
        abs(want.allocated_peak - got.allocated_peak) <= scaled.margin


def look_past_of(backend: Any, budgets: Sequence[int], level: BudgetLevel
                 ) -> Optional[Callable[[Sequence[int], Sequence[Optional[int]]], WindowCheck]]:
    """The search's look past a certificate's over points (``search.Known.look_past``) where
    ``backend`` has one: simulated cards replayed through the allocator model, budgets at the
    reserved level (the allocated figure does not fall as the work grows); else ``None``."""
    look = getattr(backend, "look_past", None)
    if level is not BudgetLevel.RESERVED or look is None or getattr(backend, "reserved", None) is None:
        return None
    return lambda split, over: look(split, over, budgets)
