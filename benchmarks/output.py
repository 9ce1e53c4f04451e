"""Where the benchmarks' results go: a CSV of rows, and a Markdown table beside it."""

from __future__ import annotations

import csv
import pathlib
from dataclasses import asdict
from typing import Any, Sequence


def write_csv(path: pathlib.Path, dicts: list[dict[str, Any]]) -> None:
    """One row per dict, the first one's keys as the header; nothing when there are none."""
    if not dicts:
        return
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)


def write_table(out: str, name: str, text: str, rows: Sequence[Any]) -> None:
    """``out/name.md`` (the table's text) and ``out/name.csv`` (the dataclass rows)."""
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.md").write_text(text + "\n", encoding="utf-8")
    write_csv(folder / f"{name}.csv", [asdict(r) for r in rows])
