"""A monitored run, rendered: the summary ``dptune show RUN`` prints and ``timeline.png``.

:func:`render_run` is the text (each card's peaks over the run against the plan's largest
prediction and the budget, the least headroom, the events); :func:`plot_timeline` draws one
panel per card (every rank's cards, merged): the allocated and reserved peaks of each reading
over the steps, the plan's prediction for each step's shape and the budget as lines, each
event as a mark. Both read a :class:`~dptune.monitor.record.RunRecord`; matplotlib is
imported inside :func:`plot_timeline` only.
"""

from __future__ import annotations

import pathlib
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from dptune.report.tables import Align, text_table
from dptune.units import GiB, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure


__all__ = ["render_run", "plot_timeline", "write_timeline", "TIMELINE_FILE", "EVENTS_SHOWN"]

TIMELINE_FILE = "timeline.png"
#: event lines the summary prints (the rest are counted)
EVENTS_SHOWN = 30
_ALLOC = "allocated_bytes.all.peak"
_RESERVED = "reserved_bytes.all.peak"
_EVENT_COLORS = {"drift": ("#d62728", "v"), "off_plan": ("#ff7f0e", "o"), "headroom": ("#9467bd", "s"),
                 "fragmentation": ("#8c564b", "D"), "oom": ("#000000", "X")}


def _max(values: Sequence[Optional[int]]) -> Optional[int]:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _min(values: Sequence[Optional[int]]) -> Optional[int]:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _pct(a: Optional[int], b: Optional[int]) -> str:
    return "n/a" if a is None or not b else f"{100 * a / b:.0f}%"


def _card_line(record: Any, card: Any) -> list[str]:
    rows = record.card_rows(card)
    level = _RESERVED if record.level == "reserved" else _ALLOC
    peak = _max([r[level] for r in rows])
    predicted = _max([r.get("predicted_peak_bytes") for r in rows])
    budget = card.budget_bytes if card.budget_bytes is not None else _max([r.get("budget_bytes") for r in rows])
    retries = _max([r.get("num_alloc_retries") for r in rows])
    return [card.label, card.name, format_bytes(_max([r[_ALLOC] for r in rows])),
            format_bytes(_max([r[_RESERVED] for r in rows])), format_bytes(predicted),
            "n/a" if peak is None or predicted is None else f"{format_bytes(peak - predicted)}",
            format_bytes(budget), _pct(peak, budget), format_bytes(_min([r.get("headroom_bytes") for r in rows])),
            "n/a" if retries is None else str(retries), str(len(record.card_events(card)))]


def render_run(record: Any) -> str:
    """The run's summary: settings, one line per card, the events (see the module docstring)."""
    meta = record.metas[0]
    steps = max((int(m.get("steps", 0)) for m in record.metas), default=0)
    scope = ("per reading (the monitor reset the peaks)" if meta.get("peak_scope") == "reading"
             else "since the start (the monitor left torch's counters alone)")
    plan = meta.get("plan") or {}
    lines = [f"Monitored run {record.folder}: {len(record.ranks)} rank(s), {len(record.cards)} card(s), "
             f"{steps} step(s), a reading every {meta.get('every', 1)} step(s)",
             f"plan: {plan.get('kind', 'none')}; level {record.level} (the peak compared with the plan); "
             f"margin {format_bytes(meta.get('margin_bytes'))}; peaks {scope}", ""]
    header = ["card", "name", "allocated peak", "reserved peak", "plan's largest", f"{record.level} - plan",
              "budget", "of budget", "least headroom", "retries", "events"]
    aligns = [Align.LEFT, Align.LEFT] + [Align.RIGHT] * (len(header) - 2)
    lines += text_table(header, [_card_line(record, c) for c in record.cards], aligns, rule=True)
    unfinished = [int(m["rank"]) for m in record.metas if not m.get("finished")]
    if unfinished:
        lines += ["", f"rank(s) {unfinished} did not close the monitor (the run stopped, or is still "
                      "going): their figures end at the last reading written"]
    lines += ["", f"{len(record.events)} event(s)" + (":" if record.events else "")]
    for e in record.events[:EVENTS_SHOWN]:
        lines.append(f"- [{e.kind.value}] {e.message.removeprefix('dptune monitor: ')}")
    if len(record.events) > EVENTS_SHOWN:
        lines.append(f"- ... and {len(record.events) - EVENTS_SHOWN} more (events.rank*.jsonl)")
    for oom in record.ooms:
        snap = f"; allocator snapshot {oom['snapshot']}" if oom.get("snapshot") else ""
        lines.append(f"out of memory on rank {oom.get('rank')} card {oom.get('card')} at step {oom.get('step')} "
                     f"(batch {oom.get('batch_size')}, length {oom.get('length')}): oom.rank{oom.get('rank')}.json"
                     f"{snap}")
    return "\n".join(lines)


def _series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), r[key] / GiB) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_timeline(record: Any) -> "Figure":
    """One panel per card: the peaks over the steps, the plan's prediction, the budget, the
    events (see the module docstring)."""
    from matplotlib.figure import Figure

    n = max(1, len(record.cards))
    fig = Figure(figsize=(10, 2.6 * n + 0.6), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    handles: dict[str, Any] = {}
    for ax, card in zip(axes, record.cards):
        rows = record.card_rows(card)
        for key, label, color, style in ((_ALLOC, "allocated peak", "#1f77b4", "-"),
                                         (_RESERVED, "reserved peak", "#222222", "-"),
                                         ("nvml_used_bytes", "card used, every process (NVML)", "#9e9e9e", "-"),
                                         ("budget_bytes", "budget", "#d62728", ":")):
            x, y = _series(rows, key)
            if x:
                (line,) = ax.plot(x, y, color=color, linestyle=style, linewidth=1.2)
                handles.setdefault(label, line)
        x, y = _series(rows, "predicted_peak_bytes")
        if x:
            (line,) = ax.step(x, y, where="mid", color="#2ca02c", linestyle="--", linewidth=1.2)
            handles.setdefault("plan's prediction", line)
        ax.axhline(card.total_bytes / GiB, color="#000000", linewidth=0.6, alpha=0.4)
        for e in record.card_events(card):
            kind = e.kind.value
            color, marker = _EVENT_COLORS.get(kind, ("#7f7f7f", "o"))
            ax.axvline(e.step, color=color, alpha=0.35, linewidth=1)
            y_at = (e.measured_bytes if e.kind.value in ("drift", "fragmentation", "oom")
                    and e.measured_bytes is not None else card.total_bytes) / GiB
            mark = ax.scatter([e.step], [y_at], color=color, marker=marker, s=36, zorder=5)
            handles.setdefault(f"event: {kind}", mark)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, card.total_bytes / GiB * 1.05)
        ax.set_title(f"{card.label}: {card.name}, {format_bytes(card.total_bytes)} (thin black line)",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center",
                   ncol=min(4, len(handles)), fontsize=8)
    axes[-1].set_xlabel("step")
    fig.suptitle(f"dptune monitor: {record.folder}", fontsize=11)
    return fig


def write_timeline(record: Any, folder: "str | pathlib.Path | None" = None) -> pathlib.Path:
    """Draw :func:`plot_timeline` into ``folder/timeline.png`` (default: the run's folder)."""
    from dptune.report.files import figure_dpi

    path = pathlib.Path(folder if folder is not None else record.folder) / TIMELINE_FILE
    fig = plot_timeline(record)
    fig.savefig(path, dpi=figure_dpi(fig))
    return path
