"""benchmarks/certificate.py: the certificate's minimum is a lower bound on any proof of the
answer (never above a proof dptune's own probes give), and agrees with a hand count."""

from __future__ import annotations

import pytest

from benchmarks import certificate as cert
from benchmarks import certificate_answer as exhaustive
from benchmarks import certificate_cases as cases


def test_hand_count_two_cards():
    """mlp2: the answer's probe; card 1 one more sample over; card 0 over at one more sample
    of B* + 1 (in a probe of its own: with card 1 at its cap + 1 as well the batch is B* + 2,
    too large to prove anything of B* + 1). The even split at E + 1 puts card 0 at fewer
    samples in a smaller batch, over there means over at B* + 1: 3 in all."""
    s = cases.synthetic()[0]
    ans = exhaustive.answer(s)
    assert s.name == "mlp2" and ans.best == 1296 and ans.caps == (716,) and ans.even == 1160
    assert cert.minimum(s, ans, with_even=False) == 3
    assert cert.minimum(s, ans) == 3


@pytest.mark.parametrize("k", [0, 1, 3, 5])
def test_minimum_never_above_a_proof_dptune_found(k):
    s = cases.random_affine(k)
    row = cert.measure(s)
    assert row.ok
    assert row.minimum is not None and row.own_min is not None
    assert row.minimum_max <= row.minimum <= row.own_min <= row.probes


def test_even_answer_skips_batchnorm_batches_and_the_torch_chunk_dips():
    """affine5 is BatchNorm on 3 cards: even(7) = [3, 3, 1] is skipped, as a user would."""
    for k in (3, 5):
        s = cases.random_affine(k)
        ans = exhaustive.answer(s)
        n, last = s.n, 0
        b = exhaustive.even_start(s)
        while True:
            sp = cert.even_split(b, n)
            if cert._valid(sp, s.m):
                if any(s.over(sp)):
                    break
                last = b
            b += 1
        assert ans.even == last and sum(ans.even_next) == b


def test_the_model_cases_are_searched_with_what_the_tuner_gives():
    """At the reserved level the certificate benchmarks search simulated cards with the look
    past the over points and the even line on the allocator model, as the tuner does; at the
    allocated level with neither (the figure does not fall there); alike cards named as the
    tuner names them."""
    from benchmarks.certificate_levels import known_of, level_surface

    k = known_of(level_surface("causal-lm/long", "reserved"))
    assert k.look_past is not None and k.even_line is not None and k.alike is not None
    k = known_of(level_surface("causal-lm/long", "allocated"))
    assert k.look_past is None and k.even_line is None and k.alike is not None
