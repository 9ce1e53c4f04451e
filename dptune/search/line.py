"""Card 0 along the whole batch: with the other cards at most at chunks ``t``, the fewest
samples card 0 can take of a batch (BatchNorm: no chunk of 1), and the batches at which that
crosses a chunk measured on card 0. The largest-batch search keeps card 0's cap as a bracket on
the batch along such a line (:mod:`dptune.search.max_batch`)."""

from __future__ import annotations

from typing import Callable, Optional

from dptune.search.loop import fill
from dptune.solve.memory import bisect_last

__all__ = ["BatchLine", "largest_true", "last_within", "first_over"]


def largest_true(pred: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest ``x`` in ``[lo, hi]`` with ``pred(x)`` (``pred`` true then false); ``lo - 1``
    when none."""
    if hi < lo or not pred(lo):
        return lo - 1
    return bisect_last(pred, lo, hi)


def last_within(line: "BatchLine", chunk: int, batch: int) -> int:
    """The largest batch up to ``batch`` at which the line leaves card 0 at most ``chunk``."""
    def ok(b: int) -> bool:
        c0 = line.c0(b)
        return c0 is not None and c0 <= chunk
    return largest_true(ok, 0, batch)


def first_over(line: "BatchLine", chunk: int, batch: int) -> int:
    """The smallest batch from ``batch`` at which the line leaves card 0 at least ``chunk``."""
    def below(b: int) -> bool:
        c0 = line.c0(b)
        return c0 is not None and c0 < chunk
    return largest_true(below, batch, batch + line.total + chunk + 1) + 1


class BatchLine:
    """Card 0 along the batch, with the other cards at most at chunks ``t``."""

    def __init__(self, t: list[int], m: int):
        self.t, self.m, self.total = t, m, sum(t)
        reach = [(0, 0)]
        for c in t:
            if c < m:
                continue
            new = sorted(reach + [(a + m, b + c) for a, b in reach])
            merged: list[tuple[int, int]] = []
            for a, b in new:
                if merged and a <= merged[-1][1] + 1:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            reach = merged
        self.reach = reach

    def c0(self, batch: int) -> Optional[int]:
        """The fewest samples card 0 can take of ``batch`` (None: no split)."""
        c = max(0, batch - self.total)
        while c <= batch:
            if (c == 0 or c >= self.m) and any(a <= batch - c <= b for a, b in self.reach):
                return c
            c += 1
        return None

    def split(self, batch: int) -> Optional[tuple[int, ...]]:
        c0 = self.c0(batch)
        if c0 is None:
            return None
        rest = fill(batch - c0, self.t, self.m)
        return None if rest is None else (c0, *rest)
