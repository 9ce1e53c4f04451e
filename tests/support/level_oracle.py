"""An exhaustive largest-batch oracle that assumes nothing of the surface (not monotone, not
affine): the budget level's figures may be a staircase, or fall where a larger step packs the
allocator's blocks better. Used on small cases (a few cards, batches of hundreds).

For each card ``i >= 1`` every chunk from 0 to ``upto`` is tried (the set of chunks within its
budget, which need not be an interval); the sums the cards ``i >= 1`` can take together are
their sumset (a bitset, built once); a batch ``B`` fits when some ``c0`` puts card 0 within
its budget at ``(c0, B)`` with ``B - c0`` in that sumset. The largest batch up to ``upto`` that
fits is the answer. Nothing here comes from dptune's search.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

__all__ = ["largest_batch", "fits_some_split"]


def _chunks(f: Callable[[int], int], budget: int, upto: int, m: int) -> list[int]:
    return [c for c in range(upto + 1)
            if c == 0 or (c >= m and f(c) <= budget)]


def _sumset(sets: Sequence[Sequence[int]], upto: int) -> int:
    reach = 1                       # bit s: the cards so far can take s samples in all
    mask = (1 << (upto + 1)) - 1
    for chunks in sets:
        acc = 0
        for c in chunks:
            acc |= reach << c
        reach = acc & mask
    return reach


def fits_some_split(f: Callable[[int, int], int], g: Callable[[int, int], int],
                    budgets: Sequence[int], batch: int, m: int = 1, upto: Optional[int] = None
                    ) -> bool:
    """Some split of ``batch`` puts every card within its budget (every split tried, through
    the sumset of the cards' fitting chunks)."""
    top = batch if upto is None else upto
    sets = [_chunks(lambda c, i=i: f(i, c), budgets[i], top, m) for i in range(1, len(budgets))]
    reach = _sumset(sets, top)
    return any((c0 == 0 or c0 >= m) and (reach >> (batch - c0)) & 1 and g(c0, batch) <= budgets[0]
               for c0 in range(batch + 1))


def largest_batch(f: Callable[[int, int], int], g: Callable[[int, int], int],
                  budgets: Sequence[int], upto: int, m: int = 1) -> int:
    """The largest batch up to ``upto`` that some split fits (0: none)."""
    sets = [_chunks(lambda c, i=i: f(i, c), budgets[i], upto, m) for i in range(1, len(budgets))]
    reach = _sumset(sets, upto)
    for b in range(upto, 0, -1):
        if any((c0 == 0 or c0 >= m) and (reach >> (b - c0)) & 1 and g(c0, b) <= budgets[0]
               for c0 in range(b + 1)):
            return b
    return 0
