"""A second search reusing a first one's probes (``output_device="auto"``): the cards whose
memory does not change keep their brackets, and the even baseline is not asked again."""

from __future__ import annotations

import pytest
from tests.search.test_search import HARD, TYPICAL, CurveBackend, best_batch, budgets, measured_within

from dptune import search


@pytest.mark.parametrize("shape", [s for s in TYPICAL + HARD if len(s.totals) >= 3],
                         ids=lambda s: s.name)
def test_prior_probes_and_no_baseline_still_exact_and_never_dearer(shape):
    n, m = len(shape.totals), 2 if shape.bn else 1
    first_be = CurveBackend(shape)
    first = search.run(first_be.probe, budgets(shape), "max_batch", 64 * n, min_chunk=m,
                       max_probes=16)
    be = CurveBackend(shape)
    out = search.run(be.probe, budgets(shape), "max_batch", 64 * n, min_chunk=m,
                     max_probes=16, known=search.Known(prior=first.probes, prior_cards=list(range(2, n))),
                     compare_even=False)
    assert out.best.batch_size == best_batch(shape) and out.certified
    measured_within(shape, out)
    assert out.even is None and not out.even_open and not out.even_implied_by
    assert not any(p.purpose.startswith("even-max") for p in out.probes)
    assert len(be.calls) <= len(first_be.calls), (be.calls, first_be.calls)
    alone = search.run(CurveBackend(shape).probe, budgets(shape), "max_batch", 64 * n,
                       min_chunk=m, max_probes=16, compare_even=False)
    assert len(out.probes) <= len(alone.probes)      # on these shapes, never a probe more
    # only this search's probes are returned, the prior ones never
    assert [list(p.chunk_sizes) for p in out.probes] == be.calls


def test_prior_probes_save_probes_on_staircases():
    """Where the fits cannot see the cap (staircases), the cards' brackets from a first
    search spare the second one probes it would spend finding them again: fewer in all over
    the 3- and 4-card staircases of seeds 0-19 (not on every one: a prior bracket moves where
    the fits aim, which a staircase may punish), each answer exact and certified."""
    from benchmarks.certificate_answer import answer
    from benchmarks.certificate_cases import staircase

    with_prior = alone_total = 0
    for seed in range(20):
        s = staircase(seed)
        if s.n < 3:
            continue
        first = search.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m,
                           max_probes=16)
        kw = dict(min_chunk=s.m, max_probes=16, compare_even=False)
        out = search.run(s.probe, s.budgets, "max_batch", s.hint, known=search.Known(
                             prior=first.probes, prior_cards=list(range(2, s.n))), **kw)
        alone = search.run(s.probe, s.budgets, "max_batch", s.hint, **kw)
        assert out.certified and out.best.batch_size == answer(s).best == alone.best.batch_size
        with_prior += len(out.probes)
        alone_total += len(alone.probes)
    assert with_prior < alone_total, (with_prior, alone_total)


def test_prior_points_never_imply_an_even_split():
    """Points from another search narrow brackets but are not this search's evidence for the
    even baseline (fit_witness names this search's probes only)."""
    from tests.search.test_search import mlp

    from dptune.search.observations import Observations

    shape = mlp(4)
    first = search.run(CurveBackend(shape).probe, budgets(shape), "max_batch", 256)
    obs = Observations(budgets(shape), exact_on_oom=True)
    for r in first.probes:
        obs.add_prior(r, [1, 2, 3])
    assert obs.probes == [] and all(len(obs.points[i]) == len(first.probes) for i in (1, 2, 3))
    assert obs.points[0] == [] and obs.fit_witness([1, 1, 1, 1]) is None
