"""The report's plots at the size they are written: no clipped or overlapping text (checked
with matplotlib's own text extents, tests/support/plot_check.py), and one "highest peak" per report."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dptune.backends.base import Device
from dptune.report import figure_dpi, highest_peak, plot_kinds, plot_result
from dptune.result.model import TuneResult
from plot_check import text_problems
from tests.report.test_report import make_result


def scaled(r: TuneResult, k: int) -> TuneResult:
    """``r`` with every chunk ``k`` times larger and the per-sample slopes ``k`` times smaller
    (the same memory, counted in far more, far smaller samples: 8-digit sample counts)."""
    return dataclasses.replace(
        r, chunk_sizes=[c * k for c in r.chunk_sizes],
        even=dataclasses.replace(r.even, chunk_sizes=tuple(c * k for c in r.even.chunk_sizes)),
        probes=[dataclasses.replace(p, chunk_sizes=tuple(c * k for c in p.chunk_sizes))
                for p in r.probes],
        fits=[dataclasses.replace(f, slope_bytes=f.slope_bytes / k,
                                  batch_slope_bytes=f.batch_slope_bytes / k) for f in r.fits])


def cards(r: TuneResult, n: int) -> TuneResult:
    """``r`` on ``n`` cards: card 0 as it is, the others repeating cards 1 to 3."""
    def per_card(xs):
        return [xs[0] if i == 0 else xs[1 + (i - 1) % 3] for i in range(n)]

    devices = [Device(index=i, name=d.name, total_bytes=d.total_bytes, used_bytes=d.used_bytes)
               for i, d in enumerate(per_card(r.devices))]
    even = r.even
    return dataclasses.replace(
        r, devices=devices, chunk_sizes=per_card(r.chunk_sizes), peak_bytes=per_card(r.peak_bytes),
        budget_bytes=per_card(r.budget_bytes), fits=per_card(r.fits),
        breakdown=per_card(r.breakdown) if r.breakdown else None,
        even=dataclasses.replace(
            even, chunk_sizes=tuple(per_card(even.chunk_sizes)),
            peak_bytes=tuple(per_card(even.peak_bytes)),
            breakdown=tuple(per_card(even.breakdown)) if even.breakdown else None),
        probes=[dataclasses.replace(p, chunk_sizes=tuple(per_card(p.chunk_sizes)),
                                    peak_bytes=tuple(per_card(p.peak_bytes)), breakdown=None,
                                    reserved_bytes=None) for p in r.probes])


LONG_NAME = "transformers.models.llama.LlamaForCausalLM-with-a-long-name"

#: the cases the issue found: 8-digit counts under peaks.png's bars, max_batch.png's title
#: clipped, the fits legend wider than a 2-card figure
FOUND = [
    ("balance", lambda r: scaled(r, 1_000_003), "peaks"),
    ("max_batch", lambda r: dataclasses.replace(r, model_name=LONG_NAME), "max_batch"),
    ("max_batch", lambda r: cards(r, 2), "fits"),
    ("max_batch", lambda r: cards(r, 8), "max_batch"),
]


def check(r: TuneResult, kind: str) -> list[str]:
    fig = plot_result(r, kind)
    return text_problems(fig, figure_dpi(fig))


@pytest.mark.parametrize("objective, change, kind", FOUND)
def test_plots_found_faulty_have_no_clipped_or_overlapping_text(objective, change, kind):
    assert check(change(make_result(objective)), kind) == []


VARIANTS = {
    "plain": lambda r: r,
    "8-digit counts": lambda r: scaled(r, 1_000_003),
    "long model name": lambda r: dataclasses.replace(r, model_name=LONG_NAME),
    "2 cards": lambda r: cards(r, 2),
    "8 cards": lambda r: cards(r, 8),
    "8 cards, 8-digit counts": lambda r: scaled(cards(r, 8), 1_000_003),
    "30 cards": lambda r: cards(r, 30),
}


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["balance", "max_batch"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_plot_has_no_clipped_or_overlapping_text(objective, variant):
    r = VARIANTS[variant](make_result(objective))
    problems = {kind: check(r, kind) for kind in plot_kinds(r)}
    assert problems == {kind: [] for kind in plot_kinds(r)}


def test_the_checker_finds_overlap_and_clipping():
    """The helper itself: two texts on top of each other, one past the right edge."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))
    fig.text(0.1, 0.5, "first text")
    fig.text(0.12, 0.5, "second text")
    fig.text(0.9, 0.1, "past the edge")
    problems = text_problems(fig, 100)
    assert any(p.startswith("overlap: 'first text' and 'second text'") for p in problems)
    assert any(p.startswith("clipped: 'past the edge'") for p in problems)
    assert len(problems) == 2


def _quoted_share(fig) -> set[str]:
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]
    return {m for t in texts for m in re.findall(r"the highest peak is (\d+%)", " ".join(t.split()))}


def test_one_highest_peak_per_report():
    """Budgets off the scale: peaks.png and fits.png quote the same highest peak, the
    highest over every probe and both splits (an OOM probe's lower bound included)."""
    r = make_result("max_batch")
    big = 1000 * 2**30
    r = dataclasses.replace(r, budget_bytes=[big] * 4, devices=[
        dataclasses.replace(d, total_bytes=big + 2**30, used_bytes=0) for d in r.devices])
    top = max(max(p.peak_bytes) for p in r.probes)
    assert top > max(max(r.peak_bytes), max(r.even.peak_bytes))   # a probe holds the top
    assert highest_peak(r) == top
    expected = {f"{top / big:.0%}"}
    assert _quoted_share(plot_result(r, "peaks")) == expected
    assert _quoted_share(plot_result(r, "fits")) == expected
