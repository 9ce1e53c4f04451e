"""The plots agree with their numbers, read from the figures' own artists (matplotlib's data,
not pixels): in peaks.png the budget's fixed costs (NCCL's buffers, what the reserved level
adds to the reserved peak) are a segment of the bar, so the bar ends at the peak the budget
was checked on; the total use is a marker read against the card's memory; lengths.png starts
both axes at 0 and keeps identical cards apart. Also the certificate's wording for a largest
batch, and an edited budget_level refused by `dptune show`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dptune.errors import ReportError
from dptune.lengths.plan import BucketPlan, LengthPlan
from dptune.lengths.render import lengths_figure
from dptune.report import plot_result, read_report, render_summary, write_report
from dptune.search.observations import Bracket
from dptune.units import GiB
from tests.report.test_report_levels import best_probe, reserved_result


def _rects(ax, gid=None):
    from matplotlib.patches import Rectangle

    return [p for p in ax.patches if isinstance(p, Rectangle) and (gid is None or p.get_gid() == gid)]


@pytest.mark.parametrize("objective", ["balance", "max_batch"])
def test_peaks_bars_end_at_the_checked_peak_with_the_fixed_costs_as_a_segment(objective):
    r = reserved_result(objective)
    p = best_probe(r)
    assert any(pk > rs for pk, rs in zip(p.peak_bytes, p.reserved_bytes))   # NCCL is counted
    ax = plot_result(r, "peaks").axes[0]
    fixed = sorted(_rects(ax, "fixed-costs"), key=lambda b: b.get_x())
    # the even split's bars (left of each card's tick) and dptune's (right): dptune's are the
    # second of each pair
    ours = [b for b in fixed if b.get_x() + b.get_width() / 2 > round(b.get_x())]
    assert len(ours) == 4
    for i, bar in enumerate(ours):
        assert bar.get_y() == pytest.approx(p.reserved_bytes[i] / GiB)
        assert bar.get_y() + bar.get_height() == pytest.approx(r.peak_bytes[i] / GiB)
        budget = r.budget_bytes[i] / GiB
        if r.peak_bytes[i] == r.budget_bytes[i]:
            assert bar.get_y() + bar.get_height() == pytest.approx(budget)


def test_a_card_at_its_whole_budget_reaches_the_budget_line():
    r = reserved_result("balance")
    budgets = list(r.budget_bytes)
    budgets[2] = r.peak_bytes[2]
    r = dataclasses.replace(r, budget_bytes=budgets)
    ax = plot_result(r, "peaks").axes[0]
    tops = [b.get_y() + b.get_height() for b in _rects(ax, "fixed-costs") if 2 <= b.get_x() < 2.5]
    assert tops == [pytest.approx(budgets[2] / GiB)]          # dptune's bar on card 2
    budget_lines = [s for c in ax.collections if c.get_linestyle()[0][1] is not None
                    for s in c.get_segments() if s[0][0] < 2.2 < s[1][0] and s[0][1] == s[1][1]]
    assert any(s[0][1] == pytest.approx(budgets[2] / GiB) for s in budget_lines)


def test_total_use_is_a_marker_read_against_the_card_memory():
    r = reserved_result("balance")
    p = best_probe(r)
    ax = plot_result(r, "peaks").axes[0]
    marks = [ln for ln in ax.lines if ln.get_gid() == "total-use"]
    assert len(marks) == 8    # each card, both splits
    ours = sorted((ln for ln in marks if ln.get_xdata()[0] % 1 > 0.1 and
                   ln.get_xdata()[0] % 1 < 0.5), key=lambda ln: ln.get_xdata()[0])
    assert [ln.get_ydata()[0] for ln in ours] == pytest.approx([t / GiB for t in p.total_bytes])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "total use (nvidia-smi), against the card's memory" in labels
    assert "budget's fixed costs (NCCL's buffers)" in labels and "card memory" in labels


def test_certified_says_what_a_largest_batch_needs():
    r = reserved_result("max_batch")
    B = r.batch_size
    r = dataclasses.replace(r, certified=True, brackets=[
        Bracket(card=0, lo=B, hi=B + 1, what="batch"), Bracket(card=1, lo=r.chunk_sizes[1], hi=None)])
    line = next(x for x in render_summary(r).splitlines() if x.startswith("- certified"))
    assert line == (f"- certified: yes (one more sample does not fit: the whole batch's bracket "
                    f"[{B}, {B + 1}) is closed, which is all a largest batch needs; the cards' own "
                    f"brackets need not close: card 1 [{r.chunk_sizes[1]}, ?) open); at the "
                    "reserved level this holds if the figure does not fall as the batch grows, "
                    "which the probes checked only where they measured (the caching allocator's "
                    "fragmentation can break it: expandable_segments:True makes it hold)")
    # at the allocated level the certificate needs no such word
    alloc = dataclasses.replace(r, probes=[dataclasses.replace(p, allocated_peak_bytes=None)
                                           for p in r.probes])
    line = next(x for x in render_summary(alloc).splitlines() if x.startswith("- certified"))
    assert line.endswith("card 1 [" + str(r.chunk_sizes[1]) + ", ?) open)")


def test_an_edited_budget_level_is_refused(tmp_path):
    r = reserved_result("balance")
    folder = write_report(r, tmp_path / "rep", plots=False)
    assert read_report(folder).chunk_sizes == r.chunk_sizes
    d = json.loads((folder / "report.json").read_text())
    d["budget_level"] = "allocated"
    (folder / "report.json").write_text(json.dumps(d))
    with pytest.raises(ReportError, match="budget_level is 'allocated' but its probes were "
                                          "checked at the 'reserved' level"):
        read_report(folder)


def test_lengths_png_axes_from_zero_and_identical_cards_apart():
    buckets = (BucketPlan(0, 128, 500, (2422, 2422, 1200), (1, 1, 1), 0, True, 5),
               BucketPlan(128, 512, 300, (1173, 1173, 600), (1, 1, 1), 0, True, 4))
    plan = LengthPlan(buckets=buckets, devices=("24GB", "24GB", "12GB"),
                      budget_bytes=(20 * GiB, 20 * GiB, 10 * GiB), cluster="c", model_name="m")
    ax = lengths_figure(plan).axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_xlim()[0] == 0
    assert ax.get_ylim()[1] > 2422
    markers = {ln.get_gid(): ln for ln in ax.lines}
    a, b = markers["card-0"], markers["card-1"]
    assert a.get_marker() != b.get_marker()
    assert list(a.get_ydata()) != list(b.get_ydata())     # nudged apart: both visible
    assert max(abs(x - y) for x, y in zip(a.get_ydata(), b.get_ydata())) < 0.02 * 2422
    stairs = [p for p in ax.patches if p.get_label().startswith("card ")]
    assert len({p.get_linestyle() for p in stairs[:2]}) == 2


def test_identical_replicas_share_one_line_whose_error_is_over_every_probe():
    """Cards 1 and 2 (the same card, no other process, not the output card) run identical
    replicas: fits.png draws one line for both, through all their probes within budget, and
    the fits table's max error is over every one of them (numpy's least squares the oracle)."""
    import numpy as np

    r = reserved_result("max_batch")
    fig = plot_result(r, "fits")
    lines = {ax.get_title().split("\n")[0]: ax.lines[0] for ax in fig.axes if ax.lines}
    names = [f"{d.index}: {d.name}" for d in r.devices]
    one, two = lines[names[1]], lines[names[2]]
    assert list(one.get_ydata()) == list(two.get_ydata())
    pts = [(p.chunk_sizes[i], p.peak_bytes[i]) for p in r.probes for i in (1, 2)
           if p.feasible and p.chunk_sizes[i] > 0]
    slope, intercept = np.polyfit([c for c, _ in pts], [m for _, m in pts], 1)
    x0, x1 = one.get_xdata()[:2]
    assert one.get_ydata()[0] == pytest.approx((intercept + slope * x0) / GiB, rel=1e-9)
    assert one.get_ydata()[1] == pytest.approx((intercept + slope * x1) / GiB, rel=1e-9)
    err = max(abs(intercept + slope * c - m) for c, m in pts)
    from dptune.units import format_bytes

    rows = [ln for ln in render_summary(r).splitlines() if ln.startswith(("| 1:", "| 2:"))
            and ln.count("|") == 7]
    assert len(rows) == 2 and rows[0].split("|")[2:] == rows[1].split("|")[2:]
    assert rows[0].split("|")[5].strip() == format_bytes(err)
    assert rows[0].split("|")[6].strip() == str(len(pts))
    assert "cards 1, 2 run identical replicas" in render_summary(r)
