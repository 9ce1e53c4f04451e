"""The even split's largest batch ``E`` on a model of the figure (``search.Known.even_line``):
the largest-batch search's reading of ``E`` checked, or closed where its probes left it open.

A synthetic surface (no torch work) on three 10 GiB cards: card ``i >= 1`` costs 20 MiB a
sample, card 0 10 MiB a sample and 1 MiB a sample of the batch; with ``fall``, card 1 holds
4 GiB more of cached blocks from 310 to 319 samples only, so the even split fails first at
batch 928 (card 1 at 310) and fits again above, where the probes (which never ask card 1
there) read ``E`` from splits that load every card more. ``E`` by brute force: every even
batch from 1, split as ``torch.chunk`` splits it, until one is over. The model here is
brute force on the same surface (what :meth:`SimulatedBackend.even_line` does on the
allocator model, tested against real steps in
``tests/backends/simulated/test_even_line.py``)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from dptune import search
from dptune.backends.base import ProbeResult
from dptune.search.even_baseline import ON_MODEL
from dptune.types import EvenLine

GiB, MiB = 2**30, 2**20
BUDGET, N = 10 * GiB, 3


def figure(i: int, c: int, batch: int, fall: bool) -> int:
    if i and not c:
        return 0
    cached = 4 * GiB if fall and i == 1 and 310 <= c < 320 else 0
    return GiB + (20 * MiB * c + cached if i else 10 * MiB * c + MiB * batch)


def probe_of(fall: bool):  # type: ignore[no-untyped-def]
    def probe(split: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in split)
        return ProbeResult(s, tuple(figure(i, c, sum(s), fall) for i, c in enumerate(s)))
    return probe


def chunk(b: int) -> tuple[int, ...]:
    sizes = [len(t) for t in torch.arange(b).chunk(N)]
    return tuple(sizes + [0] * (N - len(sizes)))


def over(b: int, fall: bool) -> Optional[int]:
    """The first card over in the even split of ``b`` (``None``: it fits)."""
    s = chunk(b)
    return next((i for i, c in enumerate(s) if figure(i, c, b, fall) > BUDGET), None)


def brute_even(fall: bool) -> int:
    b = 1
    while over(b + 1, fall) is None:
        b += 1
    return b


def brute_line(fall: bool, shift: int = 0, reach: Optional[int] = None):  # type: ignore[no-untyped-def]
    """The model: every even batch from ``lo + 1`` until one is over; ``shift`` moves its
    answer (a model that is wrong); ``reach``: it replays no further than that many batches
    past ``lo`` (``None`` where ``upto`` is further)."""
    calls: list[int] = []

    def line(lo: int, min_chunk: int = 1, upto: Optional[int] = None) -> Optional[EvenLine]:
        calls.append(lo)
        if reach is not None and upto is not None and upto - lo > reach:
            return None
        b = lo + 1
        while over(b, fall) is None:
            b += 1
        card = over(b, fall)
        assert card is not None
        return EvenLine(start=lo, largest=b - 1 + shift, over=b + shift, card=card,
                        replays=N * (b - lo), steps=0)
    line.calls = calls  # type: ignore[attr-defined]
    return line


def run(fall: bool, line: Any = None, hint: int = 900, max_probes: int = 5
        ) -> search.SearchOutcome:
    return search.run(probe_of(fall), [BUDGET] * N, "max_batch", hint, max_probes=max_probes,
                      known=search.Known(even_line=line))


def said(out: search.SearchOutcome, words: str) -> list[str]:
    return [n for n in out.notes if words in n]


def test_the_probes_alone_read_E_past_a_fall_they_never_met() -> None:
    out = run(fall=True)
    assert not out.even_open and out.even is not None
    assert out.even.batch_size > brute_even(fall=True)      # the hole the model closes


def test_past_the_fall_the_model_finds_brute_force_E() -> None:
    alone, line = run(fall=True), brute_line(fall=True)
    out = run(fall=True, line=line)
    e = brute_even(fall=True)
    assert line.calls and not out.even_open and out.even_line is not None
    assert out.even is not None and out.even.batch_size == e == out.even_line.largest
    assert out.even_split == chunk(e) and out.even.within_budget([BUDGET] * N)
    assert over(out.even_line.over, fall=True) is not None
    # simulated beside the probes, not one of them: the probes are the search's alone
    assert out.even.purpose == ON_MODEL and out.even not in out.probes
    assert [r.chunk_sizes for r in out.probes] == [r.chunk_sizes for r in alone.probes]
    assert out.best == alone.best and out.certified == alone.certified
    note = said(out, "found on the allocator model")
    assert len(note) == 1 and "does not hold" in note[0] and str(e) in note[0]


def test_an_open_bracket_is_closed_at_brute_force_E() -> None:
    alone = run(fall=False, hint=300, max_probes=3)
    assert alone.even_open                                   # the probes ran out first
    out = run(fall=False, line=brute_line(fall=False), hint=300, max_probes=3)
    e = brute_even(fall=False)
    assert not out.even_open and out.even_at_most is None
    assert out.even is not None and out.even.batch_size == e and out.even.purpose == ON_MODEL
    assert len(out.probes) == len(alone.probes)
    assert said(out, "found on the allocator model")
    assert not said(out, "the even split's largest batch was not bracketed")


def test_where_the_model_cannot_replay_from_the_bottom_an_open_bracket_is_closed_from_its_end(
        ) -> None:
    alone = run(fall=False, hint=300, max_probes=3)
    assert alone.even is not None and alone.even_open
    line = brute_line(fall=False, reach=100)
    out = run(fall=False, line=line, hint=300, max_probes=3)
    assert line.calls == [N * (N - 1), alone.even.batch_size]
    assert out.even is not None and out.even.batch_size == brute_even(fall=False)
    assert out.even_line is not None and out.even_line.start == alone.even.batch_size
    # a certified reading is not re-read from its end: nothing to close there
    line = brute_line(fall=False, reach=100)
    out = run(fall=False, line=line)
    assert len(line.calls) == 1 and out.even_line is None and not out.even_open


def test_a_reading_the_model_agrees_with_is_kept_and_said_checked() -> None:
    alone = run(fall=False)
    out = run(fall=False, line=brute_line(fall=False))
    assert alone.even is not None and not alone.even_open
    assert alone.even.batch_size == brute_even(fall=False)
    assert out.even == alone.even and out.even_line is not None
    assert len(said(out, "checked on the allocator model")) == 1


def test_a_model_the_probes_or_real_steps_contradict_is_not_taken() -> None:
    for fall, shift in ((True, 3), (True, -1), (False, 5)):
        alone = run(fall)
        out = run(fall, brute_line(fall, shift))
        assert out.even == alone.even and out.even_line is None, (fall, shift)
        assert said(out, "rests on the probes"), (fall, shift)


def test_no_model_no_change() -> None:
    alone = run(fall=True)
    out = run(True, lambda lo, min_chunk=1, upto=None: None)
    assert out.even == alone.even and out.notes == alone.notes


def test_the_reading_checked_is_the_one_reported_not_a_later_one() -> None:
    """Probes run after the search read its even bracket (past a fall) can move it by
    dominance (here a probe at (460, 460, 460) makes every even batch to 1,380 'known' to
    fit); the line checks the reading the outcome reports (its lower end 1,326, open above),
    and finds ``E`` from there."""
    from dptune.search.even_baseline import OnModel, on_the_model
    from dptune.search.max_batch import MaxBatch
    from dptune.search.observations import Observations

    alone = run(fall=False, hint=300, max_probes=3)
    assert alone.even is not None and alone.even_open
    obs = Observations([BUDGET] * N, exact_on_oom=True)
    for r in alone.probes:
        obs.add(r)
    later = probe_of(False)((460, 460, 460))
    obs.add(later)
    mb = MaxBatch(obs, 300, 12)
    assert mb.even.bracket()[0] > alone.even.batch_size         # the later reading
    line = brute_line(fall=False, reach=100)
    got = on_the_model(probe_of(False), mb.even, line, alone.even, None)
    assert line.calls == [N * (N - 1), alone.even.batch_size]
    assert isinstance(got, OnModel)
    assert got.line.start == alone.even.batch_size and got.line.largest == brute_even(False)
