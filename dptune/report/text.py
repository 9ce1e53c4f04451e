"""Text of a report: the terminal table, the Markdown summary, and the per-card and per-probe
``pandas`` tables (probes.csv). Probes are numbered from 1 everywhere (the tables, the text,
the plots and ``even.implied_by`` in report.json)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dptune.budget import RESERVED_BALANCE_MAPPED, RESERVED_CERTIFICATE, RESERVED_CERTIFICATE_LOOKED
from dptune.report.levels import budget_level, has_total, level_lines, split_memory
from dptune.report.tables import Align, markdown_table, text_table
from dptune.types import Objective
from dptune.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import pandas

    from dptune.backends.base import ProbeResult
    from dptune.result.model import TuneResult

__all__ = ["PLOT_KINDS", "plot_kinds", "device_label", "result_table", "probes_table",
           "render_table", "render_summary", "budget_text"]

PLOT_KINDS = ("peaks", "fits", "max_batch")


# ---- data -------------------------------------------------------------------------------

def plot_kinds(result: TuneResult) -> list[str]:
    """The plots that make sense for this result (``max_batch`` only for that objective)."""
    return [k for k in PLOT_KINDS if k != "max_batch" or result.objective == Objective.MAX_BATCH]


def device_label(result: TuneResult, i: int) -> str:
    """``"0: RTX 4090"``: the card's index and name."""
    d = result.devices[i]
    return f"{d.index}: {d.name}"


def result_table(result: TuneResult) -> "pandas.DataFrame":
    """One row per card: even split and its peak, dptune's split and its peak, budget, shares.

    Memory columns are ``int`` bytes; shares are fractions of the budget (1.0 = full).
    ``peak_bytes`` is at the budget level; where the allocator's figures are known, dptune's
    split also has ``allocated_peak_bytes``, ``reserved_peak_bytes`` and ``total_use_bytes``
    (:mod:`dptune.report.levels`).
    """
    import pandas as pd

    even = result.even
    even_shares = even.shares(result.budget_bytes)
    cards = split_memory(result, result.chunk_sizes, result.peak_bytes)
    rows = []
    for i, d in enumerate(result.devices):
        row = dict(
            device=d.index, name=d.name,
            even_chunk=even.chunk_sizes[i], even_peak_bytes=even.peak_bytes[i],
            even_oom=even.oom_device == i,
            chunk=result.chunk_sizes[i], peak_bytes=result.peak_bytes[i],
            budget_bytes=result.budget_bytes[i], total_bytes=d.total_bytes,
            even_share=even_shares[i], share=result.shares[i],
        )
        if cards is not None:
            row.update(allocated_peak_bytes=cards[i].allocated_bytes,
                       reserved_peak_bytes=cards[i].reserved_bytes,
                       total_use_bytes=cards[i].total_bytes)
        rows.append(row)
    return pd.DataFrame(rows).set_index("device")


_PROBE_ARRAYS = ("allocated_peak_bytes", "reserved_bytes", "total_bytes", "nvml_used_bytes",
                 "alloc_retries", "expandable_reserved_bytes", "repeat_spread_bytes")


def probes_table(result: TuneResult) -> "pandas.DataFrame":
    """One row per probe, in the order run (``probe`` numbered from 1): why, the split, whether
    the search counted it within budget and by how much, per-card peaks (bytes), OOM card.

    ``within_budget`` is what the search used: every card in use measured within its budget
    without running out of memory. ``margin_bytes`` is the smallest ``budget - peak`` over
    those cards (negative: over by that much; empty for an OOM probe, whose peaks are lower
    bounds), on card ``margin_card``. Per-card columns are ``chunk_<i>`` and ``peak_bytes_<i>``
    (at the budget level), plus the optional per-card figures the backend gave: at the
    reserved level ``allocated_peak_bytes_<i>``; the reserved peak ``reserved_bytes_<i>``, the
    predicted total use ``total_bytes_<i>``, NVML's ``nvml_used_bytes_<i>``,
    ``alloc_retries_<i>`` (``num_alloc_retries``), ``expandable_reserved_bytes_<i>`` (the
    reserved peak predicted with ``expandable_segments:True``), ...
    """
    import pandas as pd

    n = len(result.devices)
    present = [k for k in _PROBE_ARRAYS if any(getattr(p, k) is not None for p in result.probes)]
    rows = []
    for k, p in enumerate(result.probes, start=1):
        check = result.budget_check(p)
        row: dict[str, Any] = dict(probe=k, purpose=p.purpose, batch_size=p.batch_size,
                                   within_budget=check.within_budget,
                                   margin_bytes=check.margin_bytes, margin_card=check.card,
                                   oom_device=p.oom_device, seconds=round(p.seconds, 4))
        row.update({f"chunk_{i}": p.chunk_sizes[i] for i in range(n)})
        row.update({f"peak_bytes_{i}": p.peak_bytes[i] for i in range(n)})
        for key in present:
            values = getattr(p, key)
            row.update({f"{key}_{i}": (values[i] if values is not None else None) for i in range(n)})
        row["note"] = p.note
        rows.append(row)
    columns = (["probe", "purpose", "batch_size", "within_budget", "margin_bytes", "margin_card",
                "oom_device", "seconds"]
               + [f"chunk_{i}" for i in range(n)] + [f"peak_bytes_{i}" for i in range(n)]
               + [f"{k}_{i}" for k in present for i in range(n)] + ["note"])
    df = pd.DataFrame(rows, columns=columns)
    # Keep integer columns integer where values are missing (oom_device, optional figures).
    for col in columns:
        if col in ("margin_bytes", "margin_card", "oom_device") or any(
                col.startswith(k) for k in present):
            df[col] = df[col].astype("Int64")
    return df


def budget_text(result: TuneResult, probe: "ProbeResult") -> str:
    """Within budget or not, and by how much: ``"yes, 1.2 GiB to spare (card 3)"``,
    ``"no: card 2 over by 310 MiB"`` or ``"no: out of memory on card 1"``."""
    check = result.budget_check(probe)
    if check.margin_bytes is None:
        return f"no: out of memory on card {check.card}"
    if check.within_budget:
        return f"yes, {format_bytes(check.margin_bytes)} to spare (card {check.card})"
    return f"no: card {check.card} over by {format_bytes(-check.margin_bytes)}"


# ---- text -------------------------------------------------------------------------------

def _pct(share: float) -> str:
    return "inf" if math.isinf(share) else f"{share:.0%}"


def _ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _gain(result: TuneResult) -> str:
    """The gain over the even split, only as far as the probes prove it: a point when the
    even bracket is closed, a range when it is open but narrow, and when it is wide (or
    nothing bounds it) the words that say so, never a figure the probes do not prove."""
    g = result.batch_gain
    if g is None:
        return "" if not result.even.feasible else " (gain not proven)"
    if g.low == g.high:
        return f" ({g.low:+.0%})"
    if not g.proven:
        return " (gain not proven: the even split's largest batch was not bracketed)"
    return f" ({g.low:+.1%} to {g.high:+.1%})"


def _even_batch(result: TuneResult) -> str:
    """The even split's largest batch, as a range when its bracket is still open."""
    even = result.even
    if not even.open_bracket:
        return str(even.batch_size)
    if not even.feasible:
        return "none known to fit" + ("" if even.at_most is None else f" (at most {even.at_most})")
    if even.at_most is None:
        return f"at least {even.batch_size}"
    return f"{even.batch_size} to {even.at_most}"


def _table_rows(result: TuneResult) -> tuple[list[str], list[list[str]]]:
    """The per-card rows; where the allocator's figures are known, dptune's split also gets
    its allocated peak (at the reserved level, where the peak is another figure), reserved
    peak and total use."""
    cards = split_memory(result, result.chunk_sizes, result.peak_bytes)
    with_allocated = cards is not None and budget_level(result) == "reserved"
    total = cards is not None and has_total(cards)
    extra = ([] if cards is None else (["allocated"] if with_allocated else []) + ["reserved"]
             + (["total use"] if total else []))
    header = ["device", "even split", "peak", "dptune split", "peak", *extra, "budget",
              "share used"]
    even = result.even
    even_shares = even.shares(result.budget_bytes)
    rows = []
    for i in range(len(result.devices)):
        even_peak = "OOM" if even.oom_device == i else format_bytes(even.peak_bytes[i])
        if even.implied_by and even.peak_bytes[i] > 0:
            even_peak = f"<= {even_peak}"
        figures = []
        if cards is not None:
            c = cards[i]
            figures = (([format_bytes(c.allocated_bytes)] if with_allocated else [])
                       + [_bytes_or_dash(c.reserved_bytes)]
                       + ([_bytes_or_dash(c.total_bytes)] if total else []))
        rows.append([device_label(result, i), str(even.chunk_sizes[i]), even_peak,
                     str(result.chunk_sizes[i]), format_bytes(result.peak_bytes[i]), *figures,
                     format_bytes(result.budget_bytes[i]),
                     f"{_pct(even_shares[i])} -> {_pct(result.shares[i])}"])
    return header, rows


def _bytes_or_dash(b: Optional[int]) -> str:
    return "-" if b is None else format_bytes(b)


def _footer(result: TuneResult) -> list[str]:
    even = result.even
    lines = []
    if not even.feasible:
        card = device_label(result, even.oom_device) if even.oom_device is not None else "a card"
        lines.append(f"the even split runs out of memory on {card} "
                     "(its peaks are lower bounds)")
    if even.implied_by:
        names = ", ".join(f"#{k}" for k in even.implied_by)
        lines.append(f"the even split {list(even.chunk_sizes)} was not probed itself: probe(s) "
                     f"{names} measured every card within budget with at least as many samples "
                     "(card 0: and as large a batch), so it fits; its peaks are upper bounds")
    if even.on_model:
        lines.append(f"the even split's largest batch, {even.batch_size}, was found on the "
                     "allocator model past the probes' last known fit (every even batch replayed "
                     "there, this split and the next simulated, not probed): see the notes")
    even_imb = "not measured" if even.implied_by else _ratio(even.imbalance)
    lines.append(f"imbalance (max/min share of budget): even {even_imb} "
                 f"-> dptune {_ratio(result.imbalance)}")
    if result.card0_floor:
        lines.append("card 0 with no samples holds the largest share (a floor no split can "
                     "beat): the imbalance is among the cards that hold samples")
    if result.objective == Objective.MAX_BATCH:
        lines.append(f"max batch that fits: even {_even_batch(result)} -> balanced "
                     f"{result.batch_size}{_gain(result)}")
    if result.output_device != 0:
        lines.append(f"outputs gathered on card {result.output_device}: "
                     f"+{result.output_device_gain} samples over gathering on card 0")
    lines.append(_certificate(result))
    return lines


def _level_footer(result: TuneResult) -> list[str]:
    """The terminal's lines on the budget level: at the reserved level, or where the
    allocator's figures are shown (the title names the level in every case)."""
    lines = level_lines(result)
    return lines if budget_level(result) == "reserved" else lines[1:]


def _certificate(result: TuneResult) -> str:
    """One line: certified or not, and the brackets ``[lo, hi)`` that say why."""
    if not result.brackets:
        return "certified: no (no brackets recorded)"
    br = "; ".join(b.describe() for b in result.brackets)
    whole = [b for b in result.brackets if b.what == "batch"]
    if result.objective == Objective.MAX_BATCH and whole:
        # a largest batch needs only the whole batch's bracket closed; the cards' own
        # brackets say where each card's cap lies and may stay open
        cards = "; ".join(b.describe() for b in result.brackets if b.what != "batch")
        rest = f"; the cards' own brackets need not close: {cards}" if cards else ""
        if result.certified:
            return (f"certified: yes (one more sample does not fit: the whole batch's bracket "
                    f"{whole[0].describe().removeprefix('whole batch ')} is closed, which is "
                    f"all a largest batch needs{rest}){_monotone_caveat(result)}")
        return (f"certified: no (the whole batch's bracket "
                f"{whole[0].describe().removeprefix('whole batch ')} is still open{rest})")
    if result.certified and result.balance_map is not None:
        m = result.balance_map
        kept = (" by more than the tolerance: even split kept"
                if list(result.chunk_sizes) == list(result.even.chunk_sizes) else
                " by more than the tolerance: alike cards kept within one sample"
                if m.level > m.least else "")
        return (f"certified: yes (no split lowers the largest share{kept}; "
                f"{RESERVED_BALANCE_MAPPED}, {m.describe()})")
    if result.certified:
        why = ("one more sample does not fit" if result.objective == Objective.MAX_BATCH
               else "no split lowers the largest share")
        if result.objective == Objective.BALANCE and \
                list(result.chunk_sizes) == list(result.even.chunk_sizes):
            return ("certified: yes (even split kept: no split lowers its largest share by more "
                    f"than the tolerance; brackets at the floor the probes prove: {br})")
        return f"certified: yes ({why}; brackets {br})"
    return f"certified: no (brackets {br})"


def _monotone_caveat(result: TuneResult) -> str:
    """At the reserved level, what "one more sample does not fit" rests on: the figure not
    falling back under the budget at a larger batch (the allocator's fragmentation can make
    it; the search refuses to certify where its probes show it; on simulated cards it also
    looks past the over points on the allocator model: ``result.looked_past``)."""
    if budget_level(result) != "reserved":
        return ""
    looked = result.looked_past
    if looked is not None and looked.closed:
        return f"; {RESERVED_CERTIFICATE_LOOKED}"
    if looked is not None:
        return f"; {RESERVED_CERTIFICATE} (looked past on the allocator model: {looked.describe()})"
    return f"; {RESERVED_CERTIFICATE}"


def _subject(result: TuneResult) -> str:
    """``"Net on 4x24GB (simulated), bf16 autocast, accumulate 2"``: what was tuned, for what step."""
    return f"{result.model_name} on {result.cluster}, {result.settings.describe()}"


def _title(result: TuneResult) -> str:
    return (f"{_subject(result)}: batch {result.batch_size}, "
            f"objective {result.objective}, headroom {format_bytes(result.headroom_bytes)}, "
            f"budget level {budget_level(result)}")


def render_table(result: TuneResult) -> str:
    """The terminal table: per card the even split and its peak, dptune's split and its
    peak, the budget and the share of it used (even -> dptune); then the imbalance before
    and after and, for ``max_batch``, the largest batch each split fits."""
    header, rows = _table_rows(result)
    out = ([_title(result), *text_table(header, rows, _first_left(header))] + _footer(result)
           + _level_footer(result))
    return "\n".join(out)


def _first_left(header: Sequence[str]) -> list[Align]:
    """The first column (the card, the probe) to the left, the figures to the right."""
    return [Align.LEFT] + [Align.RIGHT] * (len(header) - 1)


def render_summary(result: TuneResult, plots: Optional[Sequence[str]] = None) -> str:
    """The Markdown summary that ``summary.md`` holds.

    ``plots`` are the kinds of plot embedded (files ``<kind>.png`` beside the summary);
    ``None`` means every kind :func:`plot_kinds` gives for this result, ``()`` none.
    """
    plots = plot_kinds(result) if plots is None else list(plots)
    md = [f"# dptune report: {result.model_name} on {result.cluster}", ""]
    requested = ("" if result.requested_batch_size in (None, result.batch_size)
                 else f" (asked for {result.requested_batch_size})")
    md += [
        f"- objective: `{result.objective}`; backend: `{result.backend}`",
        f"- training step: {result.settings.describe()} (the split is valid for this step only)",
        f"- batch size: {result.batch_size}{requested}",
        f"- split: `{list(result.chunk_sizes)}` (`gpu0_bsz={result.gpu0_bsz}`); "
        f"even split: `{list(result.even.chunk_sizes)}`",
        f"- headroom: {format_bytes(result.headroom_bytes)} per card",
        *(f"- {line}" for line in level_lines(result)),
        f"- probes: {result.num_probes} in {result.seconds:.1f} s",
        f"- {_certificate(result)}",
        "",
        "## Per card",
        "",
    ]
    header, rows = _table_rows(result)
    md += markdown_table(header, rows, _first_left(header))
    md += [""] + [f"- {line}" for line in _footer(result)] + [""]

    md += ["## Fits", "",
           "Memory of card *i* with chunk *c* at batch *B*: "
           "intercept + per sample x *c* + per batch sample x *B*.", ""]
    from dptune.report.fit_groups import group_note, report_fits

    fit_rows = [[device_label(result, i), format_bytes(f.intercept_bytes),
                 format_bytes(f.slope_bytes, precision=2),
                 format_bytes(f.batch_slope_bytes, precision=2),
                 format_bytes(f.max_error_bytes), str(f.points)]
                for i, f in enumerate(report_fits(result))]
    fit_header = ["device", "intercept", "per sample", "per batch sample", "max error", "points"]
    md += markdown_table(fit_header, fit_rows, _first_left(fit_header))
    md += [""] + [f"- {line}" for line in group_note(result)]
    md += ["- max error: the largest distance from the line to a probe it counts"
           " (every one, not only the two the line was drawn through)", ""]

    md += ["## Probes", ""]
    probe_rows = [[str(k), p.purpose or "-", str(list(p.chunk_sizes)),
                   ", ".join(format_bytes(b) for b in p.peak_bytes), budget_text(result, p),
                   f"{p.seconds:.2f}"]
                  for k, p in enumerate(result.probes, start=1)]
    md += markdown_table(["#", "purpose", "split", "peaks", "within budget", "seconds"], probe_rows,
                         [Align.RIGHT, *[Align.LEFT] * 4, Align.RIGHT])
    md += [""]

    for title, items in (("Advice", result.advice), ("Notes", result.notes)):
        if items:
            md += [f"## {title}", ""] + [f"- {x}" for x in items] + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{kind}]({kind}.png)" for kind in plots] + [""]
    md += ["Files: `report.json` (everything above, reload with `dptune show`), "
           "`probes.csv` (one row per probe, bytes).", ""]
    return "\n".join(md)


