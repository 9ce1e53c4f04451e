"""The one renderer of text tables: columns padded to their widest cell for a terminal
(:func:`text_table`), or a Markdown table (:func:`markdown_table`).

Cells are strings, already formatted (the callers say how a number or a size reads); a column
is aligned left or right (:class:`Align`). Nothing else of dptune is imported here, so any
layer above the backends can render its table with it.
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence

__all__ = ["Align", "text_table", "markdown_table"]


class Align(Enum):
    """How a column's cells line up: names to the left, numbers to the right."""

    LEFT = "left"
    RIGHT = "right"


def _aligns(header: Sequence[str], align: Optional[Sequence[Align]]) -> Sequence[Align]:
    aligns = [Align.LEFT] * len(header) if align is None else align
    if len(aligns) != len(header):
        raise ValueError(f"{len(aligns)} alignments for {len(header)} columns")
    return aligns


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]],
               align: Optional[Sequence[Align]] = None, *, rule: bool = False) -> list[str]:
    """The table's lines for a terminal: each column as wide as its widest cell (the header
    included), two spaces between columns, no trailing spaces; ``rule``: a line of dashes
    under the header. ``align``: one per column (default: all left). A row shorter than the
    header leaves its last columns empty."""
    aligns = _aligns(header, align)
    widths = [max(len(r[c]) for r in [header, *rows] if c < len(r)) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if a is Align.RIGHT else c.ljust(w)
                         for c, w, a in zip(cells, widths, aligns)).rstrip()

    lines = [line(header)]
    if rule:
        lines.append(line(["-" * w for w in widths]))
    return lines + [line(r) for r in rows]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]],
                   align: Optional[Sequence[Align]] = None) -> list[str]:
    """The table's lines in Markdown (``| a | b |``, right-aligned columns marked ``---:``).
    ``align``: one per column (default: all left, ``---``)."""
    aligns = _aligns(header, align)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if a is Align.RIGHT else "---" for a in aligns) + "|"]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]
