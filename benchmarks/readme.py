"""Write the benchmark table of the docs (docs/benchmarks.md) from ``reports/benchmarks/results.csv``.

``python -m benchmarks.readme [--csv PATH] [--readme PATH]`` replaces what lies between the
markers ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->`` in that page with the
headline table and the quality summary rendered from the benchmark output, so the table is
never edited by hand. ``make bench`` runs it after the benchmarks.

``python -m benchmarks.readme --level reserved`` writes the reserved-level table
(``reports/benchmarks/results-reserved.csv``, from ``python -m benchmarks --level reserved``,
see :mod:`benchmarks.levels`) between ``<!-- benchmarks-reserved:start -->`` and
``<!-- benchmarks-reserved:end -->``; the cases of the grid with no row read "not run".
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
from typing import Any, Optional, Sequence

from benchmarks.run import headline_from_csv

__all__ = ["START", "END", "markers", "render", "render_level", "update", "main"]

START = "<!-- benchmarks:start -->"
END = "<!-- benchmarks:end -->"


def markers(level: str) -> tuple[str, str]:
    """The page's markers of the table at ``level`` (the allocated one keeps the plain names)."""
    if level == "allocated":
        return START, END
    return f"<!-- benchmarks-{level}:start -->", f"<!-- benchmarks-{level}:end -->"


def _summary(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r.get("max_batch") not in ("", "0") and r.get("balance_split")]
    if not ok:
        return "No row has both dptune results."
    gaps = [int(r["max_batch_gap_samples"]) for r in ok]
    measured = [r for r in ok if r.get("balance_distance_samples") != ""]
    kept = [r for r in measured if r.get("balance_split") == r.get("even_split")]
    dists = [int(r["balance_distance_samples"]) for r in measured if r not in kept]
    cert = sum(str(r.get("max_batch_certified")).lower() == "true" for r in ok)
    below = [r for r in ok if int(r["max_batch"]) < int(r["even_max_batch"])]
    probes = sorted(int(r["max_batch_probes"]) for r in ok)
    bal = sorted(int(r["balance_probes"]) for r in ok)
    return (f"Over {len(ok)} model x cluster cases: dptune's largest batch is {min(gaps)}..{max(gaps)} "
            f"samples short of the exhaustive optimum and certified in {cert} of {len(ok)}; it is "
            f"below the even split's in {len(below)}; its balanced split is "
            f"{min(dists, default=0)}..{max(dists, default=0)} sample(s) per card from an optimal one "
            f"where it moved the even split, and the even split is kept in {len(kept)} (within the "
            f"tolerance of the balanced one: 1 probe). "
            f"Probes (counting the even split's baseline and its largest batch): max_batch "
            f"{probes[0]}..{probes[-1]} (median {probes[len(probes) // 2]}), balance "
            f"{bal[0]}..{bal[-1]} (median {bal[len(bal) // 2]}).")


def render(rows: list[dict[str, Any]]) -> str:
    return headline_from_csv(rows) + "\n\n" + _summary(rows)


def render_level(rows: list[dict[str, Any]]) -> str:
    """The table of ``results-<level>.csv`` rows, every case of the grid listed, and its summary."""
    from benchmarks import levels

    cases = levels.all_cases()
    return levels.level_table(rows, cases) + "\n\n" + levels.summary(rows, cases)


def update(readme: pathlib.Path, rows: list[dict[str, Any]], level: str = "allocated") -> None:
    start, end = markers(level)
    text = readme.read_text(encoding="utf-8")
    if start not in text or end not in text:
        raise SystemExit(f"{readme}: the markers {start} and {end} are missing")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    body = render(rows) if level == "allocated" else render_level(rows)
    readme.write_text(f"{head}{start}\n{body}\n{end}{tail}", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    p.add_argument("--level", choices=["allocated", "reserved"], default="allocated",
                   help="which table: allocated (results.csv) or reserved (results-reserved.csv)")
    p.add_argument("--csv", default=None, help="default: reports/benchmarks/results.csv, or "
                                               "results-reserved.csv with --level reserved")
    p.add_argument("--readme", default="docs/benchmarks.md")
    args = p.parse_args(argv)
    path = args.csv or ("reports/benchmarks/results.csv" if args.level == "allocated"
                        else f"reports/benchmarks/results-{args.level}.csv")
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    update(pathlib.Path(args.readme), rows, args.level)
    print(f"wrote the {args.level}-level benchmark table of {len(rows)} case(s) into {args.readme}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
