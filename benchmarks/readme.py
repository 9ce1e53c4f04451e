"""Write the benchmark table of the docs (docs/benchmarks.md) from ``reports/benchmarks/results.csv``.

``python -m benchmarks.readme [--csv PATH] [--readme PATH]`` replaces what lies between the
markers ``<!-- benchmarks:start -->`` and ``<!-- benchmarks:end -->`` in that page with the
headline table and the quality summary rendered from the benchmark output, so the table is
never edited by hand. ``make bench`` runs it after the benchmarks.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
from typing import Any, Optional, Sequence

from benchmarks.run import headline_from_csv

__all__ = ["START", "END", "render", "update", "main"]

START = "<!-- benchmarks:start -->"
END = "<!-- benchmarks:end -->"


def _summary(rows: list[dict[str, Any]]) -> str:
    ok = [r for r in rows if r.get("max_batch") not in ("", "0") and r.get("balance_split")]
    if not ok:
        return "No row has both dptune results."
    gaps = [int(r["max_batch_gap_samples"]) for r in ok]
    dists = [int(r["balance_distance_samples"]) for r in ok if r.get("balance_distance_samples") != ""]
    cert = sum(str(r.get("max_batch_certified")).lower() == "true" for r in ok)
    below = [r for r in ok if int(r["max_batch"]) < int(r["even_max_batch"])]
    probes = sorted(int(r["max_batch_probes"]) for r in ok)
    bal = sorted(int(r["balance_probes"]) for r in ok)
    return (f"Over {len(ok)} model x cluster cases: dptune's largest batch is {min(gaps)}..{max(gaps)} "
            f"samples short of the exhaustive optimum and certified in {cert} of {len(ok)}; it is "
            f"below the even split's in {len(below)}; its balanced split is "
            f"{min(dists, default=0)}..{max(dists, default=0)} sample(s) per card from an optimal one. "
            f"Probes (counting the even split's baseline and its largest batch): max_batch "
            f"{probes[0]}..{probes[-1]} (median {probes[len(probes) // 2]}), balance "
            f"{bal[0]}..{bal[-1]} (median {bal[len(bal) // 2]}).")


def render(rows: list[dict[str, Any]]) -> str:
    return headline_from_csv(rows) + "\n\n" + _summary(rows)


def update(readme: pathlib.Path, rows: list[dict[str, Any]]) -> None:
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        raise SystemExit(f"{readme}: the markers {START} and {END} are missing")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{render(rows)}\n{END}{tail}", encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.readme", description=__doc__)
    p.add_argument("--csv", default="reports/benchmarks/results.csv")
    p.add_argument("--readme", default="docs/benchmarks.md")
    args = p.parse_args(argv)
    with open(args.csv, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    update(pathlib.Path(args.readme), rows)
    print(f"wrote the benchmark table of {len(rows)} case(s) into {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
