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
from typing import Any, Callable, NamedTuple, Optional, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig, AllocatorStats, Event
from dptune.backends.simulated.reserved import step_stats
from dptune.budget import BudgetLevel
from dptune.split import fill_within
from dptune.types import CardWindow, WindowCheck

__all__ = ["ScaledTraces", "Scan", "step_stats", "scan", "window_end", "chunks_for", "lines_of",
           "look_past", "look_past_of", "balance_map_of", "even_line_of", "agrees", "LOOK_EVENTS", "LOOK_MAX_CHUNKS"]

#: one card's replay traces (set-up, warm-up step, measured step), ids in order of first use
Traces = Sequence[Sequence[Event]]


@dataclass(frozen=True)
class ScaledTraces:
    """One card's replay traces (set-up, warm-up step, measured step; ids as
    :func:`canonical_traces` names them) at some chunk (:attr:`base`) and at ``span`` samples
    more (:attr:`far`), and what they replay in between and beyond: each malloc's size drawn
    on the line through the two (the traces hold each storage's own size, before the
    allocator's rounding). Where a card's work grows by a fixed amount per sample (the
    activations of a fixed-shape model) that is the real step exactly; :attr:`margin` (a
    512-byte block per malloc that grows) is what the end test allows a size that is not
    quite linear (a padded one). :meth:`of` is ``None`` where the two steps' mallocs and frees
    do not pair up, or a malloc shrinks."""

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
        """The traces with ``more`` samples more than :attr:`base`'s (each size rounded up to
        a byte)."""
        span = self.span
        return [[e if f.delta == e.delta else
                 Event(e.id, e.delta - (-(f.delta - e.delta) * more // span), e.stream)
                 for e, f in zip(x, y)] for x, y in zip(self.base, self.far)]

    def stats(self, more: int, config: AllocatorConfig) -> AllocatorStats:
        """The measured step's figures with ``more`` samples more (no memory limit)."""
        return step_stats(self.at(more), config)


class Scan(NamedTuple):
    """What one window's replays found, in steps past the window's base: ``end`` the first
    whose allocated peak alone is over (``None``: ``limit`` replays ran first), ``fits`` the
    first within budget and ``fits_bytes`` its figure, ``last_fits`` the last within budget
    before ``end`` (``None``: none)."""

    end: Optional[int]
    fits: Optional[int]
    fits_bytes: Optional[int]
    last_fits: Optional[int]
    replays: int


def scan(scaled: ScaledTraces, budget: int, nccl: int, config: AllocatorConfig,
         limit: int, top: Optional[int] = None) -> Scan:
    """From ``scaled``'s base, one sample at a time: the level's
    figure (reserved peak + ``nccl``) against ``budget``, until the allocated peak +
    ``nccl``, less the drawing's margin, is over (the sizes never shrink as the work grows,
    so the allocated peak never falls: from there every step is over) or ``limit`` replays
    ran. Every step within budget on the way is seen (``fits``: the first, ``last_fits``: the
    last).

    ``top``: the window's end (the first step whose allocated peak alone is over, further
    than ``limit``) where its base fits (an answer left open: the card within budget far
    below where it runs out). Then from the top down, one sample at a time, to the last step
    within budget (at most ``limit`` replays): every step above it is over, which is all the
    window's certificate and the next raise need (``fits`` is the base); where none fits
    within ``limit`` replays from the top, the scan from the base as above."""
    margin = scaled.margin
    if top is not None and top > limit:
        first = scaled.stats(0, config).reserved_peak + nccl
        if first <= budget:
            for j, k in enumerate(range(top - 1, 0, -1)):
                if j >= limit:
                    break
                if scaled.stats(k, config).reserved_peak + nccl <= budget:
                    return Scan(top, 0, first, k, j + 2)
    fits = fits_bytes = last = None
    for k in range(limit):
        s = scaled.stats(k, config)
        if s.allocated_peak + nccl - margin > budget:
            return Scan(k, fits, fits_bytes, last, k + 1)
        if s.reserved_peak + nccl <= budget:
            if fits is None:
                fits, fits_bytes = k, s.reserved_peak + nccl
            last = k
    return Scan(None, fits, fits_bytes, last, limit)


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


@dataclass(frozen=True)
class _Line:
    """One window: card ``card``'s figure as ``mover``'s chunk grows one sample a step from
    ``base`` (the split at the window's first step). ``label``: the window's first chunk of
    ``card`` (its first batch where ``no_samples``); ``length``: how many steps the window has
    before something else settles the rest (``None``: until the allocated peak alone is over)."""

    card: int
    base: tuple[int, ...]
    mover: int
    label: int
    no_samples: bool = False
    length: Optional[int] = None

    def at(self, k: int) -> tuple[int, ...]:
        return tuple(c + k * (i == self.mover) for i, c in enumerate(self.base))

    def window(self, found: Optional[Scan]) -> CardWindow:
        """The card's window from what its scan found (``None``: not looked at)."""
        batch0 = sum(self.base) if self.card == 0 and not self.no_samples else None
        if found is None:
            return CardWindow(self.card, self.label, None, scaled=False, batch_start=batch0,
                              no_samples=self.no_samples)

        def at(k: Optional[int]) -> Optional[int]:
            return None if k is None else self.label + k
        return CardWindow(self.card, self.label, at(found.end), at(found.fits), found.fits_bytes,
                          batch_start=batch0, no_samples=self.no_samples,
                          last_fits=at(found.last_fits))


def lines_of(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1
             ) -> list[_Line]:
    """The windows a certificate rests on (:meth:`MaxBatch.infeasible`'s claim, one more
    sample than the answer ``split``): each card ``i >= 1`` over at every chunk from
    ``over[i]`` (the others as in the answer; its figure depends on its own chunk only); and
    card 0 (``over[0]`` not ``None``) over at the least it can take of every larger batch,
    the others at their caps ``over[i] - 1``: at no samples while the others' caps hold the
    batch (the batch growing on a card below its cap, or on one without a cap), then one more
    sample a step along with the batch (its chunk at least ``min_chunk``)."""
    base = [int(c) for c in split]
    others = [_Line(i, tuple(base[:i] + [int(o)] + base[i + 1:]), i, int(o))
              for i, o in enumerate(over) if i and o is not None]
    return (_card0_lines(base, over, min_chunk) if over[0] is not None else []) + others


def _card0_lines(base: list[int], over: Sequence[Optional[int]], min_chunk: int) -> list[_Line]:
    """Card 0's windows past the answer ``base`` (:func:`lines_of`)."""
    n, batch = len(base), sum(base) + 1
    if n == 1:
        return [_Line(0, (batch,), 0, batch)]
    caps = [None if o is None else int(o) - 1 for o in over[1:]]
    room = None if None in caps else sum(c for c in caps if c is not None)
    if room is not None and batch > room:             # card 0 takes samples at once
        c0 = max(batch - room, min_chunk)
        return [_Line(0, (c0, *(c for c in caps if c is not None)), 0, c0)]
    # card 0 with no samples: the batch grows on a card without a cap, else on one below it
    free = next((i for i in range(1, n) if caps[i - 1] is None), None)
    mover = free if free is not None else max(range(1, n), key=lambda i: (caps[i - 1] or 0) - base[i])
    # a split of ``batch`` within the caps, the mover's first
    rest, _ = fill_within(base[1:], batch - sum(base[1:]), caps,
                          sorted(range(n - 1), key=lambda i: i != mover - 1))
    out = [_Line(0, (0, *rest), mover, batch, no_samples=True,
                 length=None if room is None else room - batch + 1)]
    if room is not None:                                # past the caps' room: samples on card 0
        c0 = max(1, min_chunk)
        out.append(_Line(0, (c0, *(c for c in caps if c is not None)), 0, c0))
    return out


#: events a card's look may replay in all: a short step (a few layers) is looked at over more
#: chunks than ``limit`` (the benchmarks' MLP: card 0's window is 15,982 chunks)
LOOK_EVENTS = 8_000_000
#: the most chunks a card's look replays, however short its step
LOOK_MAX_CHUNKS = 65_536
#: how far a window whose base fits is drawn (its end found by halving on the allocated peak)
LOOK_FAR = 1 << 30


def chunks_for(scaled: ScaledTraces, limit: int) -> int:
    """How many chunks a card's look may replay: ``limit``, or as many as
    :data:`LOOK_EVENTS` events allow (at most :data:`LOOK_MAX_CHUNKS`)."""
    events = max(1, sum(len(t) for t in scaled.base))
    return min(LOOK_MAX_CHUNKS, max(limit, LOOK_EVENTS // events))


def look_past(traces_of: Callable[[Sequence[int]], Sequence[Traces]], split: Sequence[int],
              over: Sequence[Optional[int]], budgets: Sequence[int], config: AllocatorConfig,
              nccl: int, limit: int, min_chunk: int = 1) -> WindowCheck:
    """Past a largest-batch certificate's over points (the reserved level: the reserved peak
    + ``nccl`` against ``budgets``), along the windows the certificate rests on
    (:func:`lines_of`), each until the card's allocated peak alone passes its budget.
    ``traces_of(split)``: every card's replay traces of one real simulated step.

    Each step of a window is replayed from the card's traces at the window's first step and
    at its far end, each malloc drawn on the line through the two (:class:`ScaledTraces`),
    the drawing checked against a real step one sample on (the same mallocs, the same
    figures; a window whose step there differs is not looked at: ``scaled`` false); a step
    found to fit is simulated for real before it is reported. A few simulated steps a window
    (the cards ``i >= 1`` share theirs) and a replay per step: at most ``limit`` steps a
    window, more where the card's steps are short (:func:`chunks_for`)."""
    lines = lines_of(split, over, min_chunk)
    simulated: dict[tuple[int, ...], Sequence[Traces]] = {}

    def steps(more: dict[int, int]) -> dict[int, Traces]:
        """Real traces of each window's card ``k`` steps on (``more``: window -> k). The
        cards ``i >= 1`` move together in one simulated step (each card's figure depends on
        its own chunk only); card 0's windows one step each."""
        out: dict[int, Traces] = {}
        together = [w for w in more if lines[w].card]
        if together:
            s = list(lines[together[0]].base)
            for w in together:
                s[lines[w].mover] = lines[w].label + more[w]
            key = tuple(s)
            if key not in simulated:
                simulated[key] = traces_of(key)
            out.update({w: simulated[key][lines[w].card] for w in together})
        for w in more:
            if not lines[w].card:
                key = lines[w].at(more[w])
                if key not in simulated:
                    simulated[key] = traces_of(key)
                out[w] = simulated[key][0]
        return out

    every = range(len(lines))
    at = steps({w: 0 for w in every})
    plus = steps({w: 1 for w in every})
    near = {w: sc for w in every if (sc := ScaledTraces.of(at[w], plus[w], 1)) is not None}
    reach = {w: min(chunks_for(sc, limit), lines[w].length or LOOK_MAX_CHUNKS)
             for w, sc in near.items()}
    # a window whose base fits (an answer left open) is drawn to its end however far, and
    # looked at from the top down (:func:`scan`'s ``top``)
    top = {w: min(LOOK_FAR, lines[w].length or LOOK_FAR) for w, sc in near.items()
           if sc.stats(0, config).reserved_peak + nccl <= budgets[lines[w].card]}
    far = {w: max(1, window_end(sc, budgets[lines[w].card] + sc.margin, nccl, config, top[w])
                  if w in top else window_end(sc, budgets[lines[w].card], nccl, config, reach[w]))
           for w, sc in near.items()}
    ends = steps(far)
    found: dict[int, Scan] = {}
    done: dict[tuple, Scan] = {}
    replays = 0
    for w, k in far.items():
        sc = ScaledTraces.of(at[w], ends[w], k)
        if sc is None or not agrees(sc, plus[w], config):
            continue                  # the drawing misses a real step: not looked at
        budget = budgets[lines[w].card]
        high = far[w] if w in top and far[w] > reach[w] and _over_at(sc, far[w], budget, nccl, config) \
            else None
        key = (sc, budget, reach[w], high)
        if key not in done:
            done[key] = scan(sc, budget, nccl, config, reach[w], high)
            replays += done[key].replays
        found[w] = done[key]
        if found[w].end is None and lines[w].length is not None and reach[w] == lines[w].length:
            found[w] = found[w]._replace(end=lines[w].length)   # the window's own length
    # the steps the drawing says fit are simulated for real before they are reported
    for pick in ("fits", "last_fits"):
        chosen = {w: getattr(r, pick) for w, r in found.items() if getattr(r, pick) is not None}
        for w, traces in steps(chosen).items():
            if w in found and step_stats(traces, config).reserved_peak + nccl > budgets[lines[w].card]:
                del found[w]           # the drawing was wrong there: not looked at
    return WindowCheck(tuple(lines[w].window(found.get(w)) for w in every), replays)


def _over_at(scaled: ScaledTraces, k: int, budget: int, nccl: int, config: AllocatorConfig) -> bool:
    """The allocated peak + ``nccl``, less the drawing's margin, over ``budget`` ``k`` samples
    on (every step from there is over: the allocated peak never falls as the work grows)."""
    return scaled.stats(k, config).allocated_peak + nccl - scaled.margin > budget


def agrees(scaled: ScaledTraces, real: Traces, config: AllocatorConfig) -> bool:
    """The real step one sample past the base is the drawn one: the same mallocs (sizes
    that grow linearly are drawn exactly), hence the same figures."""
    drawn = scaled.at(1)
    if any(e.delta != f.delta for x, y in zip(drawn, real) for e, f in zip(x, y) if e.delta > 0):
        return False
    want, got = step_stats(drawn, config), step_stats(real, config)
    return (want.reserved_peak, want.allocated_peak) == (got.reserved_peak, got.allocated_peak)


def look_past_of(backend: Any, budgets: Sequence[int], level: BudgetLevel
                 ) -> Optional[Callable[..., WindowCheck]]:
    """The search's look past a certificate's over points (``search.Known.look_past``) where
    ``backend`` has one: simulated cards replayed through the allocator model, budgets at the
    reserved level (the allocated figure does not fall as the work grows); else ``None``."""
    look = _on_the_model(backend, level, "look_past")
    if look is None:
        return None
    return lambda split, over, min_chunk=1: look(split, over, budgets, min_chunk)


def balance_map_of(backend: Any, budgets: Sequence[int], level: BudgetLevel
                   ) -> Optional[Callable[..., Any]]:
    """The balance search's map on the model (``search.Known.balance_map``:
    ``map(split, share, min_chunk=m, alike=keys)``) where ``backend`` has one, budgets at the
    reserved level, as :func:`look_past_of`; else ``None``."""
    make = _on_the_model(backend, level, "balance_map")
    if make is None:
        return None
    return lambda split, share, min_chunk=1, alike=None: make(split, share, budgets, min_chunk, alike)


def even_line_of(backend: Any, budgets: Sequence[int], level: BudgetLevel
                 ) -> Optional[Callable[..., Any]]:
    """The largest-batch search's even line on the model (``search.Known.even_line``:
    ``line(lo, min_chunk=m, upto=b)``) where ``backend`` has one, budgets at the reserved level, as
    :func:`look_past_of`; else ``None``."""
    line = _on_the_model(backend, level, "even_line")
    if line is None:
        return None
    return lambda lo, min_chunk=1, upto=None: line(lo, budgets, min_chunk, upto)


def _on_the_model(backend: Any, level: BudgetLevel, name: str) -> Optional[Callable[..., Any]]:
    """``backend``'s method ``name`` where it replays an allocator model (``reserved``) and
    the budgets are at the reserved level (the allocated figure does not fall as the work
    grows); else ``None``."""
    method = getattr(backend, name, None)
    if level is not BudgetLevel.RESERVED or method is None or getattr(backend, "reserved", None) is None:
        return None
    return method
