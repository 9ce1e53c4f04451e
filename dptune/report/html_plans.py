"""The HTML pages of a DDP/FSDP2 plan (``dptune plan``) and of a length plan (``dptune search
--lengths``): their sections, built with :mod:`dptune.report.html`'s pieces."""

from __future__ import annotations

from typing import Any, Optional

from dptune.report.html import (Section, advice_section, e, key_facts, legend, page, scroll,
                                table)
from dptune.report.html_svg import COLORS, BarRow, Mark, Segment, Series, bar_rows, byte_ticks, xy_chart
from dptune.units import format_bytes

__all__ = ["plan_sections", "render_plan_html", "length_sections", "render_lengths_html"]

#: a marker per card, so identical cards stay apart on a chart
_MARKERS = ("o", "s", "v", "x")


def _axis_bytes(v: float) -> str:
    return format_bytes(int(v), precision=0) if v else "0"


# ---- DDP / FSDP2 ------------------------------------------------------------------------------

def plan_sections(plan: Any) -> list[Section]:
    """The split over the ranks, each rank's memory against its budget, the step times the
    planner measured (when it timed them), the table, the notes."""
    strategy = plan.strategy_name
    facts = [("per-rank batches", str(plan.batch_sizes) if plan.world_size <= 16 else
              f"{plan.world_size} ranks"), ("global batch", str(plan.global_batch)),
             ("objective", plan.objective), ("strategy", strategy)]
    if plan.micro_batches > 1:
        facts.append(("micro-batches", f"{plan.micro_batches} per optimizer step"))
    if plan.even_batch_size is not None:
        facts.append(("equal batches fit", f"at most {plan.even_batch_size}"))
    budgets = [r.budget_bytes for r in plan.ranks if r.budget_bytes is not None]
    if budgets:
        lo, hi = min(budgets), max(budgets)
        facts.append(("budget", format_bytes(lo) if lo == hi else
                      f"{format_bytes(lo)} to {format_bytes(hi)}"))
    out = [Section("overview", f"The plan ({strategy})",
                   key_facts(facts) + f"<p>{e(plan.describe_options())}</p>")]
    rows = _rank_rows(plan)
    if rows:
        body = (legend([(COLORS["allocated"], "peak (measured, else predicted)"),
                        ("hatch", "DDP's gradient buckets"), (COLORS["budget"], "budget (dashed)"),
                        (COLORS["card"], "card memory (grey track)")])
                + scroll(bar_rows(rows, unit=_axis_bytes, ticks=byte_ticks), len(rows)))
        out.append(Section("cards", f"Memory per rank ({len(rows)} ranks)", body))
    timed = _time_chart(plan)
    if timed:
        out.append(Section("step-time", "Step time per rank and batch", timed))
    out.append(Section("ranks", "Ranks", f"<pre>{e(plan.table())}</pre>"))
    notes = advice_section((), plan.notes)
    if notes is not None:
        out.append(notes)
    return out


def _rank_rows(plan: Any) -> list[BarRow]:
    rows = []
    for r in plan.ranks:
        peak = r.measured_peak_bytes if r.measured_peak_bytes is not None else r.predicted_peak_bytes
        if peak is None or r.budget_bytes is None:
            continue
        ddp = r.ddp_bytes if r.ddp_bytes is not None and 0 < r.ddp_bytes <= peak else 0
        segs = [Segment(peak - ddp, COLORS["allocated"], f"peak {format_bytes(peak)}", "seg-peak")]
        if ddp:
            segs.append(Segment(ddp, COLORS["fixed"], f"DDP buckets {format_bytes(ddp)}",
                                "seg-fixed", hatch=True))
        name = "" if r.device is None else f": {r.device.name}"
        share = f"{peak / r.budget_bytes:.0%}" if r.budget_bytes else "inf"
        rows.append(BarRow(f"rank {r.rank}{name}"[:22], tuple(segs),
                           (Mark(r.budget_bytes, COLORS["budget"],
                                 f"budget {format_bytes(r.budget_bytes)}", "budget", dashed=True),),
                           note=f"batch {r.batch_size} · {format_bytes(peak)} of "
                                f"{format_bytes(r.budget_bytes)} ({share})",
                           track=None if r.device is None else float(r.device.total_bytes),
                           css="card", data={"card": str(r.rank), "chunk": str(r.batch_size),
                                             "peak": str(peak), "budget": str(r.budget_bytes)}))
    return rows


def _time_chart(plan: Any) -> str:
    ranks = sorted({p.rank for p in plan.probes if p.seconds is not None})
    if not ranks:
        return ""
    shown = ranks if len(ranks) <= 8 else ranks[:8]
    series = []
    for k, r in enumerate(shown):
        pts = sorted((p.batch_size, p.seconds * 1e3) for p in plan.probes
                     if p.rank == r and p.seconds is not None)
        series.append(Series(f"rank {r}", tuple(b for b, _ in pts), tuple(t for _, t in pts),
                             _palette(k), marker=_MARKERS[k % 4],
                             dy=-2.0 * k, titles=tuple(f"rank {r}: batch {b}, {t:.2f} ms"
                                                       for b, t in pts)))
    planned = [(r.batch_size, t) for r in plan.ranks for t in
               [_time_at(plan, r.rank, r.batch_size)] if t is not None]
    if planned:
        series.append(Series("planned batch", tuple(b for b, _ in planned),
                             tuple(t for _, t in planned), COLORS["chosen"], marker="*"))
    more = "" if len(shown) == len(ranks) else \
        f'<p class="note">the first 8 of {len(ranks)} timed ranks</p>'
    return more + xy_chart(series, x_label="batch on the rank", y_label="step time",
                           y_unit=lambda v: f"{v:g} ms", width=640, height=300, css="xy time")


def _time_at(plan: Any, rank: int, batch: int) -> Optional[float]:
    ts = [p.seconds for p in plan.probes if p.rank == rank and p.batch_size == batch
          and p.seconds is not None]
    return ts[-1] * 1e3 if ts else None


def _palette(k: int) -> str:
    return ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
            "#17becf")[k % 8]


def render_plan_html(plan: Any) -> str:
    title = f"dptune {plan.strategy_name} plan: {plan.model_name or 'model'}" + \
        (f" on {plan.cluster}" if plan.cluster else "")
    return page(title, plan_sections(plan))


# ---- length plans -----------------------------------------------------------------------------

def length_sections(plan: Any, token_budget: str = "") -> list[Section]:
    """The staircase (each card's chunk against the length, identical cards offset and
    marked apart, axes from 0), the table per bucket, the token budget (``token_budget``: its
    one-line description, made by the caller above), the notes."""

    budgets = ", ".join(f"card {i} ({n}) {format_bytes(b)}" for i, (n, b) in
                        enumerate(zip(plan.devices, plan.budget_bytes)))
    facts = [("buckets", str(len(plan.buckets))), ("cards", str(len(plan.devices))),
             ("probes", f"{plan.probes} in {plan.seconds:.1f} s"),
             ("certified", "every bucket" if plan.certified else "NOT every bucket"),
             ("kind", "DDP ranks' own batches" if plan.ddp else "DataParallel split")]
    out = [Section("overview", "The plan", key_facts(facts)
                   + f'<p class="note">budgets: {e(budgets)}; headroom '
                     f"{e(format_bytes(plan.headroom_bytes))}</p>")]
    edges = (0.0, *(float(b.length) for b in plan.buckets))
    series = []
    shown = range(min(len(plan.devices), 8))
    for i in shown:
        ys = tuple(float(b.chunk_sizes[i]) for b in plan.buckets)
        series.append(Series(f"card {i} ({plan.devices[i]})", edges, ys, _palette(i),
                             kind="steps", dy=-2.0 * i))
    chart = xy_chart(series, x_label="padded length (bucket edges)",
                     y_label="largest chunk per card", y_unit=lambda v: f"{v:g}",
                     width=700, height=320, css="xy lengths")
    header = ["bucket", "lengths", "samples", "batch", "per card", "tokens/step", "binding card",
              "certified", "probes"]
    rows = [[str(k), f"({b.lo}, {b.length}]", str(b.samples), str(b.batch_size),
             " ".join(map(str, b.chunk_sizes)) if len(b.chunk_sizes) <= 16 else
             f"{len(b.chunk_sizes)} cards", f"{b.tokens_per_step:,}", str(b.binding_card),
             "yes" if b.certified else "no", str(b.probes)] for k, b in enumerate(plan.buckets)]
    more = "" if len(plan.devices) <= 8 else \
        f'<p class="note">the first 8 of {len(plan.devices)} cards</p>'
    out.append(Section("staircase", "Batch per length bucket",
                       more + chart + scroll(table(header, rows, left=(1, 4)), len(rows))))
    out.append(Section("token-budget", "Token budget",
                       f"<p>{e(token_budget)}</p>"))
    notes = advice_section((), plan.notes)
    if notes is not None:
        out.append(notes)
    return out


def render_lengths_html(plan: Any, token_budget: str = "") -> str:
    return page(f"dptune length plan: {plan.model_name} on {plan.cluster}",
                length_sections(plan, token_budget))

