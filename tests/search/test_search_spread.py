"""The spread start of the largest-batch search (issue 28): the cards' slope from one probe,
card 0's batch term without a probe of its own, and the fits behind them."""

from __future__ import annotations

import pytest
from tests.search.test_search import TYPICAL, CurveBackend, best_batch, budgets, measured_within

from dptune import search
from dptune.backends.base import ProbeResult
from dptune.search.max_batch import SPREAD_MIN, MaxBatch
from dptune.search.models import CardFits, secant
from dptune.search.observations import Observations

GiB, MiB = 2**30, 2**20


def _first(n: int, hint: int, *, exact: bool = True, prior: bool = False) -> tuple[int, ...]:
    obs = Observations([20 * GiB] * n, exact_on_oom=exact)
    if prior:
        obs.add_prior(ProbeResult((8,) * n, (GiB,) * n), list(range(1, n)))
    prop = MaxBatch(obs, hint, 12).propose()
    assert prop is not None
    return prop.split


def test_the_first_probe_spreads_the_cards_only_where_one_probe_can_give_their_slope():
    s = _first(4, 256)
    assert sum(s) == 256 and s[0] == 64 and len(set(s[1:])) == 3      # one chunk per card
    assert min(s[1:]) >= 32 and max(s[1:]) <= 96                        # 0.5x to 1.5x of 64
    assert _first(2, 256) == (128, 128)                 # one card >= 1: no slope from it alone
    share = SPREAD_MIN - 1
    assert _first(4, 4 * share) == (share,) * 4         # a few samples apart: no slope
    assert _first(4, 256, exact=False) == (64,) * 4     # real cards: an OOM shows one card
    assert _first(4, 256, prior=True) == (64,) * 4      # a prior search already gave the slope


def test_pooled_slope_and_its_refusal():
    """One probe at three chunks on the same affine curve gives its slope; two cards that
    disagree at the same chunk (not the same replica) give none."""
    w, a = 2 * GiB, 30 * MiB
    obs = Observations([24 * GiB] * 4, exact_on_oom=True)
    split = (64, 32, 64, 96)
    obs.add(ProbeResult(split, (9 * GiB,) + tuple(w + a * c for c in split[1:])))
    assert CardFits(obs).median_slope == pytest.approx(a)
    obs = Observations([24 * GiB] * 4, exact_on_oom=True)
    obs.add(ProbeResult((64, 32, 32, 96), (9 * GiB, w + 32 * a, int(1.05 * (w + 32 * a)),
                                            w + 96 * a)))
    assert CardFits(obs).median_slope is None


def test_secant_takes_the_chord_around_the_target_and_a_long_base_beyond():
    pts = [(10, 100.0), (11, 100.0), (20, 190.0), (40, 390.0)]
    line = secant(pts, 15)                    # between 11 and 20: their chord
    assert line is not None and line.slope == pytest.approx(10.0)
    line = secant(pts, 60)                    # beyond 40 by 20: the base is at least 20 long
    assert line is not None and line.slope == pytest.approx(10.0)
    line = secant([(10, 100.0), (11, 100.0), (12, 103.0)], 30)
    assert line is not None and line.slope == pytest.approx(1.5)   # 10..12, not the 11..12 step


@pytest.mark.parametrize("shape", [s for s in TYPICAL if len(s.totals) >= 3],
                         ids=lambda s: s.name)
def test_spread_start_exact_certified_and_never_asks_card0_batch_term_alone(shape):
    n, m = len(shape.totals), 2 if shape.bn else 1
    be = CurveBackend(shape)
    out = search.run(be.probe, budgets(shape), "max_batch", 64 * n, min_chunk=m, max_probes=12)
    assert out.best.batch_size == best_batch(shape) and out.certified and not out.even_open
    measured_within(shape, out)
    assert out.probes[0].purpose == "spread"
    assert "fit" not in [p.purpose for p in out.probes]   # card 0's batch term from the guess
