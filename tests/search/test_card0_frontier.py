"""The largest batch where card 0, holding no samples, is the limit (the outputs of the whole
batch gathered onto it) and its figure rises in fine steps as the batch grows.

The 64-card MLP of the issue: card 0 with no samples fills with the gathered outputs while
the other cards sit at 41% of theirs; its reserved figure rises by two 2 MiB segments every
524 samples of the batch, the probes found a flat step above the budget and walked down it a
few samples a probe, and the search ended uncertified at the probe cap. Where the look past
the answer (on the allocator model) has raised the other cards and card 0 alone is then over
with no samples on it, card 0's own window (no samples, the batch growing on the others)
gives the last batch it fits: that split is probed, and looked past in turn. Here a synthetic
surface stands in for the model (no torch work); the answer is checked against brute force
on the surface itself."""

from __future__ import annotations

from typing import Optional, Sequence

import pytest

from dptune import search
from dptune.backends.base import ProbeResult
from dptune.backends.simulated.look import Scan, lines_of
from dptune.split import spread_within
from dptune.types import WindowCheck

GiB, MiB = 2**30, 2**20
BUDGET = 10 * GiB
SEGMENT = 2 * MiB
N = 4


def allocated(i: int, c: int, batch: int) -> int:
    if i:
        return GiB + 5 * 1024 * c if c else 0
    return GiB + 10 * MiB * c + 2 * 4000 * batch          # outputs and their gradient


def figure(i: int, c: int, batch: int) -> int:
    """The reserved figure: card 0's two batch-sized tensors each rounded up to whole 2 MiB
    segments (a step of 4 MiB every 524 samples of the batch); the others as allocated."""
    if i:
        return allocated(i, c, batch)
    return GiB + 10 * MiB * c + 2 * -(-4000 * batch // SEGMENT) * SEGMENT


def probe(split: Sequence[int]) -> ProbeResult:
    s = tuple(int(c) for c in split)
    b = sum(s)
    return ProbeResult(s, tuple(figure(i, c, b) for i, c in enumerate(s)),
                       allocated_peak_bytes=tuple(allocated(i, c, b) for i, c in enumerate(s)))


def look(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1) -> WindowCheck:
    """Brute force on the surface along the windows a certificate rests on (``lines_of``),
    each until the card's allocated figure alone is over: card 0 step by step; the others,
    whose figure is their allocated one, in closed form."""
    out = []
    for ln in lines_of(split, over, min_chunk):
        first = last = None
        if ln.card:
            c0 = ln.base[ln.card]
            cap = (BUDGET - GiB) // (5 * 1024)              # the last chunk within budget
            end = max(0, cap - c0 + 1)
            first, last = (0, end - 1) if end else (None, None)
        else:
            k = 0
            while ln.length is None or k < ln.length:
                s = ln.at(k)
                if allocated(0, s[0], sum(s)) > BUDGET:
                    break
                if figure(0, s[0], sum(s)) <= BUDGET:
                    first = k if first is None else first
                    last = k
                k += 1
            end = k
        out.append(ln.window(Scan(end, first, None, last, 0)))
    return WindowCheck(tuple(out))


def largest_batch() -> int:
    """Brute force: card 0 with no samples at the largest batch it fits (the others hold any
    batch up to far past it; card 0 with samples only holds more)."""
    b = (BUDGET - GiB) // 8000
    while figure(0, 0, b) > BUDGET:
        b -= 1
    assert all(figure(0, 0, x) > BUDGET for x in range(b + 1, b + 5000))
    return b


@pytest.mark.parametrize("start", [64, 4096, 100_000])
def test_card_0s_whole_batch_limit_found_and_certified_on_the_model(start: int) -> None:
    out = search.run(probe, [BUDGET] * N, "max_batch", start, compare_even=False,
                     known=search.Known(look_past=look))
    assert out.certified, out.notes
    assert out.best.batch_size == largest_batch()
    assert out.best.chunk_sizes[0] == 0
    assert max(out.best.chunk_sizes[1:]) - min(out.best.chunk_sizes[1:]) <= 1   # alike cards
    assert all(p <= BUDGET for p in out.best.peak_bytes) and len(out.probes) <= 12


def test_spread_within_against_brute_force() -> None:
    """Water-filling: the same total, every card within its cap, and no card below another
    by more than one sample unless it is at its cap; ``None`` only where the caps are short."""
    import itertools
    for chunks in itertools.product(range(3), repeat=3):
        for caps in itertools.product(range(5), repeat=3):
            for more in range(7):
                got = spread_within(sum(chunks) + more, caps)
                total = sum(chunks) + more
                if total > sum(caps):
                    assert got is None
                    continue
                assert got is not None and sum(got) == total
                assert all(0 <= g <= c for g, c in zip(got, caps))
                top = max(got)
                assert all(g >= top - 1 or g == c for g, c in zip(got, caps))
