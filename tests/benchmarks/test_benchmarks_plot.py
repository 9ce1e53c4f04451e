"""reports/benchmarks/summary.png has no overlapping or clipped text ("probes per search" had
its model names run together): drawn from the committed results.csv at its written size."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from plot_check import text_problems

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "reports" / "benchmarks" / "results.csv"


def rows_from_csv(path: Path) -> list:
    """The benchmark rows, with the fields the summary plot reads, from results.csv."""
    from benchmarks.run import Row

    rows = []
    with open(path, newline="", encoding="utf-8") as f:
        for d in csv.DictReader(f):
            rows.append(Row(model=d["model"], scenario=d["scenario"], cards=int(d["cards"]),
                            batchnorm=d["batchnorm"] == "True", headroom_bytes=0, budgets=[],
                            even_max_batch=int(d["even_max_batch"]), max_batch=int(d["max_batch"]),
                            opt_max_batch=int(d["opt_max_batch"]),
                            bal_probes=int(d["balance_probes"]),
                            max_probes=int(d["max_batch_probes"]),
                            lightning_probes=int(d["lightning_probes"]),
                            grid_points=int(d["grid_points"])))
    return rows


@pytest.mark.slow    # imports the benchmark harness (torch, the tuner) and draws 8 panels: ~13 s
def test_summary_plot_has_no_overlapping_or_clipped_text():
    from benchmarks.run import SUMMARY_DPI, summary_figure

    rows = rows_from_csv(RESULTS)
    assert len({r.model for r in rows}) >= 6          # the crowded panel is exercised
    assert text_problems(summary_figure(rows), SUMMARY_DPI) == []
