"""A case of :mod:`benchmarks.certificate`: per-card peaks against budgets (the bottom of the
certificate benchmark: the cases and the benchmark both build on it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from dptune.backends.base import ProbeResult

GiB, MiB = 2**30, 2**20


@dataclass
class Surface:
    """One case: per-card peaks (bytes), budgets, and BatchNorm's minimum chunk."""

    name: str
    family: str
    budgets: list[int]
    f: Callable[[int, int], int]          # card i >= 1 at chunk c > 0
    g: Callable[[int, int], int]          # card 0 at chunk c0 in a batch B
    m: int = 1
    hint: int = 0                          # dptune's start batch (0: 64 per card)

    @property
    def n(self) -> int:
        return len(self.budgets)

    def peaks(self, split: Sequence[int]) -> list[int]:
        b = sum(split)
        return [self.g(split[0], b)] + [self.f(i, c) if c else 0 for i, c in enumerate(split) if i]

    def over(self, split: Sequence[int]) -> list[bool]:
        """Per card: measured over its budget (a card >= 1 with no samples: never)."""
        return [p > bud and (i == 0 or split[i] > 0)
                for i, (p, bud) in enumerate(zip(self.peaks(split), self.budgets))]

    def probe(self, split: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in split)
        return ProbeResult(s, tuple(self.peaks(s)))


def _valid(split: Sequence[int], m: int) -> bool:
    return sum(split) > 0 and all(c == 0 or c >= m for c in split)
