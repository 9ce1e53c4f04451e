"""A card whose one-more tests keep fitting (a staircase the fits cannot see) gallops up
rather than walking one sample per probe; the answer is checked against the exhaustive
largest batch of ``benchmarks.certificate`` (caps by scan, the batch by bisection on the
surface itself)."""

from __future__ import annotations

from benchmarks.certificate_answer import answer
from benchmarks.certificate_cases import staircase
from dptune import search
from dptune.split import even_split


def _max_only(seed: int, max_probes: int):  # type: ignore[no-untyped-def]
    # from the even split (the caller's), so that the fits start as they did when the probe
    # counts below were taken (the search's own first split spreads the cards since)
    s = staircase(seed)
    out = search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m,
                     max_probes=max_probes, exact_on_oom=True, compare_even=False,
                     first_split=even_split(s.hint, s.n))
    return s, out


def test_creeping_card_gallops_to_a_certified_exact_answer():
    # stairs7: card 2's fits put its cap one sample above each chunk measured within
    # budget, from 601 to 609; walking took 11 probes, galloping certifies within 8
    s, out = _max_only(7, 8)
    assert out.certified
    assert out.best.batch_size == answer(s).best
    assert not any(s.over(out.best.chunk_sizes))
    chunks = [p.chunk_sizes[2] for p in out.probes]
    steps = [b - a for a, b in zip(chunks, chunks[1:]) if 0 < b - a]
    assert max(steps[-3:]) >= 4      # a step of more than one sample near the cap


def test_gallop_leaves_the_affine_cases_alone():
    # on an affine surface the fits are exact: no card's one-more test fits twice in a row,
    # so each card is probed at its cap and once at the cap plus one, no more
    from benchmarks.certificate_cases import synthetic
    for s in synthetic()[:5]:
        out = search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m,
                         max_probes=12, exact_on_oom=True, compare_even=False)
        cap = answer(s).caps
        assert out.certified and out.best.batch_size == answer(s).best
        for i in range(1, s.n):
            above = sorted({p.chunk_sizes[i] for p in out.probes if p.chunk_sizes[i] > cap[i - 1]})
            assert above == [cap[i - 1] + 1], (s.name, i, above)


def test_a_stalled_bracket_steps_up_from_a_low_guess_not_to_a_far_middle():
    """``staircase(1)`` (two cards): along card 0's line, 311 and 312 fit (the fits' guess,
    one sample low each time) while the bracket's upper end, 383, comes from card 0 far over
    (14 GiB). Its middle, 347, would put card 0 gigabytes over again; twice the last raise
    above ``lo`` (314) is over by a step, then 313 fits: the largest batch, and then the even
    baseline, both the brute force's, certified within 10 probes (12 before)."""
    s = staircase(1)
    out = search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m, max_probes=12,
                     exact_on_oom=True)
    want = answer(s)
    assert out.certified and not out.even_open and len(out.probes) <= 10
    assert out.best.batch_size == want.best == 313 and not any(s.over(out.best.chunk_sizes))
    assert out.even is not None and out.even.batch_size == want.even
    assert max(p.batch_size for p in out.probes[3:]) <= 314


def test_a_stalled_bracket_steps_down_from_a_high_guess_not_to_a_far_middle():
    """``staircase(5)`` (four cards, the simulator): card 1 measured over at 614, then at
    600 (the fits' guess, too high), while within budget only at 63: the middle of
    ``[63, 600)`` (331) teaches little. Twice the last drop below 600 instead: 572 fits,
    then the fits find the cap, 594; every answer the brute force's, certified within 10
    probes (12 before)."""
    s = staircase(5)
    out = search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m, max_probes=12,
                     exact_on_oom=True)
    want = answer(s)
    assert out.certified and not out.even_open and len(out.probes) <= 10
    assert out.best.batch_size == want.best and not any(s.over(out.best.chunk_sizes))
    assert out.even is not None and out.even.batch_size == want.even
    assert min(p.chunk_sizes[1] for p in out.probes[2:]) > want.caps[0] - 32
