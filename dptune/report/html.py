"""One self-contained HTML page per report (``report.html``): inline CSS and static SVG, no
script and nothing fetched, so it opens offline in any browser.

A page is a list of :class:`Section` s put together by :func:`page`; each report kind builds
its own list, so other parts of a report (e.g. a timeline of a training run) add a section
without touching the others:

- :func:`result_sections` / :func:`render_result_html`: a ``dptune search`` report (a
  :class:`~dptune.result.model.TuneResult`): the split, the cards' bars at every level against
  their budgets, the largest batch, the step time per split (throughput), the fits, the
  probes, the advice;
- :mod:`dptune.report.html_plans`: a DDP/FSDP2 plan and a length plan.

Everything a user controls (the model's name, the cluster, notes) goes through
:func:`html.escape`. Memory figures come from :mod:`dptune.report.levels`, the same figures
the terminal table and ``summary.md`` print.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

from dptune.report.html_svg import (COLORS, BarRow, HLine, Mark, Segment, Series, bar_rows,
                                    byte_ticks, xy_chart)
from dptune.report.levels import CardMemory, budget_level, level_lines, split_memory
from dptune.types import Objective
from dptune.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from dptune.result.model import TuneResult

__all__ = ["Section", "page", "table", "result_sections", "render_result_html", "card_rows",
           "HTML_FILE", "write_html"]

#: The page's file name in a report folder.
HTML_FILE = "report.html"


@dataclass(frozen=True)
class Section:
    """One part of the page: ``body`` is HTML (already escaped), ``key`` its element id."""

    key: str
    title: str
    body: str


def e(text: object) -> str:
    """``text`` escaped for HTML (quotes too)."""
    return html.escape(str(text), quote=True)


_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;
max-width:1000px;padding:12px 16px;color:#222;background:#fff}
h1{font-size:1.35em;margin:.3em 0}h3{font-size:.95em;margin:.6em 0 .2em}
h2{font-size:1.1em;margin:1.2em 0 .4em;border-bottom:1px
solid #ddd}
.key{display:flex;flex-wrap:wrap;gap:6px 18px;margin:.4em 0;padding:8px 10px;
background:#f5f7fa;border:1px solid #dde3ea;border-radius:4px}
.key div{white-space:nowrap}.key b{font-size:1.05em}
table{border-collapse:collapse;font-size:12px;margin:.3em 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
th{background:#f0f0f0}td.l,th.l{text-align:left}
tr.chosen td{background:#fff6cc}tr.over td{color:#a00}
.scroll{overflow:auto;max-height:75vh;border:1px solid #eee}
.legend{font-size:12px;margin:.2em 0}.legend span{display:inline-block;margin-right:14px}
.sw{display:inline-block;width:11px;height:11px;margin-right:4px;vertical-align:-1px;
border:1px solid #888}
.hatch{background:repeating-linear-gradient(45deg,#dd8452 0 2px,#fff 2px 4px)}
.note{color:#555;font-size:12px}ul{margin:.2em 0 .2em 1.2em;padding:0}
svg text{font-family:inherit;fill:#222}
.charts{display:flex;flex-wrap:wrap;gap:8px}
"""

#: Shared SVG definitions (the hatch of the budget's fixed costs), once per page.
_DEFS = ('<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs>'
         '<pattern id="hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
         f'patternTransform="rotate(45)"><rect width="5" height="5" fill="#fff"/>'
         f'<rect width="2.5" height="5" fill="{COLORS["fixed"]}"/></pattern></defs></svg>')


def page(title: str, sections: Sequence[Section], *, subtitle: str = "") -> str:
    """The whole document: a title, then each section under its heading."""
    body = [f'<section id="{e(s.key)}"><h2>{e(s.title)}</h2>\n{s.body}\n</section>'
            for s in sections]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{e(title)}</title><style>{_CSS}</style></head><body>\n{_DEFS}\n"
            f"<h1>{e(title)}</h1>" + (f'<p class="note">{e(subtitle)}</p>' if subtitle else "")
            + "\n" + "\n".join(body) + "\n<p class=\"note\">written by dptune; no script, "
            "nothing fetched: this page reads offline.</p></body></html>\n")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: Sequence[int] = (0,),
          row_css: Optional[Sequence[str]] = None, css: str = "") -> str:
    """An HTML table of plain text cells (escaped); columns in ``left`` aligned left."""
    def cell(tag: str, k: int, v: str) -> str:
        return f'<{tag}{" class=l" if k in left else ""}>{e(v)}</{tag}>'

    out = [f'<table class="{e(css)}"><thead><tr>'
           + "".join(cell("th", k, h) for k, h in enumerate(header)) + "</tr></thead><tbody>"]
    for j, r in enumerate(rows):
        cls = f' class="{e(row_css[j])}"' if row_css and row_css[j] else ""
        out.append(f"<tr{cls}>" + "".join(cell("td", k, v) for k, v in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def key_facts(facts: Sequence[tuple[str, str]], css: str = "key") -> str:
    """The box of headline figures: ``label: value`` pairs."""
    return (f'<div class="{e(css)}">' + "".join(
        f'<div class="fact" data-fact="{e(k)}">{e(k)}: <b>{e(v)}</b></div>' for k, v in facts)
        + "</div>")


def bullet_list(items: Sequence[str]) -> str:
    return "<ul>" + "".join(f"<li>{e(x)}</li>" for x in items) + "</ul>"


def scroll(body: str, rows: int) -> str:
    """``body`` in a scrolling box past 24 rows (256 cards stay one screen tall)."""
    return f'<div class="scroll">{body}</div>' if rows > 24 else body


def legend(items: Sequence[tuple[str, str]]) -> str:
    """Swatches: (css background or ``"hatch"``, label)."""
    out = []
    for color, label in items:
        sw = '<i class="sw hatch"></i>' if color == "hatch" else \
            f'<i class="sw" style="background:{e(color)}"></i>'
        out.append(f"<span>{sw}{e(label)}</span>")
    return f'<div class="legend">{"".join(out)}</div>'


# ---- a search's report ----------------------------------------------------------------------

def card_rows(result: "TuneResult") -> list[BarRow]:
    """Per card, dptune's split: the allocated peak, the reserved peak above it, the budget's
    fixed costs (what the budget level adds to the reserved peak: NCCL's buffers) as a hatched
    segment, so the bar ends at the peak the budget was checked on and a card at 100% reaches
    its budget line; the card's total use (reserved + CUDA context + NCCL, or NVML's reading)
    as a black tick on the track of the card's memory; the even split as a thin grey bar."""
    cards = split_memory(result, result.chunk_sizes, result.peak_bytes)
    even = result.even
    rows = []
    for i, d in enumerate(result.devices):
        peak, budget = result.peak_bytes[i], result.budget_bytes[i]
        segs = _segments(peak, None if cards is None else cards[i])
        marks = [Mark(budget, COLORS["budget"], f"budget {format_bytes(budget)}", "budget",
                      dashed=True)]
        total = None if cards is None else cards[i].total_bytes
        if total is not None:
            marks.append(Mark(total, COLORS["total"], f"total use {format_bytes(total)} of the "
                              f"card's {format_bytes(d.total_bytes)}", "total", width=1.5))
        share = peak / budget if budget else math.inf
        even_peak = even.peak_bytes[i]
        thin = (Segment(even_peak, COLORS["even"], f"even split: {even.chunk_sizes[i]} samples, "
                        f"{'out of memory' if even.oom_device == i else format_bytes(even_peak)}",
                        "seg-even"),)
        rows.append(BarRow(
            label=f"{d.index}: {d.name}"[:22], segments=segs, marks=tuple(marks),
            note=f"{result.chunk_sizes[i]} samples · {format_bytes(peak)} of "
                 f"{format_bytes(budget)} ({_pct(share)})",
            track=float(d.total_bytes), thin=thin, css="card",
            data={"card": str(i), "chunk": str(result.chunk_sizes[i]),
                  "peak": str(peak), "budget": str(budget)}))
    return rows


def _segments(peak: int, card: Optional[CardMemory]) -> tuple[Segment, ...]:
    """The bar of one card: allocated, reserved above it, the fixed costs up to ``peak``."""
    if card is None or card.reserved_bytes is None:
        return (Segment(peak, COLORS["allocated"], f"peak {format_bytes(peak)}", "seg-peak"),)
    alloc, reserved = card.allocated_bytes, card.reserved_bytes
    fixed = peak - reserved
    parts = [Segment(min(alloc, peak), COLORS["allocated"],
                     f"allocated peak {format_bytes(alloc)}", "seg-allocated"),
             Segment(max(0, min(reserved, peak) - alloc), COLORS["reserved"],
                     f"reserved peak {format_bytes(reserved)} (cached above the allocated)",
                     "seg-reserved")]
    if fixed > 0:
        parts.append(Segment(fixed, COLORS["fixed"], f"the budget's fixed costs "
                             f"{format_bytes(fixed)} (NCCL's buffers)", "seg-fixed", hatch=True))
    return tuple(parts)


def _pct(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.0%}"


def _bytes_axis(v: float) -> str:
    return format_bytes(int(v), precision=0) if v else "0"


def _cards_section(result: "TuneResult") -> Section:
    rows = card_rows(result)
    level = budget_level(result)
    items = [(COLORS["allocated"], "allocated peak")]
    if any(len(r.segments) > 1 for r in rows):
        items.append((COLORS["reserved"], "reserved peak"))
    if any(s.css == "seg-fixed" for r in rows for s in r.segments):
        items.append(("hatch", "budget's fixed costs (NCCL)"))
    items += [(COLORS["even"], "even split (thin bar)"), (COLORS["budget"], "budget (dashed)")]
    if any(m.css == "total" for r in rows for m in r.marks):
        items.append((COLORS["total"], "total use (tick), on the card's memory (grey track)"))
    else:
        items.append((COLORS["card"], "card memory (grey track)"))
    body = (legend(items)
            + f'<p class="note">The bar ends at the peak checked against the budget (budget '
              f'level {e(level)}); the tick is the card\'s whole use, compared with the card\'s '
              "memory, not the budget.</p>"
            + scroll(bar_rows(rows, unit=_bytes_axis, ticks=byte_ticks), len(rows))
            + bullet_list(level_lines(result)))
    return Section("cards", f"Memory per card ({len(rows)} cards)", body)


def _overview(result: "TuneResult") -> Section:
    from dptune.report.text import _certificate, _even_batch, _gain, _ratio

    facts = [("split", _short_split(result.chunk_sizes)), ("batch", str(result.batch_size)),
             ("objective", str(result.objective)),
             ("budget", _budgets(result.budget_bytes)),
             ("budget level", budget_level(result)),
             ("headroom", format_bytes(result.headroom_bytes)),
             ("imbalance", f"{_ratio(result.imbalance)} (even "
                           f"{_ratio(result.even.imbalance)})"),
             ("probes", f"{result.num_probes} in {result.seconds:.1f} s")]
    if result.objective == Objective.MAX_BATCH:
        facts.insert(2, ("largest batch", f"even {_even_batch(result)} -> dptune "
                                          f"{result.batch_size}{_gain(result)}"))
    body = (key_facts(facts)
            + f'<p>training step: {e(result.settings.describe())}; even split '
              f'<code>{e(_short_split(result.even.chunk_sizes))}</code></p>'
            + f"<p>{e(_certificate(result))}</p>")
    return Section("overview", "The split", body)


def _short_split(chunks: Sequence[int]) -> str:
    """``[12, 30, 30]``; past 16 cards the first 8 and the last 4 with a count between."""
    c = list(chunks)
    if len(c) <= 16:
        return str(c)
    return f"[{', '.join(map(str, c[:8]))}, ... {len(c) - 12} more ..., " \
           f"{', '.join(map(str, c[-4:]))}]"


def _budgets(budgets: Sequence[int]) -> str:
    lo, hi = min(budgets), max(budgets)
    return f"{format_bytes(lo)} per card" if lo == hi else \
        f"{format_bytes(lo)} to {format_bytes(hi)} per card"


def _max_batch_section(result: "TuneResult") -> Section:
    from dptune.report.text import _even_batch, _gain

    even = result.even
    rows = [BarRow("even split", (Segment(even.batch_size, COLORS["even"],
                                          f"even split: {_even_batch(result)}", "seg-even"),),
                   note=_even_batch(result), data={"split": "even"}),
            BarRow("dptune", (Segment(result.batch_size, COLORS["allocated"],
                                      f"dptune: {result.batch_size}", "seg-dptune"),),
                   note=f"{result.batch_size}{_gain(result)}", data={"split": "dptune"})]
    body = bar_rows(rows, unit=lambda v: f"{v:g}", row_height=28, css="bars max-batch")
    return Section("max-batch", "Largest batch that fits", body)


def _time_section(result: "TuneResult") -> Optional[Section]:
    """Throughput: each timed probe's step time, the chosen split marked, the ones over
    budget in red (the search chose by time among those within budget)."""
    timed = [(k, p) for k, p in enumerate(result.probes, start=1) if p.time is not None]
    if not timed:
        return None
    chosen = tuple(result.chunk_sizes)
    rows = []
    for k, p in timed:
        ms = p.time.step_seconds * 1e3 if p.time is not None else 0.0
        fits = result.budget_check(p).within_budget
        is_chosen = tuple(p.chunk_sizes) == chosen
        color = COLORS["chosen"] if is_chosen else COLORS["ok"] if fits else COLORS["over"]
        what = "chosen" if is_chosen else "within budget" if fits else "over budget"
        rows.append(BarRow(f"#{k} {_short_split(p.chunk_sizes)}"[:22],
                           (Segment(ms, color, f"probe {k}: {ms:.2f} ms ({what})", "seg-time"),),
                           note=f"{ms:.2f} ms · batch {p.batch_size} · {what}",
                           css="chosen" if is_chosen else "", data={"probe": str(k)}))
    body = (legend([(COLORS["chosen"], "chosen split"), (COLORS["ok"], "within budget"),
                    (COLORS["over"], "over budget")])
            + scroll(bar_rows(rows, unit=lambda v: f"{v:g} ms", css="bars step-time"), len(rows)))
    return Section("step-time", "Step time per split", body)


def _fits_section(result: "TuneResult") -> Section:
    from dptune.report.plots import fit_cards

    from dptune.report.fit_groups import group_note, report_fits

    header = ["card", "intercept", "per sample", "per batch sample", "max error", "points"]
    rows = [[f"{d.index}: {d.name}", format_bytes(f.intercept_bytes),
             format_bytes(f.slope_bytes, precision=2), format_bytes(f.batch_slope_bytes, precision=2),
             format_bytes(f.max_error_bytes), str(f.points)]
            for d, f in zip(result.devices, report_fits(result))]
    charts = [_fit_chart(result, i) for i in fit_cards(result)]
    body = ('<p class="note">Memory of card <i>i</i> with chunk <i>c</i> at batch <i>B</i>: '
            "intercept + per sample × c + per batch sample × B; the max error is over every "
            "probe the line counts.</p>" + scroll(table(header, rows), len(rows))
            + bullet_list(group_note(result))
            + '<div class="charts">' + "".join(charts) + "</div>")
    return Section("fits", "Fits", body)


def _fit_chart(result: "TuneResult", i: int) -> str:
    from dptune.report.fit_groups import report_fits

    fit, B = report_fits(result)[i], result.batch_size
    # on the output card memory also grows with the batch: a probe at another batch is not
    # on the line at this one, and is drawn hollow where it measured
    here = [p for p in result.probes if p.feasible and
            (fit.batch_slope_bytes == 0 or p.batch_size == B)]
    elsewhere = [p for p in result.probes if p.feasible and p not in here]
    oom = [p for p in result.probes if not p.feasible]
    hi = max([p.chunk_sizes[i] for p in result.probes] + [result.chunk_sizes[i], 1]) * 1.1
    series = [Series("fit at batch " + str(B), (0.0, hi),
                     tuple(fit.intercept_bytes + fit.slope_bytes * c + fit.batch_slope_bytes * B
                           for c in (0.0, hi)), COLORS["fit"], kind="line"),
              Series("probes", tuple(p.chunk_sizes[i] for p in here),
                     tuple(p.peak_bytes[i] for p in here), COLORS["allocated"],
                     titles=tuple(f"{p.chunk_sizes[i]} samples: {format_bytes(p.peak_bytes[i])}"
                                  for p in here))]
    if elsewhere:
        series.append(Series("at another batch", tuple(p.chunk_sizes[i] for p in elsewhere),
                             tuple(p.peak_bytes[i] for p in elsewhere), "#555555", hollow=True,
                             titles=tuple(f"batch {p.batch_size}, {p.chunk_sizes[i]} samples: "
                                          f"{format_bytes(p.peak_bytes[i])}" for p in elsewhere)))
    here_oom = [p for p in oom if p.oom_device == i]
    other_oom = [p for p in oom if p.oom_device != i]
    if here_oom:
        series.append(Series("ran out of memory here", tuple(p.chunk_sizes[i] for p in here_oom),
                             tuple(p.peak_bytes[i] for p in here_oom), COLORS["over"], marker="x"))
    if other_oom:
        series.append(Series("stopped by another card", tuple(p.chunk_sizes[i] for p in other_oom),
                             tuple(p.peak_bytes[i] for p in other_oom), COLORS["fit"], marker="v",
                             hollow=True))
    series.append(Series("dptune split", (result.chunk_sizes[i],), (result.peak_bytes[i],),
                         COLORS["chosen"], marker="*"))
    d = result.devices[i]
    return xy_chart(series, x_label="samples on the card", y_label="peak",
                    y_unit=_bytes_axis, y_ticks=byte_ticks, title=f"{d.index}: {d.name}",
                    hlines=[HLine(result.budget_bytes[i], "budget")], css="xy fit")


def _probes_section(result: "TuneResult") -> Section:
    from dptune.report.text import budget_text

    header = ["#", "purpose", "split", "batch", "highest peak", "within budget", "seconds"]
    rows, css = [], []
    chosen = tuple(result.chunk_sizes)
    for k, p in enumerate(result.probes, start=1):
        rows.append([str(k), p.purpose or "-", _short_split(p.chunk_sizes), str(p.batch_size),
                     format_bytes(max(p.peak_bytes)), budget_text(result, p), f"{p.seconds:.2f}"])
        css.append("chosen" if tuple(p.chunk_sizes) == chosen else
                   "" if result.budget_check(p).within_budget else "over")
    return Section("probes", f"Probes ({len(rows)})",
                   scroll(table(header, rows, left=(1, 2, 5), row_css=css), len(rows)))


def advice_section(advice: Sequence[str], notes: Sequence[str]) -> Optional[Section]:
    """The advice and the notes, when there are any."""
    body = ""
    if advice:
        body += "<h3>Advice</h3>" + bullet_list(advice)
    if notes:
        body += "<h3>Notes</h3>" + bullet_list(notes)
    return Section("advice", "Advice and notes", body) if body else None


def result_sections(result: "TuneResult") -> list[Section]:
    """The sections of a search's page, in order (a caller may add its own)."""
    out: list[Optional[Section]] = [_overview(result), _cards_section(result)]
    if result.objective == Objective.MAX_BATCH:
        out.append(_max_batch_section(result))
    if result.objective == Objective.THROUGHPUT:
        out.append(_time_section(result))
    out += [_fits_section(result), _probes_section(result),
            advice_section(result.advice, result.notes)]
    return [s for s in out if s is not None]


def render_result_html(result: "TuneResult", extra: Sequence[Section] = ()) -> str:
    """The page of a search's report (``report.html``); ``extra`` sections go last."""
    title = f"dptune report: {result.model_name} on {result.cluster}"
    return page(title, [*result_sections(result), *extra],
                subtitle=f"objective {result.objective}, backend {result.backend}")


def write_html(text: str, path: str) -> str:
    """Write ``text`` to ``path`` beside it first, then renamed into place; returns ``path``."""
    import os

    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
