"""dptune.tuner: the search logic against a synthetic backend (no torch work in the probes)."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import pytest
import torch

import oracles
from dptune.backends.base import Device, ProbeResult
from dptune.errors import BackendUnavailableError, NoFeasibleSplitError, UsageError
from dptune.report import render_table
from dptune.result.model import Fit, TuneResult
from dptune.tuner import Tuner

GiB = 2**30

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # BalancedDataParallel on CPU


class SyntheticBackend:
    """Cards whose peak is ``a_i + b_i*c + q*c^2`` (+ ``g*B`` on card 0); OOM above a card's
    available memory. Records every split asked for."""

    kind = "simulated"

    def __init__(self, totals: Sequence[float], a: Sequence[float], b: Sequence[float],
                 g: float = 0.0, q: float = 0.0, used: Optional[Sequence[float]] = None,
                 bn: bool = False, outputs: float = 0.0):
        used = used or [0] * len(totals)
        self.devices = [Device(i, f"synthetic{i}", int(t), used_bytes=int(u))
                        for i, (t, u) in enumerate(zip(totals, used))]
        self.a, self.b, self.g, self.q = list(a), list(b), g, q
        self.has_batchnorm = bn
        self.outputs = outputs
        self.calls: list[list[int]] = []
        self.closed = False

    def describe(self) -> str:
        return f"{len(self.devices)} synthetic cards"

    def memory(self, i: int, c: int, batch: int) -> int:
        if i > 0 and c == 0:
            return 0
        return int(self.a[i] + self.b[i] * c + self.q * c * c + (self.g * batch if i == 0 else 0))

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        sizes = tuple(chunk_sizes)
        assert sum(sizes) > 0 and all(c >= 0 for c in sizes)
        if self.has_batchnorm:
            assert 1 not in sizes, "a chunk of 1 sample breaks BatchNorm"
        self.calls.append(list(sizes))
        batch = sum(sizes)
        peaks = [self.memory(i, c, batch) for i, c in enumerate(sizes)]
        for i, p in enumerate(peaks):
            avail = self.devices[i].available_bytes
            if p > avail:   # like the simulator: the whole step is measured
                return ProbeResult(sizes, tuple(peaks), oom_device=i)
        bd = tuple({"weights": p // 4, "activations": p // 2,
                    "outputs": int(self.outputs * p) if i == 0 else 0} for i, p in enumerate(peaks))
        return ProbeResult(sizes, tuple(peaks), breakdown=bd)

    def close(self) -> None:
        self.closed = True


def tune(backend, batch_size=256, **kw) -> TuneResult:
    model = torch.nn.Linear(4, 2)
    kw.setdefault("verbose", False)
    kw.setdefault("budget_level", "allocated")    # the synthetic peaks are allocated peaks
    return Tuner(model, lambda n: torch.randn(n, 4), batch_size=batch_size, backend=backend,
                 **kw).fit()


def identical(**kw) -> SyntheticBackend:
    """Four 24 GiB cards, card 0 paying 4 GiB more (master weights, optimizer) and the batch."""
    kw.setdefault("g", 0.011 * GiB)
    return SyntheticBackend([24 * GiB] * 4, [6 * GiB, 2 * GiB, 2 * GiB, 2 * GiB],
                            [0.093 * GiB] * 4, **kw)


def within_budget(r: TuneResult, p: ProbeResult) -> bool:
    return p.feasible and all(x <= b for x, b, c in zip(p.peak_bytes, r.budget_bytes, p.chunk_sizes))


def assert_verified(r: TuneResult) -> None:
    """The split returned is one a probe measured within every budget, with its peaks."""
    match = [p for p in r.probes if list(p.chunk_sizes) == r.chunk_sizes]
    assert match and within_budget(r, match[0])
    assert list(match[0].peak_bytes) == r.peak_bytes
    assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))


# ---- balance ------------------------------------------------------------------------------


def test_balance_affine_certified_within_four_probes():
    be = identical()
    r = tune(be)
    # the balance objective's exact sequence is pinned once, in tests/search/test_search_ties.py:
    # here the invariants (the even split first, at most four probes, the answer verified)
    assert be.calls[0] == [64, 64, 64, 64] and len(be.calls) <= 4, be.calls
    assert_verified(r)
    assert r.chunk_sizes == [9, 82, 82, 83] and r.certified
    assert [(b.lo, b.hi) for b in r.brackets] == [(9, 10), (82, 83), (82, 83), (83, 84)]
    assert r.imbalance < 1.02 < r.even.imbalance
    assert r.even.chunk_sizes == (64, 64, 64, 64)
    assert r.objective == "balance" and r.requested_batch_size == 256 and r.batch_size == 256
    assert r.num_probes <= 4 and len(r.fits) == 4
    # the fits are exact on affine cards
    for i, f in enumerate(r.fits):
        assert f.predict(r.chunk_sizes[i], 256) == pytest.approx(r.peak_bytes[i], abs=2)
    assert_verified(r)


def test_result_fields_are_filled():
    be = identical()
    r = tune(be, headroom="2GiB")
    assert r.backend == "simulated" and r.cluster == "4 synthetic cards"
    assert r.model_name == "Linear" and r.headroom_bytes == 2 * GiB
    assert r.budget_bytes == [22 * GiB] * 4 and r.devices == be.devices
    assert r.seconds > 0 and r.breakdown is not None
    assert type(r.model).__name__ == "BalancedDataParallel"
    assert not be.closed  # an injected backend belongs to the caller
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.chunk_sizes == r.chunk_sizes and back.fits == r.fits and back.probes == r.probes


def test_mildly_convex_cards_converge_within_the_limit():
    be = identical(q=3e-5 * GiB)
    r = tune(be, max_probes=8)
    assert len(be.calls) <= 8
    assert r.imbalance <= 1.05
    assert_verified(r)
    assert r.probes[-1].purpose in ("verify", "refine")
    assert r.chunk_sizes == list(r.probes[-1].chunk_sizes)


def test_strongly_convex_cards_still_return_a_verified_split():
    be = identical(q=2e-4 * GiB)
    r = tune(be, batch_size=500)
    assert_verified(r)
    assert r.imbalance <= 1.05


def test_card0_larger_gets_more():
    be = SyntheticBackend([48 * GiB, 24 * GiB, 24 * GiB, 24 * GiB],
                          [6 * GiB, 2 * GiB, 2 * GiB, 2 * GiB], [0.1 * GiB] * 4, g=0.01 * GiB)
    r = tune(be)
    assert be.calls[1] == [69, 49, 69, 69]  # the heaviest card (not card 0) gives in the 2nd probe
    assert r.chunk_sizes[0] > max(r.chunk_sizes[1:])
    assert r.imbalance < 1.05
    assert_verified(r)


def test_card_partly_taken_by_others_gets_less():
    be = SyntheticBackend([24 * GiB] * 4, [2 * GiB] * 4, [0.1 * GiB] * 4,
                          used=[0, 8 * GiB, 0, 0])
    r = tune(be)
    assert r.budget_bytes[1] == 15 * GiB
    assert r.chunk_sizes[1] < min(r.chunk_sizes[0], r.chunk_sizes[2], r.chunk_sizes[3])
    assert r.imbalance < 1.05


def test_even_split_out_of_memory_is_handled():
    be = SyntheticBackend([24 * GiB] * 4, [12 * GiB, 2 * GiB, 2 * GiB, 2 * GiB],
                          [0.1 * GiB] * 4, g=0.01 * GiB)
    r = tune(be, batch_size=620)
    assert r.probes[0].oom_device == 0 and not r.even.feasible and r.even.oom_device == 0
    assert r.chunk_sizes[0] < min(r.chunk_sizes[1:])
    assert r.imbalance < 1.05
    assert_verified(r)
    assert len(be.calls) <= 12


@pytest.mark.parametrize("batch", [674, 800])
def test_infeasible_batch_raises_with_shortfall(batch):
    be = SyntheticBackend([24 * GiB] * 4, [12 * GiB, 2 * GiB, 2 * GiB, 2 * GiB],
                          [0.1 * GiB] * 4, g=0.01 * GiB)
    with pytest.raises(NoFeasibleSplitError) as e:
        tune(be, batch_size=batch)
    assert e.value.shortfall_bytes and e.value.shortfall_bytes > 0
    msg = str(e.value)
    assert "over its budget" in msg and "smaller batch_size" in msg and "gradient accumulation" in msg
    assert len(be.calls) <= 12


def test_nothing_fits_anywhere_raises():
    be = SyntheticBackend([8 * GiB] * 2, [7.5 * GiB] * 2, [0.1 * GiB] * 2)
    with pytest.raises(NoFeasibleSplitError):
        tune(be, batch_size=64)
    assert len(be.calls) <= 12


def test_batchnorm_never_gets_a_single_sample():
    be = SyntheticBackend([24 * GiB] * 4, [12 * GiB, 2 * GiB, 2 * GiB, 2 * GiB],
                          [1 * GiB] * 4, bn=True)
    r = tune(be, batch_size=10)
    assert all(1 not in c for c in be.calls)
    assert 1 not in r.chunk_sizes and sum(r.chunk_sizes) == 10
    assert any("BatchNorm" in n for n in r.notes)


def test_batchnorm_even_split_with_a_single_sample_is_not_probed():
    be = SyntheticBackend([24 * GiB] * 4, [2 * GiB] * 4, [1 * GiB] * 4, bn=True)
    r = tune(be, batch_size=5)  # torch.chunk: 2, 2, 1, 0
    assert [2, 2, 1, 0] not in be.calls and 1 not in r.chunk_sizes
    assert not r.even.feasible


def test_single_card():
    be = SyntheticBackend([24 * GiB], [2 * GiB], [0.1 * GiB])
    r = tune(be, batch_size=32)
    assert r.chunk_sizes == [32] and be.calls == [[32]]


def test_advice_when_gathered_outputs_weigh_on_card0():
    r = tune(identical(outputs=0.3))
    assert any("model.reduce(losses)" in a and "30%" in a for a in r.advice)
    assert not any("model.reduce" in a for a in tune(identical(outputs=0.05)).advice)


def test_advice_when_card0_fixed_cost_alone_is_heaviest():
    be = SyntheticBackend([24 * GiB] * 4, [20 * GiB, 2 * GiB, 2 * GiB, 2 * GiB],
                          [0.1 * GiB] * 4, g=0.001 * GiB)
    r = tune(be, batch_size=64)
    assert r.chunk_sizes[0] == 0
    assert any("no split can balance" in a for a in r.advice)
    assert not any("no split can balance" in a for a in tune(identical()).advice)


# ---- max batch ----------------------------------------------------------------------------


def test_max_batch_affine():
    be = identical()
    r = tune(be, objective="max_batch")
    truth = [Fit(6 * GiB, 0.093 * GiB, 0.011 * GiB)] + [Fit(2 * GiB, 0.093 * GiB)] * 3
    budgets = [23 * GiB] * 4
    want, _ = oracles.solve_max_batch(truth, budgets)
    assert r.batch_size == want == 767
    # card 0's gathered outputs (0.011 GiB a sample of the whole batch) put its even-split
    # chunk above its chunk at the largest batch: three questions left for card 0 (one more
    # sample at the best batch, the even split at E and E + 1); the cards' one-more tests
    # were asked by the second probe (the first spread the cards: a slope across them)
    assert len(be.calls) <= 6, be.calls
    c0 = r.chunk_sizes[0]
    assert any(c[0] == c0 + 1 and sum(c) == 768 for c in be.calls)   # card 0 one more at B + 1
    assert sum(p.purpose.startswith("even-max") for p in r.probes) == 2   # even(E), even(E + 1)
    assert r.even.batch_size == oracles.max_even_batch(truth, budgets) == 496
    gain = r.batch_gain
    assert r.even.feasible and gain is not None and gain.low == gain.high == 767 / 496 - 1
    assert r.fits[0].batch_slope_bytes == pytest.approx(0.011 * GiB, rel=1e-6)
    assert r.certified and [(b.what, b.lo, b.hi) for b in r.brackets] == [
        ("batch", 767, 768), ("chunk", 225, 226), ("chunk", 225, 226), ("chunk", 225, 226)]
    assert_verified(r)
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.certified and back.brackets == r.brackets
    assert tuple(r.even.chunk_sizes) in {tuple(p.chunk_sizes) for p in r.probes}


def test_max_batch_even_split_implied_by_dominance_round_trips():
    # a tiny gathered output: card 0 takes more at the largest batch than in the even split,
    # so even(E) is never probed; it fits by dominance, which the result says (and keeps)
    be = identical(g=0.0)
    r = tune(be, objective="max_batch")
    assert [p.purpose for p in r.probes] == ["spread", "fit", "max", "even-max"]
    truth = [Fit(6 * GiB, 0.093 * GiB)] + [Fit(2 * GiB, 0.093 * GiB)] * 3
    assert r.even.batch_size == oracles.max_even_batch(truth, [23 * GiB] * 4)
    assert tuple(r.even.chunk_sizes) not in {tuple(p.chunk_sizes) for p in r.probes}
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert r.even.implied_by == (3, 4) and back.even.implied_by == r.even.implied_by
    assert "was not probed itself" in render_table(r)


def test_max_batch_dash_spelling_and_convex_cards():
    be = identical(q=3e-5 * GiB)
    r = tune(be, objective="max-batch")
    assert r.objective == "max_batch"
    assert_verified(r)
    assert len(be.calls) <= 12
    assert r.batch_size > r.even.batch_size
    nxt = [p for p in r.probes if p.batch_size > r.batch_size]
    assert all(not within_budget(r, p) for p in nxt)  # nothing larger was measured to fit


def test_max_batch_hint_too_large_halves():
    be = identical()
    r = tune(be, batch_size=4000, objective="max_batch")
    assert r.batch_size == 767
    assert_verified(r)


def test_max_batch_single_card():
    be = SyntheticBackend([24 * GiB], [2 * GiB], [0.1 * GiB], g=0.01 * GiB)
    r = tune(be, batch_size=64, objective="max_batch")
    assert r.batch_size == 190  # 2 + 0.11 * B <= 23
    assert_verified(r)


# ---- output and selection -----------------------------------------------------------------


def test_verbose_false_prints_nothing(capsys):
    tune(identical(), verbose=False)
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_verbose_shows_progress_on_stderr(capsys):
    tune(identical(), verbose=True)
    out, err = capsys.readouterr()
    # 4 probes of at most 12: the bar's total stays the most the search may run
    assert out == "" and "probing" in err and "4/12" in err and "4/4" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA GPUs")
def test_device_ids_without_gpus_raise():
    with pytest.raises(BackendUnavailableError) as e:
        Tuner(torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4), device_ids=[0, 1],
              verbose=False).fit()
    assert "GPUs 0, 1 were asked for" in str(e.value) and "simulate=" in str(e.value)


def test_arguments_are_checked():
    model, sample = torch.nn.Linear(4, 2), (lambda n: torch.randn(n, 4))
    with pytest.raises(UsageError):
        Tuner(model, sample, objective="fastest")
    with pytest.raises(UsageError):
        Tuner(model, sample, batch_size=0)
    with pytest.raises(UsageError):
        Tuner(model, sample, headroom="lots")
    with pytest.raises(UsageError):
        Tuner(model, sample, max_probes=2)
    with pytest.raises(UsageError):
        Tuner(model, sample, device_ids=[0], simulate="2x24GB", verbose=False).fit()
    assert Tuner(model, sample, headroom=0).headroom_bytes == 0


# ---- the fits' own figures --------------------------------------------------------------------

@pytest.mark.parametrize("objective", ["balance", "max_batch"])
def test_a_fits_max_error_is_over_every_probe_it_counts(objective):
    """On convex cards the line drawn through the two points nearest the split misses the
    far probes: its max error and its point count say so (probes.csv's figures)."""
    r = tune(identical(q=0.0004 * GiB), objective=objective)
    assert any(f.max_error_bytes > 0 for f in r.fits)
    for i, fit in enumerate(r.fits):
        counted = [p for p in r.probes if p.chunk_sizes[i] > 0]   # card 0 at 0: no replica
        errors = [abs(fit.predict(p.chunk_sizes[i], p.batch_size) - p.peak_bytes[i])
                  for p in counted]
        assert fit.points == len(counted)
        assert fit.max_error_bytes == pytest.approx(max(errors), abs=1)
