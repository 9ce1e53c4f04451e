"""``python -m benchmarks.gpu_table`` rebuilds the README's real-card table from committed files:
the H200 session's runs stopped at their time limit before writing their CSVs, so the table
comes from their logs."""

from __future__ import annotations

import os

from benchmarks.gpu_table import main, memory_table, reserved_rows, reserved_summary

FINAL = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "measured",
                     "h200-2026-11-27-final")


def _log_rows(name: str) -> list[str]:
    """The log's row lines, counted by hand: the lines that end in the verdict column."""
    with open(os.path.join(FINAL, name), encoding="utf-8") as f:
        return [line for line in f if line.rstrip().endswith((" yes", " no"))]


def test_the_memory_table_is_rebuilt_from_the_logs():
    lines = memory_table(FINAL)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert len(rows) == len(_log_rows("validate_gpu.txt")) == 19
    assert "| SegNet | fp32 | 4 | 222.1 MiB | +0.8% | +0.0% | -14.6% | -5.5% |" in rows
    assert any("rebuilt from the logs validate_gpu.txt and validate_reserved.txt" in line
               for line in lines)


def test_the_reserved_summary_counts_the_rows():
    rows, source = reserved_rows(FINAL)
    assert source == "validate_reserved.txt" and len(rows) == 19
    within = [r for r in rows if abs(float(r["err_reserved"])) <= 0.05]
    summary = reserved_summary(FINAL)
    assert summary[0] == f"reserved within 5%: {len(within)} of 19 rows; total use under in 10 of 19"
    assert len(within) == 12
    assert "HF-GPT2+cache fp32 batch 4, -9.0% of 2.4 GiB" in summary[1]


def test_an_empty_folder_says_the_data_is_absent(tmp_path, capsys):
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no memory rows" in out and "not there" in out
    assert "| MLP |" not in out
