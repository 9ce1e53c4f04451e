"""The README's real-card table from one GPU session's files:
``python -m benchmarks.gpu_table DIR`` (DIR holds validate_gpu.csv, validate_reserved.csv and
validate_time.csv as ``benchmarks/gpu_session.sh`` writes them).

Prints markdown: per row of validate_gpu, the real allocated peak, the estimate's and the probe's
error; per row of validate_reserved, the reserved and total-use errors; per model of
validate_time, the median error of the step-time estimate.

Where a CSV is missing (a run stopped at its time limit writes its CSV only at the end) the
table is rebuilt from the run's log beside it (validate_gpu.txt, validate_reserved.txt: one
line per row, figures rounded as the log prints them, errors to 0.1%), and says so; where
neither is there it says that the data is absent instead of printing an empty table.
"""

from __future__ import annotations

import csv
import os
import re
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


_SIZE = r"[\d.]+ (?:B|KiB|MiB|GiB|TiB)"
_PCT = r"[+-]\d+(?:\.\d+)?%"
# validate_gpu.txt: model, step, batch, real, probe, estimate, estimate's error, probe's error, ok
_GPU_ROW = re.compile(rf"^(?P<model>\S+)\s+(?P<step>\S.*?)\s+(?P<batch>\d+)\s+(?P<real>{_SIZE})\s+"
                      rf"(?P<probe>{_SIZE})\s+(?P<estimate>{_SIZE})\s+(?P<est>{_PCT})\s+"
                      rf"(?P<prb>{_PCT})\s+(?:yes|no)\s*$")
# validate_reserved.txt: model, step, batch, then allocated/reserved/total as real/estimate (error)
_RESERVED_ROW = re.compile(rf"^(?P<model>\S+)\s+(?P<step>\S.*?)\s+(?P<batch>\d+)\s+"
                           rf"allocated {_SIZE}/{_SIZE} \({_PCT}\)\s+"
                           rf"reserved (?P<real_reserved>{_SIZE})/{_SIZE} \((?P<reserved>{_PCT})\)\s+"
                           rf"total {_SIZE}/{_SIZE} \((?P<total>{_PCT})\)\s*$")


def _fraction(pct: str) -> str:
    return str(float(pct.rstrip("%")) / 100)


def _rows_from_log(path: str, row: "re.Pattern[str]") -> list[re.Match]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [m for m in map(row.match, f.read().splitlines()) if m is not None]


def gpu_rows(folder: str) -> tuple[list[dict[str, str]], str]:
    """validate_gpu's rows (its CSV, else its log) and where they came from."""
    rows = _read(os.path.join(folder, "validate_gpu.csv"))
    if rows:
        return rows, "validate_gpu.csv"
    from dptune.units import parse_bytes

    found = _rows_from_log(os.path.join(folder, "validate_gpu.txt"), _GPU_ROW)
    return [{"model": m["model"], "step": m["step"], "batch_size": m["batch"],
             "real_bytes": str(parse_bytes(m["real"].replace(" ", ""))),
             "estimate_rel_error": _fraction(m["est"]), "probe_rel_error": _fraction(m["prb"])}
            for m in found], "validate_gpu.txt"


def reserved_rows(folder: str) -> tuple[list[dict[str, str]], str]:
    """validate_reserved's rows (its CSV, else its log) and where they came from."""
    rows = _read(os.path.join(folder, "validate_reserved.csv"))
    if rows:
        return rows, "validate_reserved.csv"
    found = _rows_from_log(os.path.join(folder, "validate_reserved.txt"), _RESERVED_ROW)
    return [{"model": m["model"], "step": m["step"], "batch_size": m["batch"],
             "real_reserved": m["real_reserved"], "err_reserved": _fraction(m["reserved"]),
             "err_total": _fraction(m["total"])} for m in found], "validate_reserved.txt"


def memory_table(folder: str) -> list[str]:
    """One markdown row per validate_gpu row, with validate_reserved's errors where it has the row."""
    from dptune.units import format_bytes

    gpu, gpu_source = gpu_rows(folder)
    res_rows, res_source = reserved_rows(folder)
    if not gpu:
        return [f"(no memory rows: {folder} has neither validate_gpu.csv nor a validate_gpu.txt "
                "with rows; the session's memory data is not there)"]
    reserved = {(r["model"], r["step"], r["batch_size"]): r for r in res_rows}
    lines = ["| model | step | batch | real allocated | estimate, allocated | probe, allocated "
             "| estimate, reserved | estimate, total use |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in gpu:
        res = reserved.get((r["model"], r["step"], r["batch_size"]), {})
        lines.append(f"| {r['model']} | {r['step']} | {r['batch_size']} | {format_bytes(int(r['real_bytes']))} "
                     f"| {_pct(r['estimate_rel_error'])} | {_pct(r['probe_rel_error'])} "
                     f"| {_pct(res.get('err_reserved'))} | {_pct(res.get('err_total'))} |")
    sources = [src for src, rows in ((gpu_source, gpu), (res_source, res_rows))
               if rows and src.endswith(".txt")]
    if sources:
        lines.append(f"\n(rebuilt from the log{'s' if len(sources) > 1 else ''} "
                     f"{' and '.join(sources)}: the run wrote no CSV; figures as the log rounds them)")
    if not res_rows:
        lines.append("\n(no reserved rows: neither validate_reserved.csv nor validate_reserved.txt "
                     "has any)")
    return lines


def reserved_summary(folder: str) -> list[str]:
    """The reserved level's misses: rows within 5%, and the largest shortfall in bytes (the
    real reserved peak times the error; from a log, a range, as its figures are rounded)."""
    rows, _ = reserved_rows(folder)
    if not rows:
        return []
    within = sum(abs(float(r["err_reserved"])) <= 0.05 for r in rows)
    under = sum(float(r["err_total"]) < 0 for r in rows)
    lines = [f"reserved within 5%: {within} of {len(rows)} rows; total use under in {under} of "
             f"{len(rows)}"]
    short = [r for r in rows if float(r["err_reserved"]) < 0 and r.get("real_reserved")]
    if short:
        from dptune.units import format_bytes, parse_bytes

        def miss(r: dict[str, str], ends: float) -> float:
            text = r["real_reserved"]
            value, unit = float(text.split()[0]), text.split()[1]
            half = 0.05 if "." in text.split()[0] else 0.5         # the log's rounding
            return -float(r["err_reserved"]) * (value + ends * half) * parse_bytes(f"1{unit}")

        worst = max(short, key=lambda r: miss(r, 0))
        lines.append(f"largest reserved shortfall: {worst['model']} {worst['step']} batch "
                     f"{worst['batch_size']}, {_pct(worst['err_reserved'])} of {worst['real_reserved']}: "
                     f"{format_bytes(int(miss(worst, -1)))} to {format_bytes(int(miss(worst, 1)))}")
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
    summary = reserved_summary(args[0])
    if summary:
        print()
        print("\n".join(summary))
    print()
    print("\n".join(time_table(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
