"""Static SVG charts for the HTML report (:mod:`dptune.report.html`): pure string building.

No script, no external resource: each function returns one ``<svg>`` element as text, every
label passed through :func:`html.escape`. Two kinds of chart:

- :func:`bar_rows`: one row per item (a card, a rank, a split), each a stack of segments on a
  track, with per-row marks (a budget line, a total-use tick). Rows stay a fixed height, so
  1 card and 256 cards both read; the page scrolls the tall ones.
- :func:`xy_chart`: points, lines and staircases on two linear axes that start at 0.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

__all__ = ["Segment", "Mark", "BarRow", "bar_rows", "Series", "HLine", "xy_chart", "nice_ticks", "byte_ticks",
           "COLORS"]

#: The page's colours (also used by the CSS legend swatches).
COLORS = {
    "allocated": "#4c72b0", "reserved": "#9db4d8", "fixed": "#dd8452", "even": "#b0b0b0",
    "budget": "#d62728", "total": "#111111", "card": "#eeeeee", "fit": "#1f77b4",
    "over": "#d62728", "chosen": "#e6b800", "ok": "#55a868",
}


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(x: float) -> str:
    """A coordinate, short: ``12.5``."""
    return f"{x:.1f}".rstrip("0").rstrip(".") if math.isfinite(x) else "0"


@dataclass(frozen=True)
class Segment:
    """A part of a bar: ``start``..``start+size`` in the chart's unit (bytes, ms...)."""

    size: float
    color: str
    title: str                 # the tooltip (an SVG <title>), also what a test reads
    css: str = ""              # a class for the rect (e.g. "seg-fixed")
    hatch: bool = False


@dataclass(frozen=True)
class Mark:
    """A vertical line across a row at ``at`` (a budget, a total use, the card's memory)."""

    at: float
    color: str
    title: str
    css: str = ""
    dashed: bool = False
    width: float = 2.0


@dataclass(frozen=True)
class BarRow:
    """One row: its label on the left, its segments stacked from 0, its marks, a note on the
    right; ``track``: the length of the grey track behind the bar (the card's memory)."""

    label: str
    segments: tuple[Segment, ...]
    marks: tuple[Mark, ...] = ()
    note: str = ""
    track: Optional[float] = None
    thin: tuple[Segment, ...] = ()   # a thinner bar under the main one (the even split)
    css: str = ""                    # a class for the row's <g>
    data: dict[str, str] = field(default_factory=dict)  # data-* attributes of the row's <g>


def bar_rows(rows: Sequence[BarRow], *, unit: Callable[[float], str], width: int = 960,
             label_width: int = 150, note_width: int = 260, row_height: int = 0,
             top: Optional[float] = None, css: str = "bars",
             ticks: Optional[Callable[[float], list[float]]] = None) -> str:
    """Rows of stacked horizontal bars on one linear scale from 0 to ``top`` (default: the
    largest segment end, mark or track); an axis with ticks at the bottom, ``unit`` formatting
    them. Row height 26 px (14 px past 24 rows; ``row_height`` to choose)."""
    n = len(rows)
    rh = row_height or (26 if n <= 24 else 14)
    thin_h = 0 if not any(r.thin for r in rows) else max(3, rh // 5)
    bar_h = rh - 6 - thin_h
    ends = [sum(s.size for s in r.segments) for r in rows] + \
           [sum(s.size for s in r.thin) for r in rows] + \
           [m.at for r in rows for m in r.marks] + [r.track or 0 for r in rows]
    hi = top if top is not None else max([x for x in ends if math.isfinite(x)] + [1.0])
    hi = hi or 1.0
    plot_w = width - label_width - note_width
    axis_h = 22
    height = n * rh + axis_h + 4

    def x(v: float) -> float:
        return label_width + plot_w * max(0.0, min(v, hi * 1.02)) / hi

    out = [f'<svg class="{_e(css)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height}" viewBox="0 0 {width} {height}" role="img">']
    font = 11 if rh >= 20 else 9
    for k, r in enumerate(rows):
        y = k * rh + 2
        data = "".join(f' data-{_e(a)}="{_e(v)}"' for a, v in r.data.items())
        out.append(f'<g class="row {_e(r.css)}"{data}>')
        out.append(f'<text x="{label_width - 6}" y="{_num(y + rh / 2 + font / 3)}" '
                   f'text-anchor="end" font-size="{font}">{_e(r.label)}</text>')
        if r.track is not None:
            out.append(f'<rect class="track" x="{label_width}" y="{y}" '
                       f'width="{_num(x(r.track) - label_width)}" height="{rh - 4}" '
                       f'fill="{COLORS["card"]}"><title>{_e("card memory " + unit(r.track))}'
                       '</title></rect>')
        out += _stack(r.segments, x, y + 1, bar_h)
        if r.thin:
            out += _stack(r.thin, x, y + 1 + bar_h + 1, thin_h)
        for m in r.marks:
            dash = ' stroke-dasharray="4 2"' if m.dashed else ""
            out.append(f'<line class="{_e(m.css)}" x1="{_num(x(m.at))}" x2="{_num(x(m.at))}" '
                       f'y1="{y - 1}" y2="{y + rh - 3}" stroke="{m.color}" '
                       f'stroke-width="{m.width}"{dash}><title>{_e(m.title)}</title></line>')
        if r.note:
            out.append(f'<text x="{width - note_width + 6}" y="{_num(y + rh / 2 + font / 3)}" '
                       f'font-size="{font}">{_e(r.note)}</text>')
        out.append("</g>")
    ay = n * rh + 3
    out.append(f'<line x1="{label_width}" x2="{label_width + plot_w}" y1="{ay}" y2="{ay}" '
               'stroke="#555"/>')
    for t in (ticks or nice_ticks)(hi):
        out.append(f'<line x1="{_num(x(t))}" x2="{_num(x(t))}" y1="{ay}" y2="{ay + 4}" '
                   f'stroke="#555"/><text x="{_num(x(t))}" y="{ay + 15}" font-size="9" '
                   f'text-anchor="middle">{_e(unit(t))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _stack(segments: Sequence[Segment], x: Callable[[float], float], y: float,
           h: float) -> list[str]:
    out, start = [], 0.0
    for s in segments:
        if s.size <= 0 or not math.isfinite(s.size):
            continue
        x0, x1 = x(start), x(start + s.size)
        fill = "url(#hatch)" if s.hatch else s.color
        out.append(f'<rect class="seg {_e(s.css)}" x="{_num(x0)}" y="{_num(y)}" '
                   f'width="{_num(max(x1 - x0, 0.5))}" height="{_num(h)}" fill="{fill}" '
                   f'stroke="{s.color}" stroke-width="0.5"><title>{_e(s.title)}</title></rect>')
        start += s.size
    return out


def byte_ticks(hi: float) -> list[float]:
    """Round ticks of a memory axis: whole GiB (or MiB, KiB below 1 GiB)."""
    scale = next((u for u in (2 ** 30, 2 ** 20, 2 ** 10) if hi >= u), 1)
    return [t * scale for t in nice_ticks(hi / scale)]


def nice_ticks(hi: float, n: int = 5) -> list[float]:
    """About ``n`` round ticks from 0 to ``hi`` (1, 2 or 5 times a power of ten apart)."""
    if not math.isfinite(hi) or hi <= 0:
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [k * step for k in range(int(hi / step) + 1)]


# ---- x/y charts ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Series:
    """Points (``kind="points"``), a polyline (``"line"``) or a staircase (``"steps"``: ``xs``
    are the edges, one more than ``ys``) with a legend label; ``marker``: ``o``, ``x``, ``v``,
    ``*``, ``s`` (points only); ``dy``: a vertical offset in pixels, so identical series stay
    visible one beside the other."""

    label: str
    xs: tuple[float, ...]
    ys: tuple[float, ...]
    color: str
    kind: str = "points"
    marker: str = "o"
    hollow: bool = False
    dy: float = 0.0
    titles: tuple[str, ...] = ()    # per point, the tooltip


@dataclass(frozen=True)
class HLine:
    y: float
    label: str
    color: str = COLORS["budget"]


def xy_chart(series: Sequence[Series], *, x_label: str, y_label: str,
             y_unit: Callable[[float], str], x_unit: Callable[[float], str] = lambda v: f"{v:g}",
             hlines: Sequence[HLine] = (), width: int = 460, height: int = 260,
             title: str = "", css: str = "xy",
             y_ticks: Optional[Callable[[float], list[float]]] = None) -> str:
    """Both axes from 0 to a little past the largest value (a fall to half is drawn as half)."""
    xs = [v for s in series for v in s.xs if math.isfinite(v)]
    ys = [v for s in series for v in s.ys if math.isfinite(v)] + [h.y for h in hlines]
    x_hi = (max(xs) if xs else 1.0) * 1.05 or 1.0
    y_hi = (max(ys) if ys else 1.0) * 1.08 or 1.0
    left, right, top, bottom = 62, 12, 22 if title else 8, 38
    pw, ph = width - left - right, height - top - bottom

    def px(v: float) -> float:
        return left + pw * v / x_hi

    def py(v: float) -> float:
        return top + ph * (1 - v / y_hi)

    out = [f'<svg class="{_e(css)}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{height + 16 * _legend_lines(series, hlines, width)}" role="img">']
    if title:
        out.append(f'<text x="{left}" y="14" font-size="12" font-weight="bold">{_e(title)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>')
    for t in (y_ticks or nice_ticks)(y_hi / 1.08):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{_num(py(t))}" y2="{_num(py(t))}" '
                   f'stroke="#eee"/><text x="{left - 4}" y="{_num(py(t) + 3)}" font-size="9" '
                   f'text-anchor="end">{_e(y_unit(t))}</text>')
    for t in nice_ticks(x_hi / 1.05):
        out.append(f'<text x="{_num(px(t))}" y="{top + ph + 12}" font-size="9" '
                   f'text-anchor="middle">{_e(x_unit(t))}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{top + ph + 28}" font-size="10" '
               f'text-anchor="middle">{_e(x_label)}</text>')
    out.append(f'<text x="12" y="{top + ph / 2}" font-size="10" text-anchor="middle" '
               f'transform="rotate(-90 12 {top + ph / 2})">{_e(y_label)}</text>')
    for h in hlines:
        out.append(f'<line class="hline" x1="{left}" x2="{left + pw}" y1="{_num(py(h.y))}" '
                   f'y2="{_num(py(h.y))}" stroke="{h.color}" stroke-dasharray="5 3">'
                   f'<title>{_e(h.label)}</title></line>')
    for s in series:
        out.append(_series(s, px, py))
    out += _legend(series, hlines, width, height)
    out.append("</svg>")
    return "\n".join(out)


def _legend_lines(series: Sequence[Series], hlines: Sequence[HLine], width: int) -> int:
    n = len([s for s in series if s.label]) + len(hlines)
    per_line = max(1, width // 150)
    return math.ceil(n / per_line)


def _legend(series: Sequence[Series], hlines: Sequence[HLine], width: int, y0: int) -> list[str]:
    items = [(s.label, s.color) for s in series if s.label] + [(h.label, h.color) for h in hlines]
    per_line = max(1, width // 150)
    out = []
    for k, (label, color) in enumerate(items):
        lx, ly = 8 + 150 * (k % per_line), y0 + 4 + 16 * (k // per_line)
        out.append(f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{ly + 9}" font-size="10">{_e(label[:24])}</text>')
    return out


def _series(s: Series, px: Callable[[float], float], py: Callable[[float], float]) -> str:
    label = f' data-label="{_e(s.label)}"'
    if s.kind == "line":
        line = " ".join(f"{_num(px(a))},{_num(py(b) + s.dy)}" for a, b in zip(s.xs, s.ys))
        return (f'<polyline class="series line"{label} points="{line}" fill="none" '
                f'stroke="{s.color}" stroke-width="1.5"/>')
    if s.kind == "steps":
        pts: list[str] = []
        for k, v in enumerate(s.ys):
            pts += [f"{_num(px(s.xs[k]))},{_num(py(v) + s.dy)}",
                    f"{_num(px(s.xs[k + 1]))},{_num(py(v) + s.dy)}"]
        return (f'<polyline class="series steps"{label} points="{" ".join(pts)}" fill="none" '
                f'stroke="{s.color}" stroke-width="2"/>')
    out = [f'<g class="series points"{label}>']
    for k, (a, b) in enumerate(zip(s.xs, s.ys)):
        tip = f"<title>{_e(s.titles[k])}</title>" if k < len(s.titles) else ""
        out.append(_marker(s.marker, px(a), py(b) + s.dy, s.color, s.hollow, tip))
    out.append("</g>")
    return "".join(out)


def _marker(kind: str, x: float, y: float, color: str, hollow: bool, tip: str) -> str:
    fill = "none" if hollow else color
    if kind == "x":
        return (f'<path d="M{_num(x - 4)},{_num(y - 4)}L{_num(x + 4)},{_num(y + 4)}M{_num(x - 4)},'
                f'{_num(y + 4)}L{_num(x + 4)},{_num(y - 4)}" stroke="{color}" stroke-width="2">'
                f'{tip}</path>')
    if kind == "v":
        return (f'<path d="M{_num(x - 4)},{_num(y - 3)}L{_num(x + 4)},{_num(y - 3)}L{_num(x)},'
                f'{_num(y + 4)}Z" fill="{fill}" stroke="{color}">{tip}</path>')
    if kind == "*":
        return (f'<circle cx="{_num(x)}" cy="{_num(y)}" r="6" fill="{COLORS["chosen"]}" '
                f'stroke="#000">{tip}</circle>')
    if kind == "s":
        return (f'<rect x="{_num(x - 3.5)}" y="{_num(y - 3.5)}" width="7" height="7" '
                f'fill="{fill}" stroke="{color}">{tip}</rect>')
    return (f'<circle cx="{_num(x)}" cy="{_num(y)}" r="3.5" fill="{fill}" stroke="{color}">'
            f'{tip}</circle>')
