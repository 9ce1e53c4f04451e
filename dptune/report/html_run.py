"""A monitored run as one offline HTML page (``report.html`` beside ``timeline.png``): per card
the allocated and reserved peaks of each reading over the steps, the card's whole use (NVML),
the plan's prediction for each step's shape, the budget and the card's memory as lines; the
events as a table. Reads a :class:`~dptune.monitor.record.RunRecord`; pure strings (no
matplotlib)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dptune.report.html import Section, advice_section, e, key_facts, page, scroll, table
from dptune.report.html_svg import COLORS, HLine, Series, byte_ticks, xy_chart
from dptune.report.timeline import render_run
from dptune.units import format_bytes

__all__ = ["render_run_html", "run_sections"]

#: (key in a reading, legend label, colour)
_LINES = (("allocated_bytes.all.peak", "allocated peak", COLORS["allocated"]),
          ("reserved_bytes.all.peak", "reserved peak", "#222222"),
          ("nvml_used_bytes", "card used, every process (NVML)", "#9e9e9e"),
          ("predicted_peak_bytes", "plan's prediction", COLORS["ok"]))


def _points(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    pts = [(float(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    return tuple(p[0] for p in pts), tuple(p[1] for p in pts)


def _card_chart(record: Any, card: Any) -> str:
    rows = record.card_rows(card)
    series = []
    for key, label, color in _LINES:
        xs, ys = _points(rows, key)
        if xs:
            series.append(Series(label, xs, ys, color, kind="line"))
    events = record.card_events(card)
    if events:
        xs = tuple(float(ev.step) for ev in events)
        ys = tuple(float(ev.measured_bytes if ev.measured_bytes is not None else card.total_bytes)
                   for ev in events)
        series.append(Series("events", xs, ys, COLORS["over"], marker="v",
                             titles=tuple(f"step {ev.step}: {ev.kind.value}" for ev in events)))
    lines = [HLine(float(card.total_bytes), f"card memory {format_bytes(card.total_bytes)}",
                   COLORS["total"])]
    if card.budget_bytes is not None:
        lines.append(HLine(float(card.budget_bytes), f"budget {format_bytes(card.budget_bytes)}"))
    return xy_chart(series, x_label="step", y_label="bytes", y_unit=lambda v: format_bytes(int(v)),
                    hlines=lines, title=f"{card.label}: {card.name}", width=720, height=260,
                    y_ticks=byte_ticks)


def run_sections(record: Any) -> list[Section]:
    """The summary (as ``dptune show RUN`` prints it), one chart per card, the events."""
    facts = [("ranks", str(len(record.ranks))), ("cards", str(len(record.cards))),
             ("readings", str(len(record.rows))), ("events", str(len(record.events))),
             ("budget level", record.level)]
    out = [Section("overview", "The run", key_facts(facts)
                   + f"<pre>{e(render_run(record))}</pre>")]
    charts = "".join(f'<div class="chart">{_card_chart(record, c)}</div>' for c in record.cards)
    out.append(Section("timeline", "Every card over the steps", charts or "<p>no card was read</p>"))
    if record.events:
        rows = [[str(ev.step), f"rank {ev.rank} card {ev.card}", ev.kind.value,
                 "" if ev.predicted_bytes is None else format_bytes(ev.predicted_bytes),
                 "" if ev.measured_bytes is None else format_bytes(ev.measured_bytes), ev.message]
                for ev in record.events]
        out.append(Section("events", "Events", scroll(table(
            ["step", "card", "kind", "predicted", "measured", "what it says"], rows,
            left=(1, 2, 5)), len(rows))))
    notes = advice_section((), [f"out of memory on rank {o.get('rank')}: forensics in {record.folder}"
                                for o in record.ooms])
    if notes is not None:
        out.append(notes)
    return out


def render_run_html(record: Any) -> str:
    return page(f"dptune monitor: {record.folder}", run_sections(record))
