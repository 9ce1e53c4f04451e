"""The balance solved exactly on a map of every chunk each card can take.

Given, per card, the share of its budget at every chunk it may take (a dict chunk -> share;
a chunk absent is not allowed), :func:`least_largest_share` finds the split of ``batch`` whose
largest share is least: the least share ``L`` at which the chunks each card holds at or below
``L`` can add up to the batch (their sumset, a bitset), by bisection over the shares the map
holds, and one split that reaches it. Cards in ``groups`` (alike cards) are given chunks
within one sample of each other where a split at that least share allows it. Nothing here
assumes a card's figure grows with its chunk.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Optional, Sequence

__all__ = ["Solved", "least_largest_share"]


class Solved(NamedTuple):
    """The least largest share a split reaches (``level``) and a split that reaches it;
    ``alike``: the alike cards are within one sample of each other in it (the least share of
    such splits); ``least``: the least largest share of any split (``level`` where the alike
    cards need not be kept together to reach it)."""

    split: tuple[int, ...]
    level: float
    alike: bool
    least: float


def _units(shares: Sequence[Mapping[int, float]], groups: Sequence[Sequence[int]], level: float,
           together: bool) -> list[tuple[list[int], dict[int, tuple[int, ...]]]]:
    """Per unit (a card, or a group of alike cards taken together): its cards and, for each
    total it can take at ``level``, the chunks of its cards."""
    grouped = {i for g in groups for i in g} if together else set()
    units: list[tuple[list[int], dict[int, tuple[int, ...]]]] = []
    for i, sh in enumerate(shares):
        if i not in grouped:
            units.append(([i], {c: (c,) for c, s in sh.items() if s <= level}))
    for g in (groups if together else ()):
        g = sorted(g)
        ok = {c for c, s in shares[g[0]].items() if s <= level and
              all(shares[k].get(c, level + 1) <= level for k in g)}
        totals: dict[int, tuple[int, ...]] = {}
        for c in ok:
            for j in range(len(g)):         # j of the cards take c + 1
                if j and c + 1 not in ok:
                    break
                totals.setdefault(c * len(g) + j, tuple([c + 1] * j + [c] * (len(g) - j)))
        units.append((g, totals))
    return units


def _solve(units: list[tuple[list[int], dict[int, tuple[int, ...]]]], batch: int, n: int,
           prefer: Optional[Sequence[int]] = None) -> Optional[tuple[int, ...]]:
    """A split of ``batch`` taking one total of each unit; ``None``: none. Each unit takes,
    of the totals that still complete the batch, the one nearest its cards' chunks in
    ``prefer`` (the last unit first; the smallest without ``prefer``)."""
    mask = (1 << (batch + 1)) - 1
    reach = [1]
    for _, totals in units:
        acc = 0
        prev = reach[-1]
        for t in totals:
            if t <= batch:
                acc |= prev << t
        reach.append(acc & mask)
    if not (reach[-1] >> batch) & 1:
        return None
    split = [0] * n
    left = batch
    for u in range(len(units) - 1, -1, -1):
        cards, totals = units[u]
        want = 0 if prefer is None else sum(prefer[k] for k in cards)
        t = min((t for t in totals if t <= left and (reach[u] >> (left - t)) & 1),
                key=lambda t: (abs(t - want), t))
        for k, c in zip(cards, totals[t]):
            split[k] = c
        left -= t
    return tuple(split)


def _least(shares: Sequence[Mapping[int, float]], batch: int, groups: Sequence[Sequence[int]],
           levels: Sequence[float], together: bool, prefer: Optional[Sequence[int]] = None
           ) -> Optional[tuple[tuple[int, ...], float]]:
    """The least of ``levels`` at which a split exists (alike cards kept ``together`` or
    not), by bisection (a split at a level is one at every higher level), and that split."""
    n = len(shares)
    top = _solve(_units(shares, groups, levels[-1], together), batch, n, prefer) if levels else None
    if top is None:
        return None
    lo, hi, split = 0, len(levels) - 1, top
    while lo < hi:
        mid = (lo + hi) // 2
        s = _solve(_units(shares, groups, levels[mid], together), batch, n, prefer)
        if s is not None:
            hi, split = mid, s
        else:
            lo = mid + 1
    return split, levels[lo]


def least_largest_share(shares: Sequence[Mapping[int, float]], batch: int,
                        groups: Sequence[Sequence[int]] = (),
                        prefer: Optional[Sequence[int]] = None) -> Optional[Solved]:
    """See the module: the least largest share of the splits that keep the alike cards of
    ``groups`` within one sample of each other where any such split exists, else of any
    split (:attr:`Solved.least` either way). ``None`` where no split of ``batch`` takes
    allowed chunks only. ``prefer``: a split the one returned keeps near, card by card,
    among those at that share (ties broken toward it)."""
    levels = sorted({s for sh in shares for s in sh.values()})
    free = _least(shares, batch, groups, levels, False, prefer)
    if free is None:
        return None
    split, least = free
    together = _least(shares, batch, groups, [v for v in levels if v >= least], True, prefer) \
        if groups else None
    if together is not None:
        return Solved(together[0], together[1], True, least)
    return Solved(split, least, not groups, least)
