"""A certificate looked past its over points (``search.Known.look_past``).

At the reserved level a card's figure can be over at a chunk and within budget again a few
samples on (the caching allocator's cached-but-free blocks come and go), so "one more sample
is over" proves the answer only where the figure does not fall above the over point. Here a
synthetic surface (no torch work) hides such a fall: card 1's figure is its allocated one
plus 1 GiB of cached blocks from 420 to 439 samples, so 420 is over and 440 to 460 fit
again. A search started at 425 measures the over point, never the fall, and certifies 419
samples on card 1; brute force over every chunk says a larger batch fits. The look past is
brute force on the same surface, chunk by chunk up to where the allocated figure alone is
over (what :meth:`SimulatedBackend.look_past` does on the allocator model, tested against real
steps in ``tests/backends/simulated/test_look_past_sim.py``)."""

from __future__ import annotations

from typing import Optional, Sequence

from dptune import search
from dptune.backends.base import ProbeResult
from dptune.types import CardWindow, WindowCheck

GiB, MiB = 2**30, 2**20
BUDGET = 10 * GiB


def allocated(i: int, c: int, batch: int) -> int:
    if i > 0 and c == 0:
        return 0
    return GiB + (20 * MiB * c if i else 10 * MiB * c + MiB * batch)


def figure(i: int, c: int, batch: int, fall: bool) -> int:
    cached = GiB if fall and i == 1 and 420 <= c < 440 else 0
    return allocated(i, c, batch) + cached


def probe_of(fall: bool):  # type: ignore[no-untyped-def]
    def probe(split: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in split)
        peaks = tuple(figure(i, c, sum(s), fall) for i, c in enumerate(s))
        return ProbeResult(s, peaks, allocated_peak_bytes=tuple(
            allocated(i, c, sum(s)) for i, c in enumerate(s)))
    return probe


def brute_look(fall: bool):  # type: ignore[no-untyped-def]
    """Every chunk past each over point on the surface itself."""
    calls: list[tuple[tuple[int, ...], tuple[Optional[int], ...]]] = []

    def look(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1) -> WindowCheck:
        calls.append((tuple(split), tuple(over)))
        b = sum(split)
        out = []
        for i, start in enumerate(over):
            if start is None:
                continue
            c, fits = start, None
            while allocated(i, c, b + (c - split[i])) <= BUDGET:
                if figure(i, c, b + (c - split[i]), fall) <= BUDGET:
                    fits = c
                    break
                c += 1
            out.append(CardWindow(i, start, None if fits is not None else c, fits,
                                  batch_start=b + start - split[0] if i == 0 else None))
        return WindowCheck(tuple(out))
    look.calls = calls  # type: ignore[attr-defined]
    return look


def largest_batch(fall: bool) -> int:
    """Brute force: every chunk of card 1, card 0 given the most it can take."""
    best = 0
    for c1 in range(0, 470):
        if figure(1, c1, 0, fall) > BUDGET:
            continue
        c0 = max(c for c in range(0, 2000) if figure(0, c, c + c1, fall) <= BUDGET)
        best = max(best, c0 + c1)
    return best


def run(fall: bool, look=None):  # type: ignore[no-untyped-def]
    return search.run(probe_of(fall), [BUDGET, BUDGET], "max_batch", 500, compare_even=False,
                      first_split=[75, 425], max_probes=16, known=search.Known(look_past=look))


def test_the_search_alone_certifies_past_a_fall_it_never_met() -> None:
    out = run(fall=True)
    assert out.certified and out.not_monotone is None     # the hole the look past closes
    assert out.best.batch_size < largest_batch(fall=True)


def test_a_fall_past_the_over_point_withholds_the_certificate() -> None:
    look = brute_look(fall=True)
    out = run(fall=True, look=look)
    assert not out.certified
    assert out.window is not None and [w.card for w in out.window.falls] == [1]
    assert out.window.falls[0].fits == 440
    assert out.not_monotone is not None and "card 1 fits again at 440" in out.not_monotone
    assert any("not certified" in n for n in out.notes)
    split, over = look.calls[0]
    assert split == out.best.chunk_sizes and over[1] == out.best.chunk_sizes[1] + 1
    # what was measured is unchanged: the same answer as the search alone
    assert out.best.chunk_sizes == run(fall=True).best.chunk_sizes


def test_a_window_over_throughout_keeps_the_certificate_and_says_how_far() -> None:
    out = run(fall=False, look=brute_look(fall=False))
    assert out.certified and out.best.batch_size == largest_batch(fall=False)
    assert out.window is not None and out.window.closed
    note = next(n for n in out.notes if n.startswith("looked past the over points"))
    assert "card 1: " in note and "its allocated peak alone is over" in note
    assert "card 0 with the batch, the others at their caps" in note


def test_no_look_where_the_answer_is_not_certified() -> None:
    look = brute_look(fall=True)
    out = search.run(probe_of(True), [BUDGET, BUDGET], "max_batch", 500, compare_even=False,
                     first_split=[75, 425], max_probes=2, known=search.Known(look_past=look))
    assert not out.certified and out.window is None and look.calls == []
