"""The README's real-card table from one GPU session's CSVs:
``python -m benchmarks.gpu_table DIR`` (DIR holds validate_gpu.csv, validate_reserved.csv and
validate_time.csv as ``benchmarks/gpu_session.sh`` writes them; a missing one is left out).

Prints markdown: per row of validate_gpu, the real allocated peak, the estimate's and the probe's
error; per row of validate_reserved, the reserved and total-use errors; per model of
validate_time, the median error of the step-time estimate.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
from typing import Optional


def _read(path: str) -> list[dict[str, str]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _pct(value: Optional[str]) -> str:
    return "—" if value in (None, "") else f"{100 * float(value):+.1f}%"


def memory_table(folder: str) -> list[str]:
    """One markdown row per validate_gpu row, with validate_reserved's errors where it has the row."""
    from dptune.units import format_bytes

    reserved = {(r["model"], r["step"], r["batch_size"]): r for r in _read(os.path.join(folder, "validate_reserved.csv"))}
    lines = ["| model | step | batch | real allocated | estimate, allocated | probe, allocated "
             "| estimate, reserved | estimate, total use |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in _read(os.path.join(folder, "validate_gpu.csv")):
        res = reserved.get((r["model"], r["step"], r["batch_size"]), {})
        lines.append(f"| {r['model']} | {r['step']} | {r['batch_size']} | {format_bytes(int(r['real_bytes']))} "
                     f"| {_pct(r['estimate_rel_error'])} | {_pct(r['probe_rel_error'])} "
                     f"| {_pct(res.get('err_reserved'))} | {_pct(res.get('err_total'))} |")
    return lines


def time_table(folder: str) -> list[str]:
    """One markdown row per model of validate_time: batches and the median error."""
    rows = _read(os.path.join(folder, "validate_time.csv"))
    lines = ["| model | batches | real step (ms) | median error of the estimate |", "|---|---|---|---:|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        errs = [float(r["error"]) for r in mine]
        batches = ", ".join(r["batch"] for r in mine)
        steps = ", ".join(f"{1e3 * float(r['real_s']):.1f}" for r in mine)
        lines.append(f"| {model} | {batches} | {steps} | {100 * statistics.median(errs):+.0f}% |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not os.path.isdir(args[0]):
        print("usage: python -m benchmarks.gpu_table DIR (a folder of a GPU session's CSVs)")
        return 2
    print("\n".join(memory_table(args[0])))
    print()
    print("\n".join(time_table(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
