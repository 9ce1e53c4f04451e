"""A certificate looked past its over points (``search.Known.look_past``).

At the reserved level a card's figure can be over at a chunk and within budget again a few
samples on (the caching allocator's cached-but-free blocks come and go), so "one more sample
is over" proves the answer only where the figure does not fall above the over point. Here a
synthetic surface (no torch work) hides such a fall: card 1's figure is its allocated one
plus 1 GiB of cached blocks from 420 to 439 samples, so 420 is over and 440 to 460 fit
again. A search started at 425 measures the over point, never the fall, and certifies 419
samples on card 1; brute force over every chunk says a larger batch fits. With the look the
search goes past the fall (:mod:`dptune.search.past_falls`) to brute force's answer. The
look past is brute force on the same surface, chunk by chunk up to where the allocated figure
alone is over (what :meth:`SimulatedBackend.look_past` does on the allocator model, tested against real
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
    """Every step past each over point on the surface itself: card 1 from its over point (card
    0 as in the answer), card 0 at the least it can take of each larger batch (card 1 at its
    cap, one below its over point), each until its allocated figure alone is over."""
    calls: list[tuple[tuple[int, ...], tuple[Optional[int], ...]]] = []

    def window(card: int, start: int, at) -> CardWindow:  # type: ignore[no-untyped-def]
        x, first, last = start, None, None
        while allocated(card, *at(x)) <= BUDGET:
            if figure(card, *at(x), fall) <= BUDGET:
                first = x if first is None else first
                last = x
            x += 1
        return CardWindow(card, start, x, first, last_fits=last)

    def look(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1) -> WindowCheck:
        calls.append((tuple(split), tuple(over)))
        b, cap = sum(split), int(over[1] or 0) - 1
        c0 = b + 1 - cap
        card0 = window(0, c0, lambda x: (x, x + cap))
        card0 = CardWindow(0, c0, card0.end, card0.fits, last_fits=card0.last_fits,
                           batch_start=c0 + cap)
        return WindowCheck((card0, window(1, int(over[1] or 0),
                                          lambda x: (x, b + x - split[1]))))
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


def run(fall: bool, look=None, max_probes: int = 16):  # type: ignore[no-untyped-def]
    return search.run(probe_of(fall), [BUDGET, BUDGET], "max_batch", 500, compare_even=False,
                      first_split=[75, 425], max_probes=max_probes,
                      known=search.Known(look_past=look))


def test_the_search_alone_certifies_past_a_fall_it_never_met() -> None:
    out = run(fall=True)
    assert out.certified and out.not_monotone is None     # the hole the look past closes
    assert out.best.batch_size < largest_batch(fall=True)


def test_past_a_fall_the_largest_batch_is_found_and_certified_on_the_model() -> None:
    """The look finds card 1 fitting again from 440 to 460 samples: the answer with card 1 at
    460 is probed (card 0 over at its chunk, then giving card 1 its samples), then card 0's
    room along the larger batch: brute force's largest batch, certified by the look past it."""
    look = brute_look(fall=True)
    out = run(fall=True, look=look)
    assert out.best.batch_size == largest_batch(fall=True) == 1256
    assert out.certified and out.window is not None and not out.window.falls
    assert out.not_monotone is not None and "card 1 is over at 420 samples and fits again at 440 samples" in out.not_monotone
    assert all(p <= BUDGET for p in out.best.peak_bytes)
    assert sum(p.purpose == "past a fall" for p in out.probes) >= 2
    note = next(n for n in out.notes if n.startswith("the figures fall as the work grows"))
    assert "certified on the allocator model" in note
    split, over = look.calls[0]
    assert over[1] == 420                       # the first look: from card 1's over point


def test_with_too_few_probes_left_the_certificate_is_withheld() -> None:
    """At a cap of 3 the look past the answer finds card 0 fitting on with no probe left to
    measure it: the answer stays the best split measured, not certified, and the note says
    what the look found; from a cap of 4 the search reaches brute force's answer, certified."""
    short = run(fall=True, look=brute_look(fall=True), max_probes=3)
    assert not short.certified and len(short.probes) == 3
    assert all(p <= BUDGET for p in short.best.peak_bytes)
    assert short.best.batch_size < largest_batch(fall=True)
    assert short.window is not None and [w.card for w in short.window.falls] == [0]
    note = next(n for n in short.notes if n.startswith("not certified"))
    assert "the look past the answer on the allocator model found card 0" in note
    for cap in (4, 8):
        out = run(fall=True, look=brute_look(fall=True), max_probes=cap)
        assert out.certified and out.best.batch_size == largest_batch(fall=True)
        assert len(out.probes) <= cap


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


def test_past_a_fall_no_proof_where_a_window_was_not_looked_at_whole() -> None:
    """After the raise, card 0's over point is the look's alone: a window it could not look
    at (its drawing missed a third step) leaves the larger answer uncertified."""
    brute = brute_look(fall=True)

    def look(split, over, min_chunk=1):  # type: ignore[no-untyped-def]
        w = brute(split, over, min_chunk)
        if len(brute.calls) == 1:
            return w
        return WindowCheck(tuple(CardWindow(c.card, c.start, None, scaled=False) if c.card == 0
                                 else c for c in w.cards))
    out = run(fall=True, look=look)
    assert not out.certified and out.best.batch_size > run(fall=True).best.batch_size
    assert any("not certified" in n and "larger split(s) measured" in n for n in out.notes)


# A surface whose falls the probes themselves meet: card 1 over from 410 to 449 samples but at
# every third chunk, card 0 over from 700 to 849 but at every third (cached blocks that come and
# go), each within budget again above until its allocated figure alone is over. The probes read
# a card within budget above a chunk it was over at, so no bracket of theirs proves anything.
def chaotic(i: int, c: int, batch: int) -> int:
    falls = (i == 1 and 410 <= c < 450) or (i == 0 and 700 <= c < 850)
    return allocated(i, c, batch) + (GiB if falls and c % 3 else 0)


def chaotic_probe(split: Sequence[int]) -> ProbeResult:
    s = tuple(int(c) for c in split)
    return ProbeResult(s, tuple(chaotic(i, c, sum(s)) for i, c in enumerate(s)),
                       allocated_peak_bytes=tuple(allocated(i, c, sum(s)) for i, c in enumerate(s)))


def chaotic_look(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1) -> WindowCheck:
    """Brute force on the chaotic surface, as :func:`brute_look` on the other."""
    def window(card: int, start: int, at) -> CardWindow:  # type: ignore[no-untyped-def]
        x, first, last = start, None, None
        while allocated(card, *at(x)) <= BUDGET:
            if chaotic(card, *at(x)) <= BUDGET:
                first = x if first is None else first
                last = x
            x += 1
        return CardWindow(card, start, x, first, last_fits=last)
    b, cap = sum(split), int(over[1] or 0) - 1
    c0 = b + 1 - cap
    card0 = window(0, c0, lambda x: (x, x + cap))
    card0 = CardWindow(0, c0, card0.end, card0.fits, last_fits=card0.last_fits, batch_start=c0 + cap)
    return WindowCheck((card0, window(1, int(over[1] or 0), lambda x: (x, b + x - split[1]))))


def chaotic_largest() -> int:
    best = 0
    for c1 in range(0, 470):
        if chaotic(1, c1, 0) > BUDGET:
            continue
        best = max(best, c1 + max(c for c in range(0, 2000) if chaotic(0, c, c + c1) <= BUDGET))
    return best


def test_probes_that_meet_a_fall_keep_some_for_the_look_and_certify_brute_forces_answer() -> None:
    """Without a look the search meets the falls and certifies nothing. With one, once its
    probes met a fall it keeps the last ``past_falls.RESERVE`` probes for going past it, and
    those reach brute force's answer, certified on the model, within a cap of 9 (the search
    that spent them on its brackets first ended uncertified there)."""
    def go(look, cap: int):  # type: ignore[no-untyped-def]
        return search.run(chaotic_probe, [BUDGET, BUDGET], "max_batch", 500, compare_even=False,
                          first_split=[75, 425], max_probes=cap, known=search.Known(look_past=look))
    alone = go(None, 12)
    assert alone.not_monotone is not None and not alone.certified
    assert alone.best.batch_size < chaotic_largest()
    for cap in (9, 12):
        looked = go(chaotic_look, cap)
        assert looked.certified and looked.best.batch_size == chaotic_largest()
        assert len(looked.probes) <= cap
        assert all(p <= BUDGET for p in looked.best.peak_bytes)
        assert looked.best.chunk_sizes[1] == 460      # past card 1's fall, its last chunk that fits
        assert any(p.purpose in ("past a fall", "past the answer") for p in looked.probes)


def test_where_the_look_cannot_decide_the_search_goes_on_with_its_own_probes() -> None:
    """A look that cannot see card 0's window whole (it stops first, as the MLP's card 0 on
    80 GB cards does): the search, stopped early for it, goes on with the probes it kept and
    certifies with its own brackets as a search without a look does, the same answer."""
    brute = brute_look(fall=False)

    def short_look(split, over, min_chunk=1):  # type: ignore[no-untyped-def]
        w = brute(split, over, min_chunk)
        return WindowCheck(tuple(CardWindow(0, c.start, None, batch_start=c.batch_start)
                                 if c.card == 0 else c for c in w.cards))
    for cap in (5, 8, 12):            # (stopping for the look, it ended uncertified at 5-10)
        alone = run(fall=False, max_probes=cap)
        out = run(fall=False, look=short_look, max_probes=cap)
        assert alone.certified and out.certified
        assert out.best.batch_size == alone.best.batch_size == largest_batch(fall=False)
        assert len(out.probes) <= cap
        assert not any("kept for the look" in n for n in out.notes)
        assert out.window is not None and not out.window.closed     # card 0 seen only so far
