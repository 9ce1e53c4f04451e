"""The balance's map on the allocator model: every card's figure at every chunk it can take.

At the reserved level a card's figure (the caching allocator's reserved peak plus NCCL's
buffers) can fall as its chunk grows, so the balance's certificate ("each card at or above
the largest share from its first chunk measured there") proves nothing where the probes met a
fall. On simulated cards every chunk costs a replay of the allocator, not a probe:
:func:`balance_map` draws each card's figure at every chunk of the batch's split that could
hold every card at or below a share ``level`` (the largest share of a split measured within
budget), and bounds the rest:

- above: a card's allocated peak never falls as its work grows, and the reserved one never
  goes below it; from the first chunk whose allocated peak alone is over ``level`` of its
  budget (``hi``), every chunk is over;
- below: the other cards can take at most their last chunk at or below ``level`` (their
  ``cap``, found on the way up), so a card takes at least the batch less the others' caps
  (``lo``).

Each card's steps are drawn between two simulated ones (:class:`~dptune.backends.simulated.
look.ScaledTraces`, checked against a third, as the look past a largest batch's over points
draws them). Card 0's figure depends on its chunk and the batch (not on how the others share
the rest), a card ``i >= 1``'s on its own chunk; alike cards (the same budget and memory held,
as the caller names them) are drawn once. The search solves the map exactly
(:func:`dptune.solve.discrete.least_largest_share`) and probes the split it finds.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig
from dptune.backends.simulated.look import (LOOK_MAX_CHUNKS, ScaledTraces, Traces, agrees, step_stats,
                                            window_end)
from dptune.types import BalanceMap, CardCurve

__all__ = ["balance_map", "MAP_MAX_CHUNKS", "MAP_EVENTS"]

#: the most chunks a map may replay in all (every card's, alike cards once); a batch whose
#: cards could take wider ranges is not mapped
MAP_MAX_CHUNKS = LOOK_MAX_CHUNKS
#: the most allocator events a map may replay in all (about 2 µs each on this project's CI
#: machine: two minutes); fewer chunks where a step has many
MAP_EVENTS = 64_000_000


def _drawn(at: Callable[[int], Traces], lo: int, hi: int, config: AllocatorConfig,
           nccl: int) -> Optional[list[int]]:
    """The figure (reserved peak + ``nccl``) at every chunk from ``lo`` to ``hi`` (``at(c)``:
    the card's traces of a simulated step at chunk ``c``), drawn between the steps at ``lo``
    and ``hi`` and checked against the one at ``lo + 1``; ``None`` where the drawing misses
    it."""
    if hi <= lo:
        return [step_stats(at(lo), config).reserved_peak + nccl]
    sc = ScaledTraces.of(at(lo), at(hi), hi - lo)
    if sc is None or not agrees(sc, at(lo + 1), config):
        return None
    return [sc.stats(k, config).reserved_peak + nccl for k in range(hi - lo + 1)]


def _first_over(at: Callable[[int], Traces], start: int, top: int, limit: int,
                config: AllocatorConfig, nccl: int) -> int:
    """The first chunk from ``start`` (at most ``top + 1``) whose allocated peak + ``nccl``,
    less the drawing's margin, is over ``limit`` bytes, on the steps drawn from ``start`` and
    ``start + 1`` extended (:func:`~dptune.backends.simulated.look.window_end`)."""
    near = ScaledTraces.of(at(start), at(start + 1), 1) if start + 1 <= top else None
    if near is None:
        return top + 1
    return start + window_end(near, limit + near.margin, nccl, config, top + 1 - start)


class _Steps:
    """The simulated steps a map draws from: one card's traces at a chunk of the batch."""

    def __init__(self, traces_of: Callable[[Sequence[int]], Sequence[Traces]], n: int,
                 batch: int, m: int):
        self.traces_of, self.n, self.batch, self.m = traces_of, n, batch, m
        self.simulated: dict[tuple[int, ...], Sequence[Traces]] = {}

    def of(self, i: int) -> Callable[[int], Traces]:
        def at(c: int) -> Traces:
            # card 0 at chunk c of the batch, card 1 holding the rest; a card i >= 1 alone
            # (with no samples: card 0 at its least chunk, the card's own figure alone read)
            n = self.n
            s = ((c, self.batch - c) + (0,) * (n - 2)) if i == 0 else \
                tuple(c if k == i else self.m * (k == 0 and c == 0) for k in range(n))
            if s not in self.simulated:
                self.simulated[s] = self.traces_of(s)
            return self.simulated[s][i]
        return at


def balance_map(traces_of: Callable[[Sequence[int]], Sequence[Traces]], split: Sequence[int],
                budgets: Sequence[int], level: float, config: AllocatorConfig, nccl: int,
                min_chunk: int = 1, alike: Optional[Sequence[Hashable]] = None,
                max_chunks: int = MAP_MAX_CHUNKS) -> Optional[BalanceMap]:
    """The map of ``split``'s batch below ``level`` (see the module): ``split`` a split
    measured within budget whose largest share is ``level``; ``traces_of(split)`` every card's
    replay traces of one simulated step; ``alike``: one key per card, cards ``i >= 1`` with
    equal keys drawn once. ``None`` where a card's steps cannot be drawn (its mallocs do not
    scale with the samples), or the ranges need more than ``max_chunks`` replays (fewer where
    a step has many events: :data:`MAP_EVENTS` in all)."""
    n, batch, m = len(split), sum(split), max(1, min_chunk)
    if n < 2 or any(b <= 0 for b in budgets):
        return None
    keys = list(alike) if alike is not None else list(range(n))

    def card_of(i: int) -> int:
        """The card drawn for card ``i``: itself, or the first alike card."""
        return next(k for k in range(1, n) if keys[k] == keys[i] and budgets[k] == budgets[i]) \
            if i else 0
    if max(split[0], m) > batch - m:
        return None                     # card 0's window cannot be drawn: no room above it
    steps = _Steps(traces_of, n, batch, m)
    drawn = sorted({card_of(i) for i in range(n)})
    events = max(sum(len(t) for t in steps.of(i)(max(split[i], m))) for i in drawn)
    max_chunks = min(max_chunks, MAP_EVENTS // max(1, events))
    up = {}
    replays = 0
    for i in drawn:
        u = _up(steps.of(i), max(split[i], m), batch - m if i == 0 else batch, i > 0,
                _at_most(level, budgets[i]), config, nccl, max_chunks - replays)
        if u is None:
            return None
        up[i] = u
        replays += len(u[1])
    # each card's cap: its last chunk at or below the level (every chunk above it is over)
    cap = {i: max((start + k for k, f in enumerate(figs) if f / budgets[i] <= level),
                  default=start - 1) for i, (start, figs) in up.items()}
    # down: from the least chunk the others' caps leave each card to the split's chunk
    made: dict[tuple[int, int], CardCurve] = {}
    curves = []
    for i in range(n):
        d = card_of(i)
        lo = max(0, batch - sum(cap[card_of(k)] for k in range(n) if k != i))
        if (d, lo) not in made:
            start, figs = up[d]
            base = max(lo, m)
            if base < start:
                down = _drawn(steps.of(d), base, start, config, nccl) \
                    if replays + start - base <= max_chunks else None
                if down is None:
                    return None
                replays += len(down)
                start, figs = base, tuple(down[:-1]) + figs
            zero = None if lo else step_stats(steps.of(d)(0), config).reserved_peak + nccl
            made[d, lo] = CardCurve(d, start, figs, zero)
        curves.append(dataclasses.replace(made[d, lo], card=i))
    return BalanceMap(batch, level, tuple(curves), replays)


def _at_most(share: float, budget: int) -> int:
    """The most bytes at or below ``share`` of ``budget`` (``x / budget <= share``, as the
    search compares shares; exact where ``share * budget`` rounds one short)."""
    x = int(share * budget)
    while (x + 1) / budget <= share:
        x += 1
    while x > 0 and x / budget > share:
        x -= 1
    return x


def _up(at: Callable[[int], Traces], start: int, top: int, ends: bool, limit: int,
        config: AllocatorConfig, nccl: int, max_chunks: int
        ) -> Optional[tuple[int, tuple[int, ...]]]:
    """One card's figures from ``start`` (its chunk in the split) to the chunk before the
    first whose allocated peak alone is over ``limit``, at most ``top``: ``(start,
    figures)``. ``ends``: no chunk past ``top`` is possible (a card ``i >= 1`` at the whole
    batch); else (card 0, ``top`` the batch less card 1's least chunk: card 0 with the whole
    batch is not drawn) ``None`` where no chunk up to ``top`` is over. ``None`` too where
    that is more than ``max_chunks`` chunks on, or the steps cannot be drawn."""
    hi = _first_over(at, start, top, limit, config, nccl)
    if (hi > top and not ends) or hi - start > max_chunks:
        return None
    drawn = _drawn(at, start, max(start, hi - 1), config, nccl)
    return None if drawn is None else (start, tuple(drawn))
