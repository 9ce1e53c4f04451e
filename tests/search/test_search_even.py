"""The even baseline is the batch a user reaches by raising DataParallel's batch until it
fails: every even split up to ``E`` fits, ``even(E + 1)`` does not. ``torch.chunk`` is not
monotone per card (three cards: ``even(327) = (109, 109, 109)``, ``even(328) = (110, 110,
108)``), so a batch above a failing one may fit again; it does not count. Checked against
``benchmarks.certificate``'s brute force (every even batch scanned on the surface itself)."""

from __future__ import annotations

import pytest

from benchmarks.certificate_answer import answer
from benchmarks.certificate_cases import random_affine, staircase, synthetic
from dptune import search
from dptune.split import even_split


def _run(s):  # type: ignore[no-untyped-def]
    return search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m, max_probes=12,
                      exact_on_oom=True)


def _exact_within(s, most: int):  # type: ignore[no-untyped-def]
    """The search on ``s``: both answers certified within ``most`` probes and the brute
    force's (the largest batch measured within every budget, the even baseline)."""
    out = _run(s)
    want = answer(s)
    assert out.certified and not out.even_open and len(out.probes) <= most
    assert out.best.batch_size == want.best and not any(s.over(out.best.chunk_sizes))
    assert out.even is not None and out.even.batch_size == want.even
    return out


def test_a_fitting_batch_above_the_first_failure_is_not_the_baseline():
    s = random_affine(3)          # three cards, card 2's cap 108 samples
    assert not any(s.over(even_split(326, 3))) and any(s.over(even_split(327, 3)))
    assert not any(s.over(even_split(328, 3)))     # (110, 110, 108): fits again
    out = _run(s)
    assert out.certified and not out.even_open
    assert out.even is not None and out.even.batch_size == answer(s).even == 326


@pytest.mark.parametrize("s", synthetic() + [random_affine(k) for k in range(24)],
                         ids=lambda s: s.name)
def test_largest_and_even_batches_match_the_brute_force(s):
    out = _run(s)
    want = answer(s)
    assert out.certified and not out.even_open
    assert out.best.batch_size == want.best and not any(s.over(out.best.chunk_sizes))
    assert (out.even.batch_size if out.even is not None else 0) == want.even


def test_on_a_flat_step_the_even_baseline_does_not_bet_on_the_dominance_cap():
    """``staircase(2)``: card 0 fits at 144 samples in a batch of 713 and at 145 in 714, 84-87
    MiB under its budget both times: its own samples cost nothing there (a flat step; the
    3 MiB is the batch's). ``even(290)`` is known to fit by dominance and the first guess,
    ``even(308)``, is over; betting that 290 is the cap (``even(291)`` asked directly, as
    on ``workspace_jump`` where card 0's samples do cost) would waste a probe: the smaller
    batch frees 3 MiB a sample and E is 306. So the even baseline closes within 12 probes
    (it was left open at 12, the largest batch exact), both answers the brute force's."""
    s = staircase(2)
    out = _exact_within(s, 12)
    assert out.even is not None and out.even.batch_size == 306
    assert (146, 145) not in [tuple(p.chunk_sizes) for p in out.probes]   # even(291)


def test_a_stalled_even_bracket_steps_up_from_lo_not_to_a_far_middle():
    """``staircase(4)``: the even split's guesses 218 and 219 both fit, each one sample short
    (a staircase); the bracket's upper end comes from card 0 over at the largest batch, far
    off, and its middle (346) would put card 0 gigabytes over, a probe that teaches nothing.
    Twice the last step up from ``lo`` instead: 221 (over), then 220 (within budget), which
    is E by the brute force: every answer certified within 11 probes (open at 12 before)."""
    s = staircase(4)
    out = _exact_within(s, 11)
    assert out.even is not None and out.even.batch_size == 220
    even_batches = [p.batch_size for p in out.probes if p.purpose.startswith("even-max")]
    assert max(even_batches) <= 221, even_batches


@pytest.mark.parametrize("real", [False, True])
def test_no_even_baseline_when_the_first_even_split_does_not_fit(real):
    """BatchNorm on 4 cards, card 3 unable to hold 2 samples: even(8) = (2, 2, 2, 2) is over,
    and even(9) = (3, 3, 3, 0) fits, but a user raising the batch never gets past 8, so
    there is no even baseline (the brute force's scan: 0). The search once started its scan
    above even(8) without asking it and reported 9."""
    from benchmarks.certificate_surface import GiB, MiB, Surface
    from dptune.types import ProbeResult

    w, a = GiB, 50 * MiB
    s = Surface("bn-weak-card3", "test", [22 * GiB] * 3 + [w + a], f=lambda i, c: w + a * c,
                g=lambda c0, b: w + a * max(c0, 1) + GiB + 4096 * b, m=2, hint=64)
    assert any(s.over(even_split(8, 4))) and not any(s.over(even_split(9, 4)))
    assert answer(s).even == 0

    def probe(split):  # type: ignore[no-untyped-def]
        peaks = s.peaks(tuple(split))
        over = [i for i in range(4) if (i == 0 or split[i]) and peaks[i] > s.budgets[i]]
        if not real or not over:
            return ProbeResult(tuple(split), tuple(peaks))
        return ProbeResult(tuple(split), tuple(p if i == over[0] else 0 for i, p in
                                               enumerate(peaks)), oom_device=over[0])
    out = search.run(probe, s.budgets, "max_batch", s.hint, min_chunk=2, max_probes=16,
                     exact_on_oom=not real)
    assert out.even is None and not out.even_open
    assert out.best.batch_size == answer(s).best and out.certified


def _surface(seed: int):  # type: ignore[no-untyped-def]
    """A random surface of 3-10 cards: affine or a staircase, mixed budgets, BatchNorm or
    not, card 0 paying for the whole batch."""
    import itertools
    import random

    from benchmarks.certificate_surface import GiB, MiB, Surface

    rng = random.Random(seed)
    n = rng.randint(3, 10)
    w, a = rng.randint(1, 6) * GiB // 2, rng.randint(2, 200) * MiB
    steps = list(itertools.accumulate(rng.randint(1, 9) * 37 * MiB for _ in range(3000)))
    width = rng.randint(1, 7)
    stairs = rng.random() < 0.5

    def f(i: int, c: int) -> int:
        return w + (steps[min(c // width, 2999)] if stairs else a * c)
    per_b, extra = rng.choice([0, 4096, MiB, 3 * MiB]), rng.randint(0, 8) * GiB // 2
    budgets = [rng.choice([10, 14, 22, 38, 78]) * GiB for _ in range(n)]
    return Surface(f"random{seed}", "test", budgets, f=f,
                   g=lambda c0, b: f(0, c0) + extra + per_b * b, m=rng.choice([1, 1, 2]),
                   hint=rng.choice([8, 64, 512]) * n)


@pytest.mark.parametrize("real", [False, True])
def test_random_surfaces_never_give_a_wrong_certified_answer(real):
    """Over random surfaces of 3-10 cards, on the simulator and with real cards' semantics
    (an out-of-memory probe measures only the failing card): whatever the search certifies
    is the brute force's answer, what it returns fits, and it stops early only when done."""
    from dptune.types import ProbeResult

    for seed in range(40):
        s = _surface(seed)
        want = answer(s)

        def probe(split, s=s):  # type: ignore[no-untyped-def]
            peaks = s.peaks(tuple(split))
            over = [i for i in range(s.n) if (i == 0 or split[i]) and peaks[i] > s.budgets[i]]
            if not real or not over:
                return ProbeResult(tuple(split), tuple(peaks))
            return ProbeResult(tuple(split), tuple(p if i == over[0] else 0
                                                   for i, p in enumerate(peaks)),
                               oom_device=over[0])
        out = search.run(probe, s.budgets, "max_batch", s.hint, min_chunk=s.m, max_probes=16,
                         exact_on_oom=not real)
        even = out.even.batch_size if out.even is not None else 0
        assert not any(s.over(out.best.chunk_sizes)), s.name
        if out.certified:
            assert out.best.batch_size == want.best, s.name
        if not out.even_open:
            assert even == want.even, s.name
        else:
            assert even <= want.even, s.name
        assert len(out.probes) == 16 or (out.certified and not out.even_open), s.name
