"""Reports from a hand-built TuneResult: table, summary, files, plots (no tuner needed)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from dptune.backends.base import CATEGORIES, Device, ProbeResult
from dptune.errors import UsageError
from dptune.report import (plot_kinds, plot_result, probes_table, read_report, render_summary,
                           render_table, result_table, write_report)
from dptune.result.model import Fit, SplitFigures, TuneResult, imbalance
from dptune.units import GiB

ROOT = Path(__file__).resolve().parents[2]

# A synthetic DataParallel step on 4 x 24 GiB cards: every card holds a replica's weights and
# gradients and pays ACT bytes per sample; card 0 also holds the optimizer state and the
# outputs gathered from the whole batch.
W = int(1.5 * GiB)
ACT = int(0.25 * GiB)
INP = int(0.02 * GiB)
OUT = int(0.03 * GiB)
GATHER = int(0.05 * GiB)
HEADROOM = GiB


def _breakdown(card: int, chunk: int, batch: int) -> dict[str, int]:
    b = dict(weights=W, gradients=W, optimizer=0, activations=ACT * chunk, inputs=INP * chunk,
             outputs=OUT * chunk, other=64 * 2**20)
    if card == 0:
        b["optimizer"] = 2 * W
        b["outputs"] += GATHER * batch
    return b


def _peaks(chunks) -> tuple[tuple[int, ...], tuple[dict[str, int], ...]]:
    batch = sum(chunks)
    bd = tuple(_breakdown(i, c, batch) for i, c in enumerate(chunks))
    return tuple(sum(b.values()) for b in bd), bd


def _probe(chunks, purpose, devices, seconds=0.4) -> ProbeResult:
    peaks, bd = _peaks(chunks)
    oom = next((i for i, (p, d) in enumerate(zip(peaks, devices))
                if p > d.available_bytes), None)
    if oom is not None:  # the step stopped at the first card that ran out: lower bounds
        peaks = tuple(min(p, d.available_bytes) for p, d in zip(peaks, devices))
    return ProbeResult(chunk_sizes=tuple(chunks), peak_bytes=peaks, oom_device=oom,
                       breakdown=bd if oom is None else None, seconds=seconds, purpose=purpose,
                       reserved_bytes=tuple(p + 20 * 2**20 for p in peaks))


def make_result(objective: str = "balance", with_breakdown: bool = True) -> TuneResult:
    """A realistic result: 4 cards, probes (one out of memory), per-card fits, breakdowns."""
    devices = [Device(index=i, name="NVIDIA GeForce RTX 4090", total_bytes=24 * GiB,
                      context_bytes=300 * 2**20, used_bytes=2 * GiB if i == 3 else 0)
               for i in range(4)]
    budgets = [d.budget_bytes(HEADROOM) for d in devices]
    if objective == "balance":
        even_chunks, chunks, requested = (16, 16, 16, 16), (1, 22, 22, 19), 64
        probes = [_probe(even_chunks, "even split", devices),
                  _probe((4, 20, 20, 20), "second point for the fit", devices),
                  _probe(chunks, "verify", devices)]
    else:
        even_chunks, chunks, requested = (33, 33, 33, 33), (20, 65, 65, 58), None
        probes = [_probe((16, 16, 16, 16), "first point", devices),
                  _probe((4, 20, 20, 20), "second point for the fit", devices),
                  _probe((40, 40, 40, 40), "largest even split", devices),
                  _probe(even_chunks, "largest even split", devices),
                  _probe((24, 70, 70, 62), "verify", devices),
                  _probe(chunks, "verify", devices)]
    even_peaks, even_bd = _peaks(even_chunks)
    even = SplitFigures(chunk_sizes=even_chunks, peak_bytes=even_peaks,
                        imbalance=imbalance(even_peaks, budgets, even_chunks),
                        breakdown=even_bd if with_breakdown else None)
    peaks, bd = _peaks(chunks)
    fits = []
    for i in range(4):
        fixed = sum(_breakdown(i, 0, 0).values())
        fits.append(Fit(intercept_bytes=float(fixed), slope_bytes=float(ACT + INP + OUT),
                        batch_slope_bytes=float(GATHER if i == 0 else 0), max_error_bytes=2e6,
                        points=3))
    return TuneResult(
        objective=objective, backend="simulated", cluster="4x24GB (simulated)",
        model_name="TinyGPT", devices=devices, headroom_bytes=HEADROOM, budget_bytes=budgets,
        chunk_sizes=list(chunks), peak_bytes=list(peaks), even=even, probes=probes, fits=fits,
        breakdown=list(bd) if with_breakdown else None, requested_batch_size=requested,
        seconds=2.5,
        advice=["card 0 holds the optimizer state: give it fewer samples (gpu0_bsz=1)"],
        notes=["simulated: the CUDA context is counted as 300 MiB per card"],
    )


@pytest.fixture(params=["balance", "max_batch"])
def result(request) -> TuneResult:
    return make_result(request.param)


def test_fixture_is_consistent(result):
    assert result.even.batch_size > 0 and len(result.fits) == len(result.devices) == 4
    assert all(p <= b for p, b in zip(result.peak_bytes, result.budget_bytes))
    assert any(not p.feasible for p in result.probes) == (result.objective == "max_batch")


def test_result_table_has_bytes_per_card(result):
    df = result_table(result)
    assert list(df.index) == [0, 1, 2, 3]
    assert list(df["chunk"]) == result.chunk_sizes
    assert list(df["even_chunk"]) == list(result.even.chunk_sizes)
    assert list(df["peak_bytes"]) == result.peak_bytes
    assert list(df["budget_bytes"]) == result.budget_bytes
    assert df["share"].tolist() == pytest.approx(result.shares)


def test_render_table_balance():
    r = make_result("balance")
    text = render_table(r)
    lines = text.splitlines()
    assert "device" in lines[1] and "even split" in lines[1] and "dptune split" in lines[1]
    assert lines[2].startswith("0: NVIDIA GeForce RTX 4090")
    assert len(lines) == 2 + 4 + 3
    assert f"even {r.even.imbalance:.2f} -> dptune {r.imbalance:.2f}" in lines[-3]
    assert lines[-2].startswith("certified: ")
    # the probes carry reserved peaks: a line says what the reserved column is
    assert lines[-1].startswith("allocated / reserved: ") and "reserved" in lines[1]
    assert "max batch" not in text
    # str(result) is one line (the result does not import its renderer): it names the split
    # and where the table comes from
    assert "\n" not in str(r) and str(r.chunk_sizes) in str(r) and "render_table" in str(r)


def test_render_table_max_batch_shows_gain():
    r = make_result("max_batch")
    text = render_table(r)
    gain = r.batch_size / r.even.batch_size - 1
    assert f"max batch that fits: even 132 -> balanced 208 ({gain:+.0%})" in text
    assert "+58%" in text


def test_gain_is_printed_only_as_the_proven_range():
    """An open even bracket gives a range, or no figure at all when it is wide: never the
    upper end alone (a four-digit percentage from an even batch known only near the start)."""
    import dataclasses

    r = make_result("max_batch")
    r.certified = True
    e = r.even
    # closed bracket: one figure
    assert r.batch_gain is not None and r.batch_gain.low == r.batch_gain.high
    # open but narrow (132 to 135): the range, both ends
    r.even = dataclasses.replace(e, open_bracket=True, at_most=135)
    g = r.batch_gain
    assert g is not None and g.low == pytest.approx(208 / 135 - 1) and g.high == pytest.approx(208 / 132 - 1)
    assert f"even 132 to 135 -> balanced 208 ({g.low:+.1%} to {g.high:+.1%})" in render_table(r)
    # open and wide: the even split's largest batch is somewhere in 132..207: no figure
    r.even = dataclasses.replace(e, open_bracket=True, at_most=207)
    text = render_table(r)
    assert "gain not proven" in text and "%)" not in text.split("max batch that fits")[1].split("\n")[0]
    # nothing above measured and the answer uncertified: no lower end, no range
    r.even = dataclasses.replace(e, open_bracket=True, at_most=None)
    r.certified = False
    assert r.batch_gain is None and "gain not proven" in render_table(r)
    # certified: the even batch is at most the answer, so the gain is at least 0
    r.certified = True
    assert r.batch_gain is not None and r.batch_gain.low == 0.0


def test_render_table_marks_even_oom():
    r = make_result("balance")
    r.even = SplitFigures(chunk_sizes=r.even.chunk_sizes, peak_bytes=r.even.peak_bytes,
                          imbalance=r.even.imbalance, feasible=False, oom_device=0)
    text = render_table(r)
    assert "OOM" in text.splitlines()[2]
    assert "even split runs out of memory on 0: NVIDIA GeForce RTX 4090" in text


def test_probes_table_one_row_per_probe(result):
    df = probes_table(result)
    assert len(df) == result.num_probes
    assert list(df["chunk_1"]) == [p.chunk_sizes[1] for p in result.probes]
    assert list(df["peak_bytes_0"]) == [p.peak_bytes[0] for p in result.probes]
    assert list(df["purpose"]) == [p.purpose for p in result.probes]


def test_summary_is_markdown_with_everything(result):
    md = render_summary(result)
    assert md.startswith("# dptune report: TinyGPT on 4x24GB (simulated)")
    assert "card 0 holds the optimizer state" in md          # advice
    assert "counted as 300 MiB per card" in md               # notes
    assert f"probes: {result.num_probes} in 2.5 s" in md
    assert "## Fits" in md and "| device | even split |" in md
    assert "![peaks](peaks.png)" in md and "![fits](fits.png)" in md
    assert ("![max_batch](max_batch.png)" in md) == (result.objective == "max_batch")
    assert "![" not in render_summary(result, plots=())


def test_write_report_writes_every_file(tmp_path, result):
    out = write_report(result, tmp_path / "reports" / "run")
    assert out == tmp_path / "reports" / "run"
    expected = {"report.json", "probes.csv", "summary.md", "report.html", "peaks.png", "fits.png"}
    if result.objective == "max_batch":
        expected.add("max_batch.png")
    assert {p.name for p in out.iterdir()} == expected
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    import pandas as pd

    csv = pd.read_csv(out / "probes.csv")
    assert len(csv) == result.num_probes
    assert list(csv["peak_bytes_2"]) == [p.peak_bytes[2] for p in result.probes]
    oom = [p.oom_device for p in result.probes]
    assert [None if math.isnan(x) else int(x) for x in csv["oom_device"]] == oom
    assert (out / "summary.md").read_text() == render_summary(result)


def test_report_json_round_trips(tmp_path, result):
    out = write_report(result, tmp_path / "r", plots=False)
    data = json.loads((out / "report.json").read_text())
    assert data["version"] == 1 and data["chunk_sizes"] == result.chunk_sizes
    back = read_report(out)
    assert back == result
    # report.json: the result's dict plus the derived budget level and per-card memory_stats
    derived = {"budget_level", "memory_stats"}
    assert data["budget_level"] == "allocated" and len(data["memory_stats"]) == 4
    assert back.to_dict() == result.to_dict() == {k: v for k, v in data.items()
                                                  if k not in derived}
    assert read_report(out / "report.json") == result
    assert not (out / "peaks.png").exists()
    assert "![" not in (out / "summary.md").read_text()


def test_read_report_missing_folder_is_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no report at"):
        read_report(tmp_path / "nothing")


def test_plots_without_breakdown(tmp_path):
    r = make_result("balance", with_breakdown=False)
    fig = plot_result(r, "peaks")
    fig.savefig(tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
    labels = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    assert {"even split", "dptune split", "budget"} <= labels


def test_peaks_legend_names_categories():
    fig = plot_result(make_result("balance"), "peaks")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [c for c in CATEGORIES if c in labels] == [c for c in labels if c in CATEGORIES]
    assert {"weights", "gradients", "optimizer", "activations"} <= set(labels)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][0] == "0: NVIDIA GeForce RTX 4090"


def test_fits_has_one_subplot_per_card():
    fig = plot_result(make_result("max_batch"), "fits")
    titles = [a.get_title() for a in fig.axes if a.get_visible()]
    assert [t.splitlines()[0] for t in titles] == [f"{i}: NVIDIA GeForce RTX 4090"
                                                   for i in range(4)]
    # card 0's memory also grows with the whole batch, and its title says so
    assert titles[0].endswith("(memory also grows with the batch)") and "\n" not in titles[1]


def test_plot_into_given_axes(result):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    for kind in plot_kinds(result):
        ax.clear()
        assert plot_result(result, kind, ax=ax) is fig


def test_unknown_plot_kind():
    with pytest.raises(UsageError, match="unknown plot kind"):
        plot_result(make_result(), "pie")


def test_import_is_cheap():
    code = ("import sys, dptune.report; "
            "heavy = [m for m in ('matplotlib', 'pandas', 'torch') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_peaks_plot_marks_an_implied_even_split_as_upper_bounds():
    import dataclasses

    r = make_result("max_batch")
    plain = plot_result(r, "peaks").axes[0]
    r.even = dataclasses.replace(r.even, implied_by=(3,))
    ax = plot_result(r, "peaks").axes[0]
    ticks = [t.get_text() for t in ax.get_xticklabels(minor=True)]
    even_ticks = [t for t in ticks if t.startswith("even")]
    assert even_ticks and all(t.splitlines()[-1].startswith("<= ") for t in even_ticks)
    assert not any(t.splitlines()[-1].startswith("<=") for t in ticks if t.startswith("dptune"))
    assert "not probed, upper bounds from probe #3" in " ".join(ax.get_title().split())
    assert "not probed" not in " ".join(plain.get_title().split())


def test_a_probe_over_budget_but_within_memory_is_not_within_budget(tmp_path):
    """The issue's case: a probe that ran (no OOM) over the headroom is what the search
    counts as not fitting; the table, the summary and probes.csv say so and by how much."""
    import dataclasses

    import pandas as pd

    r = make_result("max_batch")
    budget1 = r.budget_bytes[1]
    over = ProbeResult(chunk_sizes=(20, 66, 65, 58), purpose="one more sample",
                       peak_bytes=(r.peak_bytes[0], budget1 + 5 * 2**20, budget1 - 2**20,
                                   r.peak_bytes[3]))
    assert over.feasible and over.peak_bytes[1] < r.devices[1].total_bytes   # ran, fits the card
    r = dataclasses.replace(r, probes=[*r.probes, over])
    check = r.budget_check(over)
    assert (check.within_budget, check.margin_bytes, check.card) == (False, -5 * 2**20, 1)
    md = render_summary(r)
    assert f"| {len(r.probes)} | one more sample |" in md
    assert "no: card 1 over by 5.0 MiB" in md.splitlines()[md.splitlines().index(
        next(line for line in md.splitlines() if "one more sample" in line))]
    out = write_report(r, tmp_path / "r", plots=False)
    csv = pd.read_csv(out / "probes.csv")
    last = csv.iloc[-1]
    assert not last["within_budget"] and last["margin_bytes"] == -5 * 2**20
    assert last["margin_card"] == 1 and math.isnan(last["oom_device"])
    # every other probe: within budget exactly when every card in use is at or under budget
    for row, p in zip(csv.itertuples(), r.probes):
        used = [i for i, c in enumerate(p.chunk_sizes) if i == 0 or c > 0]
        want = p.feasible and all(p.peak_bytes[i] <= r.budget_bytes[i] for i in used)
        assert row.within_budget == want


def test_probes_are_numbered_from_one_everywhere(tmp_path):
    """probes.csv, the summary's table and the even split's "probe(s) #k" use one numbering:
    #k is the k-th probe run."""
    import dataclasses

    import pandas as pd

    r = make_result("max_batch")
    k = next(k for k, p in enumerate(r.probes, start=1) if p.chunk_sizes == r.even.chunk_sizes)
    r = dataclasses.replace(r, even=dataclasses.replace(r.even, implied_by=(k,)))
    out = write_report(r, tmp_path / "r", plots=False)
    assert list(pd.read_csv(out / "probes.csv")["probe"]) == list(range(1, r.num_probes + 1))
    md = render_summary(r)
    row = next(line for line in md.splitlines() if line.startswith(f"| {k} |"))
    assert str(list(r.even.chunk_sizes)) in row          # row k is the probe named #k
    assert f"probe(s) #{k} measured" in md and f"probe(s) #{k} measured" in render_table(r)
    assert f"upper bounds from probe #{k}" in " ".join(plot_result(r, "peaks").axes[0]
                                                      .get_title().split())
