"""Tables, plots and report folders for a :class:`~dptune.result.TuneResult`.

Render functions are pure: they return text, a ``pandas.DataFrame`` or a matplotlib
``Figure``; :func:`write_report` is the one that writes files. pandas and matplotlib are
imported inside the functions that need them, so importing this module is cheap. Plots are
drawn on a bare ``matplotlib.figure.Figure`` (no pyplot, no global backend change) unless
``show=True`` asks for a window.

A report folder holds::

    report.json    result.to_dict(), versioned (read back with read_report / TuneResult.load)
    probes.csv     one row per probe: split, per-card peaks in bytes, OOM card, seconds
    summary.md     the Markdown summary (render_summary)
    peaks.png      per-card peak memory, even split beside dptune's, against each budget
    fits.png       per-card memory against chunk size: probes, fitted lines, chosen split
    max_batch.png  (objective max_batch) largest batch that fits, even split vs dptune
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dptune.backends.base import CATEGORIES
from dptune.errors import OutputError, UsageError
from dptune.result import TuneResult, load_result, shares
from dptune.units import GiB, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    import pandas
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "PLOT_KINDS", "plot_kinds", "device_label", "result_table", "probes_table", "render_table",
    "render_summary", "plot_result", "write_report", "write_plots", "read_report",
    "check_output_folder", "REPORT_FILES", "DETAIL_CARDS", "fit_cards",
]

PLOT_KINDS = ("peaks", "fits", "max_batch")

# Colours: one per breakdown category (in CATEGORIES order), and the two splits.
_CATEGORY_COLORS = dict(zip(CATEGORIES, (
    "#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b3", "#937860", "#b0b0b0")))
_EVEN_COLOR = "#9e9e9e"
_DPTUNE_COLOR = "#1f77b4"
_BUDGET_COLOR = "#d62728"
#: Budgets are drawn when the highest peak is at least this share of the smallest budget.
_BUDGET_SCALE_SHARE = 0.3


# ---- data -------------------------------------------------------------------------------

def plot_kinds(result: TuneResult) -> list[str]:
    """The plots that make sense for this result (``max_batch`` only for that objective)."""
    return [k for k in PLOT_KINDS if k != "max_batch" or result.objective == "max_batch"]


def device_label(result: TuneResult, i: int) -> str:
    """``"0: RTX 4090"``: the card's index and name."""
    d = result.devices[i]
    return f"{d.index}: {d.name}"


def result_table(result: TuneResult) -> "pandas.DataFrame":
    """One row per card: even split and its peak, dptune's split and its peak, budget, shares.

    Memory columns are ``int`` bytes; shares are fractions of the budget (1.0 = full).
    """
    import pandas as pd

    even = result.even
    even_shares = shares(even.peak_bytes, result.budget_bytes)
    rows = []
    for i, d in enumerate(result.devices):
        rows.append(dict(
            device=d.index, name=d.name,
            even_chunk=even.chunk_sizes[i], even_peak_bytes=even.peak_bytes[i],
            even_oom=even.oom_device == i,
            chunk=result.chunk_sizes[i], peak_bytes=result.peak_bytes[i],
            budget_bytes=result.budget_bytes[i], total_bytes=d.total_bytes,
            even_share=even_shares[i], share=result.shares[i],
        ))
    return pd.DataFrame(rows).set_index("device")


_PROBE_ARRAYS = ("reserved_bytes", "nvml_used_bytes", "alloc_retries", "repeat_spread_bytes")


def probes_table(result: TuneResult) -> "pandas.DataFrame":
    """One row per probe, in the order run: why, the split, per-card peaks (bytes), OOM card.

    Per-card columns are ``chunk_<i>`` and ``peak_bytes_<i>``, plus the optional per-card
    figures (``reserved_bytes_<i>``, ...) that the backend measured.
    """
    import pandas as pd

    n = len(result.devices)
    present = [k for k in _PROBE_ARRAYS if any(getattr(p, k) is not None for p in result.probes)]
    rows = []
    for index, p in enumerate(result.probes):
        row: dict[str, Any] = dict(index=index, purpose=p.purpose, batch_size=p.batch_size,
                                   feasible=p.feasible, oom_device=p.oom_device,
                                   seconds=round(p.seconds, 4))
        row.update({f"chunk_{i}": p.chunk_sizes[i] for i in range(n)})
        row.update({f"peak_bytes_{i}": p.peak_bytes[i] for i in range(n)})
        for k in present:
            values = getattr(p, k)
            row.update({f"{k}_{i}": (values[i] if values is not None else None) for i in range(n)})
        row["note"] = p.note
        rows.append(row)
    columns = (["index", "purpose", "batch_size", "feasible", "oom_device", "seconds"]
               + [f"chunk_{i}" for i in range(n)] + [f"peak_bytes_{i}" for i in range(n)]
               + [f"{k}_{i}" for k in present for i in range(n)] + ["note"])
    df = pd.DataFrame(rows, columns=columns)
    # Keep integer columns integer where values are missing (oom_device, optional figures).
    for col in columns:
        if col == "oom_device" or any(col.startswith(k) for k in present):
            df[col] = df[col].astype("Int64")
    return df


# ---- text -------------------------------------------------------------------------------

def _pct(share: float) -> str:
    return "inf" if math.isinf(share) else f"{share:.0%}"


def _ratio(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.2f}"


def _gain(result: TuneResult) -> str:
    g, even = result.batch_gain, result.even
    if math.isinf(g):
        return ""
    if not even.open_bracket:
        return f" ({g:+.0%})"
    if not even.feasible:        # no even split known to fit: no gain to give
        return ""
    if even.at_most is None:
        return f" (at most {g:+.1%})"
    return f" ({result.batch_size / even.at_most - 1:+.1%} to {g:+.1%})"


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
    header = ["device", "even split", "peak", "dptune split", "peak", "budget", "share used"]
    even = result.even
    even_shares = shares(even.peak_bytes, result.budget_bytes)
    rows = []
    for i in range(len(result.devices)):
        even_peak = "OOM" if even.oom_device == i else format_bytes(even.peak_bytes[i])
        if even.implied_by and even.peak_bytes[i] > 0:
            even_peak = f"<= {even_peak}"
        rows.append([device_label(result, i), str(even.chunk_sizes[i]), even_peak,
                     str(result.chunk_sizes[i]), format_bytes(result.peak_bytes[i]),
                     format_bytes(result.budget_bytes[i]),
                     f"{_pct(even_shares[i])} -> {_pct(result.shares[i])}"])
    return header, rows


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
    even_imb = "not measured" if even.implied_by else _ratio(even.imbalance)
    lines.append(f"imbalance (max/min share of budget): even {even_imb} "
                 f"-> dptune {_ratio(result.imbalance)}")
    if result.card0_floor:
        lines.append("card 0 with no samples holds the largest share (a floor no split can "
                     "beat): the imbalance is among the cards that hold samples")
    if result.objective == "max_batch":
        lines.append(f"max batch that fits: even {_even_batch(result)} -> balanced "
                     f"{result.batch_size}{_gain(result)}")
    if result.output_device != 0:
        lines.append(f"outputs gathered on card {result.output_device}: "
                     f"+{result.output_device_gain} samples over gathering on card 0")
    lines.append(_certificate(result))
    return lines


def _certificate(result: TuneResult) -> str:
    """One line: certified or not, and the brackets ``[lo, hi)`` that say why."""
    if not result.brackets:
        return "certified: no (no brackets recorded)"
    br = "; ".join(b.describe() for b in result.brackets)
    if result.certified:
        why = ("one more sample does not fit" if result.objective == "max_batch"
               else "no split lowers the largest share")
        return f"certified: yes ({why}; brackets {br})"
    return f"certified: no (brackets {br})"
def _subject(result: TuneResult) -> str:
    """``"Net on 4x24GB (simulated), bf16 autocast, accumulate 2"``: what was tuned, for what step."""
    return f"{result.model_name} on {result.cluster}, {result.settings.describe()}"


def _title(result: TuneResult) -> str:
    return (f"{_subject(result)}: batch {result.batch_size}, "
            f"objective {result.objective}, headroom {format_bytes(result.headroom_bytes)}")


def render_table(result: TuneResult) -> str:
    """The terminal table: per card the even split and its peak, dptune's split and its
    peak, the budget and the share of it used (even -> dptune); then the imbalance before
    and after and, for ``max_batch``, the largest batch each split fits."""
    header, rows = _table_rows(result)
    numeric = [False, True, True, True, True, True, True]
    widths = [max(len(r[c]) for r in [header] + rows) for c in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()

    out = [_title(result), line(header)] + [line(r) for r in rows] + _footer(result)
    return "\n".join(out)


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]],
              numeric: Sequence[bool]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if num else "---" for num in numeric) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


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
        f"- probes: {result.num_probes} in {result.seconds:.1f} s",
        f"- {_certificate(result)}",
        "",
        "## Per card",
        "",
    ]
    header, rows = _table_rows(result)
    md += _md_table(header, rows, [False] + [True] * 6)
    md += [""] + [f"- {line}" for line in _footer(result)] + [""]

    md += ["## Fits", "",
           "Memory of card *i* with chunk *c* at batch *B*: "
           "intercept + per sample x *c* + per batch sample x *B*.", ""]
    fit_rows = [[device_label(result, i), format_bytes(f.intercept_bytes),
                 format_bytes(f.slope_bytes, precision=2),
                 format_bytes(f.batch_slope_bytes, precision=2),
                 format_bytes(f.max_error_bytes), str(f.points)]
                for i, f in enumerate(result.fits)]
    md += _md_table(["device", "intercept", "per sample", "per batch sample", "max error",
                     "points"], fit_rows, [False, True, True, True, True, True])
    md += [""]

    md += ["## Probes", ""]
    probe_rows = [[str(k), p.purpose or "-", str(list(p.chunk_sizes)),
                   ", ".join(format_bytes(b) for b in p.peak_bytes),
                   "yes" if p.feasible else f"OOM on card {p.oom_device}", f"{p.seconds:.2f}"]
                  for k, p in enumerate(result.probes)]
    md += _md_table(["#", "purpose", "split", "peaks", "fits", "seconds"], probe_rows,
                    [True, False, False, False, False, True])
    md += [""]

    for title, items in (("Advice", result.advice), ("Notes", result.notes)):
        if items:
            md += [f"## {title}", ""] + [f"- {x}" for x in items] + [""]
    if plots:
        md += ["## Plots", ""] + [f"![{kind}]({kind}.png)" for kind in plots] + [""]
    md += ["Files: `report.json` (everything above, reload with `dptune show`), "
           "`probes.csv` (one row per probe, bytes).", ""]
    return "\n".join(md)


# ---- plots ------------------------------------------------------------------------------

def _new_figure(figsize: tuple[float, float], show: bool) -> "Figure":
    if show:
        import matplotlib.pyplot as plt

        return plt.figure(figsize=figsize)
    from matplotlib.figure import Figure

    return Figure(figsize=figsize, layout="constrained")


def _stack(breakdown: Optional[dict[str, int]], peak: int) -> list[tuple[str, int]]:
    """(category, bytes) to stack for one bar; what the breakdown misses goes to "other"."""
    if not breakdown:
        return []
    parts = {c: int(breakdown.get(c, 0)) for c in CATEGORIES}
    for k, v in breakdown.items():  # categories a backend adds beyond the known ones
        if k not in parts:
            parts["other"] += int(v)
    missing = peak - sum(parts.values())
    if missing > 0:
        parts["other"] += missing
    return [(c, v) for c, v in parts.items() if v > 0]


def _budgets_on_scale(result: TuneResult, data_top: float) -> bool:
    """Draw the budgets only where the peaks reach a fair part of them: a model that uses
    3% of its cards would otherwise be a row of slivers under the budget lines."""
    return data_top >= _BUDGET_SCALE_SHARE * min(result.budget_bytes)


def _budgets_off_scale_text(result: TuneResult, data_top: float) -> str:
    lo, hi = min(result.budget_bytes), max(result.budget_bytes)
    budgets = format_bytes(lo) if lo == hi else f"{format_bytes(lo)} to {format_bytes(hi)}"
    return (f"budgets ({budgets}) are off the scale: the highest peak is "
            f"{_pct(data_top / lo)} of the smallest")


def _note_budgets_off_scale(result: TuneResult, data_top: float, ax: "Axes",
                            others: str = "") -> None:
    text = _budgets_off_scale_text(result, data_top) + (f"\n{others}" if others else "")
    ax.text(0.01, 0.98, text, transform=ax.transAxes, ha="left", va="top", fontsize=8,
            color=_BUDGET_COLOR)


#: Past this many cards the peaks plot shows each card's share of budget as a line (one point
#: per card) instead of bars, and the fits plot shows a few cards (card 0, the fullest and the
#: emptiest); the figure keeps its size whatever the card count.
DETAIL_CARDS = 24
#: Panels of the fits plot when there are more cards than that.
FIT_PANELS = 8
_OTHERS_COLOR = "#bdbdbd"


def _others_note(result: TuneResult) -> str:
    used = [(d.index, d.used_bytes) for d in result.devices if d.used_bytes > 0]
    if not used:
        return ""
    shown = ", ".join(f"card {i}: {format_bytes(b)}" for i, b in used[:4])
    more = f" and {len(used) - 4} more cards" if len(used) > 4 else ""
    return f"memory used by other processes: {shown}{more}"


def _draw_peaks(result: TuneResult, ax: "Axes") -> None:
    if len(result.devices) > DETAIL_CARDS:
        _draw_peak_shares(result, ax)
        return
    from matplotlib.patches import Patch

    n = len(result.devices)
    width = 0.38
    even = result.even
    bars = (("even", even.chunk_sizes, even.peak_bytes, even.breakdown, -width / 2),
            ("dptune", result.chunk_sizes, result.peak_bytes, result.breakdown, width / 2))
    used_categories: set[str] = set()
    ticks: list[tuple[float, str]] = []  # under each bar: which split, its chunk, share used
    data_top = max(max(even.peak_bytes), max(result.peak_bytes))
    budgets_shown = _budgets_on_scale(result, data_top)
    for label, chunks, peaks, breakdown, dx in bars:
        is_even = label == "even"
        bar_shares = shares(peaks, result.budget_bytes)
        for i in range(n):
            x = i + dx
            stack = _stack(breakdown[i] if breakdown else None, peaks[i])
            if stack:
                bottom = 0.0
                for cat, b in stack:
                    ax.bar(x, b / GiB, width, bottom=bottom, color=_CATEGORY_COLORS[cat],
                           alpha=0.55 if is_even else 1.0, hatch="//" if is_even else None,
                           edgecolor="white", linewidth=0.5)
                    bottom += b / GiB
                    used_categories.add(cat)
            else:
                ax.bar(x, peaks[i] / GiB, width, color=_EVEN_COLOR if is_even else _DPTUNE_COLOR)
            oom = is_even and even.oom_device == i
            if oom:
                ax.bar(x, peaks[i] / GiB, width, fill=False, edgecolor=_BUDGET_COLOR, linewidth=2)
            used = "OOM" if oom else _pct(bar_shares[i])
            if is_even and even.implied_by and not oom:
                used = f"<= {used}"      # not probed: the dominating probe's figures
            ticks.append((x, f"{label}\n{chunks[i]} samples\n{used}"))
    others = _others_note(result)
    first_other = next((i for i, d in enumerate(result.devices) if d.used_bytes > 0), None)
    if budgets_shown:
        for i, budget in enumerate(result.budget_bytes):
            d = result.devices[i]
            ax.hlines(budget / GiB, i - 0.48, i + 0.48, colors=_BUDGET_COLOR, linestyles="--",
                      linewidth=1.5, label="budget" if i == 0 else "_")
            ax.hlines(d.total_bytes / GiB, i - 0.48, i + 0.48, colors="black",
                      linestyles=":", linewidth=1, label="card memory" if i == 0 else "_")
            if d.used_bytes > 0:   # at the top of the card: what others hold there
                ax.bar(i, d.used_bytes / GiB, 0.96, bottom=(d.total_bytes - d.used_bytes) / GiB,
                       color=_OTHERS_COLOR, hatch="xx", edgecolor="white", linewidth=0.5,
                       label="used by other processes" if i == first_other else "_")
        top = max(data_top, *result.budget_bytes, *(d.total_bytes for d in result.devices))
        ax.set_ylim(0, top / GiB * 1.08)
    else:
        _note_budgets_off_scale(result, data_top, ax, others)
        ax.set_ylim(0, data_top / GiB * 1.15)
    ticks.sort()
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], minor=True, fontsize=7)
    ax.set_xticks(range(n), [device_label(result, i) for i in range(n)], fontsize=8)
    ax.tick_params(axis="x", which="major", length=0, pad=34)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("peak memory (GiB)")
    ax.text(-0.01, -0.01, "split\nsamples on the card\nshare of budget", transform=ax.transAxes,
            ha="right", va="top", fontsize=7, color="#555555")
    batches = (f"batch {result.batch_size}" if even.batch_size == result.batch_size
               else f"even at batch {even.batch_size}, dptune at batch {result.batch_size}")
    bound = (f"; not probed, upper bounds from probe {', '.join(f'#{k}' for k in even.implied_by)}"
             if even.implied_by else "")
    ax.set_title(f"{_subject(result)}: peak memory per card\n"
                 f"even split (hatched, left{bound}) vs dptune (right), {batches}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if used_categories:
        handles += [Patch(color=_CATEGORY_COLORS[c], label=c)
                    for c in CATEGORIES if c in used_categories]
    else:
        handles += [Patch(color=_EVEN_COLOR, label="even split"),
                    Patch(color=_DPTUNE_COLOR, label="dptune split")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def _draw_peak_shares(result: TuneResult, ax: "Axes") -> None:
    """Many cards: each card's peak as a share of its budget, one point per card and split."""
    n = len(result.devices)
    even = result.even
    xs = list(range(n))
    even_shares = [s * 100 for s in shares(even.peak_bytes, result.budget_bytes)]
    ours = [s * 100 for s in result.shares]
    marker: dict[str, Any] = dict(marker="o", markersize=2.5 if n <= 200 else 0, linewidth=1)
    ax.plot(xs, even_shares, color=_EVEN_COLOR, label=f"even split (batch {even.batch_size})",
            **marker)
    ax.plot(xs, ours, color=_DPTUNE_COLOR, label=f"dptune (batch {result.batch_size})", **marker)
    ax.axhline(100, color=_BUDGET_COLOR, linestyle="--", linewidth=1.2, label="budget")
    others = [i for i, d in enumerate(result.devices) if d.used_bytes > 0]
    if others:
        ax.scatter(others, [0] * len(others), marker="|", s=60, color="#636363", clip_on=False,
                   label="card with memory used by other processes")
    if even.oom_device is not None:
        ax.scatter([even.oom_device], [even_shares[even.oom_device]], marker="x", s=50,
                   color=_BUDGET_COLOR, zorder=3, label="even split runs out of memory here")
    top = max(max(even_shares), max(ours), 100.0)
    ax.set_ylim(0, top * 1.1)
    ax.set_xlim(-0.5, n - 0.5)
    ax.set_xlabel(f"card (0 to {n - 1})")
    ax.set_ylabel("peak memory, share of budget (%)")
    ax.set_title(f"{result.model_name} on {result.cluster}: peak memory per card as a share of "
                 f"its budget\n{n} cards (one point per card; the split is in summary.md and "
                 "report.json)", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)


def _draw_fit(result: TuneResult, i: int, ax: "Axes", color: str = _DPTUNE_COLOR,
              one_card: bool = True, budget_shown: bool = True) -> None:
    """Card i's probes, as measured, and its fitted line at the chosen batch size.

    On the card that gathers the outputs memory also grows with the whole batch, so probes
    run at another batch size do not lie on the line at the chosen batch: they are drawn
    hollow, at what they measured, never moved to the chosen batch (where a split that fitted
    could seem over the budget).
    """
    B = result.batch_size
    fit = result.fits[i]
    probes = result.probes
    other_batch = fit.batch_slope_bytes != 0

    def here_batch(p: Any) -> bool:
        return not other_batch or p.batch_size == B

    chunks = [p.chunk_sizes[i] for p in probes] + [result.chunk_sizes[i]]
    xs = [0.0, max(1, max(chunks)) * 1.15]
    name = device_label(result, i)
    ax.plot(xs, [(fit.intercept_bytes + fit.slope_bytes * c + fit.batch_slope_bytes * B) / GiB
                 for c in xs], color=color, linewidth=1.5,
            label=f"fit at batch {B}" if one_card else f"{name}: fit")
    ok = [p for p in probes if p.feasible and here_batch(p)]
    elsewhere_batch = [p for p in probes if p.feasible and not here_batch(p)]
    bad = [p for p in probes if not p.feasible]
    ax.scatter([p.chunk_sizes[i] for p in ok], [p.peak_bytes[i] / GiB for p in ok], s=22,
               color=color, edgecolors="black", linewidths=0.5, zorder=3,
               label="probe" if one_card else "_")
    if elsewhere_batch:
        ax.scatter([p.chunk_sizes[i] for p in elsewhere_batch],
                   [p.peak_bytes[i] / GiB for p in elsewhere_batch], s=22, facecolors="none",
                   edgecolors="#555555", linewidths=1, zorder=3,
                   label="probe at another batch size" if one_card else "_")
    here = [p for p in bad if p.oom_device == i]
    elsewhere = [p for p in bad if p.oom_device != i]
    if here:
        ax.scatter([p.chunk_sizes[i] for p in here], [p.peak_bytes[i] / GiB for p in here],
                   s=40, marker="x", color=_BUDGET_COLOR, zorder=3,
                   label="ran out of memory here" if one_card else "_")
    if elsewhere:
        ax.scatter([p.chunk_sizes[i] for p in elsewhere], [p.peak_bytes[i] / GiB for p in elsewhere],
                   s=22, marker="v", facecolors="none", edgecolors=color, linewidths=1, zorder=3,
                   label="stopped by OOM on another card (lower bound)" if one_card else "_")
    ax.scatter([result.chunk_sizes[i]], [result.peak_bytes[i] / GiB], s=160, marker="*",
               color="gold", edgecolors="black", linewidths=0.7, zorder=4,
               label="dptune split" if one_card else "_")
    if budget_shown:
        ax.axhline(result.budget_bytes[i] / GiB, color=_BUDGET_COLOR if one_card else color,
                   linestyle="--", linewidth=1, label="budget" if one_card else "_")
    if one_card:
        ax.set_title(name + ("\n(memory also grows with the batch)" if other_batch else ""),
                     fontsize=9)


def fit_cards(result: TuneResult) -> list[int]:
    """The cards the fits plot shows: all of them up to :data:`DETAIL_CARDS`, else card 0 and
    the fullest and emptiest cards under dptune's split (:data:`FIT_PANELS` in all)."""
    n = len(result.devices)
    if n <= DETAIL_CARDS:
        return list(range(n))
    order = sorted(range(1, n), key=lambda i: (-result.shares[i], i))
    fullest = order[: (FIT_PANELS - 1) - (FIT_PANELS - 1) // 2]
    emptiest = order[::-1][: (FIT_PANELS - 1) // 2]
    return sorted({0, *fullest, *emptiest})


def _draw_fits(result: TuneResult, fig: Any, ax: Optional["Axes"]) -> None:
    cards = fit_cards(result)
    n = len(cards)
    data_top = max([max(p.peak_bytes) for p in result.probes] + result.peak_bytes)
    shown = _budgets_on_scale(result, data_top)
    if ax is not None:  # one axes given: the cards on it, one colour each
        for k, i in enumerate(cards):
            _draw_fit(result, i, ax, color=f"C{k % 10}", one_card=False, budget_shown=shown)
        if not shown:
            _note_budgets_off_scale(result, data_top, ax)
        ax.set_xlabel("samples on the card")
        ax.set_ylabel("peak memory (GiB)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        return
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True)
    for k, a in enumerate(axes.flat):
        if k >= n:
            a.set_visible(False)
            continue
        _draw_fit(result, cards[k], a, budget_shown=shown)
        a.grid(alpha=0.3)
        if k // ncols == nrows - 1:
            a.set_xlabel("samples on the card")
        if k % ncols == 0:
            a.set_ylabel("peak memory (GiB)")
    first = axes.flat[0]
    first.set_ylim(0, first.get_ylim()[1] * 1.05)  # shared by every card
    seen: dict[str, Any] = {}
    for a in axes.flat[:n]:  # an OOM probe may only show on some cards
        for h, lab in zip(*a.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center",
               ncol=min(len(seen), 4), fontsize=8)
    off_scale = "" if shown else "\n" + _budgets_off_scale_text(result, data_top)
    subset = ("" if n == len(result.devices) else
              f"\n{n} of {len(result.devices)} cards: card 0, the fullest and the emptiest "
              "under dptune's split")
    fig.suptitle(f"{_subject(result)}: memory against chunk size "
                 f"({result.num_probes} probes){subset}{off_scale}", fontsize=10)


def _draw_max_batch(result: TuneResult, ax: "Axes") -> None:
    n = len(result.devices)
    per_card = n <= DETAIL_CARDS / 2   # beyond, the bars are totals (the split is in the summary)
    bars = (("even split", result.even.chunk_sizes), ("dptune", result.chunk_sizes))
    for x, (_, chunks) in enumerate(bars):
        if not per_card:
            ax.bar(x, sum(chunks), 0.6, color=_EVEN_COLOR if x == 0 else _DPTUNE_COLOR)
            ax.text(x, sum(chunks), f"{sum(chunks)}", ha="center", va="bottom", fontsize=11,
                    fontweight="bold")
            continue
        bottom = 0
        for i, c in enumerate(chunks):
            if c == 0:
                continue
            ax.bar(x, c, 0.6, bottom=bottom, color=f"C{i % 10}", edgecolor="white",
                   label=device_label(result, i) if x == 1 or result.chunk_sizes[i] == 0 else "_")
            if c >= 0.06 * max(result.batch_size, 1):
                ax.text(x, bottom + c / 2, str(c), ha="center", va="center", fontsize=8,
                        color="white")
            bottom += c
        ax.text(x, bottom, f"{bottom}", ha="center", va="bottom", fontsize=11, fontweight="bold")
    ax.set_xticks([0, 1], [b[0] for b in bars])
    ax.set_xlim(-0.7, 1.7)
    ax.set_ylim(0, max(result.batch_size, result.even.batch_size, 1) * 1.25)
    ax.set_ylabel("largest batch that fits (samples)")
    cards = "" if per_card else f" over {n} cards"
    ax.set_title(f"{_subject(result)}: largest batch that fits{cards}\n"
                 f"even {_even_batch(result)} -> dptune {result.batch_size}{_gain(result)}",
                 fontsize=10)
    if per_card:
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, labels, title="samples per card", fontsize=7, title_fontsize=7,
                  loc="upper left", ncol=2 if n > 4 else 1)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)


def plot_result(result: TuneResult, kind: str = "peaks", ax: Optional["Axes"] = None,
                show: bool = False) -> "Figure":
    """Draw one of the report's plots and return its ``Figure``.

    ``kind``: ``"peaks"`` (per-card peaks, even vs dptune, stacked by category where the
    backend knows them, each card's budget and what other processes hold; past
    :data:`DETAIL_CARDS` cards, each card's share of budget), ``"fits"`` (memory against
    chunk size per card: probes, fitted lines, the chosen split; past :data:`DETAIL_CARDS`
    cards, card 0 and the fullest and emptiest) or ``"max_batch"`` (largest batch, even vs
    dptune; only for that objective). With ``ax`` the plot is drawn into it (``fits`` then
    puts the cards on it); ``show=True`` opens it with pyplot. The figure's size does not
    grow past a few dozen cards.
    """
    if kind not in PLOT_KINDS:
        raise UsageError(f"unknown plot kind {kind!r}; choose one of {', '.join(PLOT_KINDS)}")
    if kind not in plot_kinds(result):
        raise UsageError(f"the {kind} plot compares the largest batch each split fits, which only "
                         f"a search with --objective max-batch finds; this report's objective is "
                         f"{result.objective}: choose {' or '.join(plot_kinds(result))}")
    n = len(result.devices)
    fig: Any
    if ax is not None:
        fig = ax.figure
    elif kind == "fits":
        panels = len(fit_cards(result))
        ncols = min(panels, 4)
        fig = _new_figure((3.2 * ncols + 0.6, 3.0 * math.ceil(panels / ncols) + 1.3), show)
    elif kind == "peaks":
        wide = 2.1 * n + 3.0 if n <= DETAIL_CARDS else 12.0
        fig = _new_figure((max(7.0, wide), 5.4), show)
    else:
        fig = _new_figure((6.0, 5.2), show)
    if kind == "fits":
        _draw_fits(result, fig, ax)
    else:
        target = ax if ax is not None else fig.add_subplot()
        (_draw_peaks if kind == "peaks" else _draw_max_batch)(result, target)
    if show:
        import matplotlib.pyplot as plt

        plt.show()
    return fig


# ---- files ------------------------------------------------------------------------------

#: What a report folder holds; an existing folder with only these (or nothing) is replaced.
REPORT_FILES = ("report.json", "probes.csv", "summary.md") + tuple(f"{k}.png" for k in PLOT_KINDS)


def check_output_folder(directory: str | pathlib.Path, flag: str = "--out", *,
                        report: bool = False) -> pathlib.Path:
    """Check early that ``directory`` can become a folder of files (before minutes of probing).

    Raises :class:`OutputError` in one line when it is an existing file, lies under a file,
    or its nearest existing parent is not writable; with ``report``, also when it is a folder
    holding anything but a report's files (which :func:`write_report` would replace).
    Returns the path.
    """
    out = pathlib.Path(directory)
    what = f"{flag} {str(out)!r}"
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} is an existing file, not a folder; give a folder path "
                          "(it is created if missing)")
    parent = out
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{what} lies under {str(parent)!r}, which is a file; give a folder "
                          "path that is not inside a file")
    if parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: {str(parent)!r} is not writable; give a folder you can "
                          "write to")
    if report and out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputError(f"{what} already holds files that are not a dptune report "
                              f"({shown}); give a new or empty folder")
    return out


def _output_error(e: OSError, out: pathlib.Path, flag: str) -> OutputError:
    reason = e.strerror or type(e).__name__
    return OutputError(f"cannot write to {flag} {str(out)!r}: {reason}"
                       f"{f' ({e.filename})' if e.filename and str(e.filename) != str(out) else ''}"
                       "; give a folder you can write to")


def write_report(result: TuneResult, directory: str | pathlib.Path, *,
                 plots: bool = True, flag: str = "--out") -> pathlib.Path:
    """Write report.json, probes.csv, summary.md and (unless ``plots=False``) the PNG plots
    into ``directory``; returns the folder.

    Atomic: everything is written into a temporary folder beside it, which is renamed into
    place at the end, so an error or Ctrl-C leaves either the old folder or the new one,
    never a partial one. An existing folder is replaced only when it holds nothing but a
    report's files; a folder with anything else raises :class:`OutputError`, as does a
    path that cannot be written (``flag`` names the option in the message).
    """
    out = check_output_folder(directory, flag, report=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise _output_error(e, out, flag) from None
    old: Optional[pathlib.Path] = None
    try:
        (tmp / "report.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n",
                                         encoding="utf-8")
        probes_table(result).to_csv(tmp / "probes.csv", index=False)
        kinds = write_plots(result, tmp) if plots else []
        (tmp / "summary.md").write_text(render_summary(result, plots=kinds), encoding="utf-8")
        os.chmod(tmp, 0o777 & ~_umask())   # mkdtemp makes it private; a report is not
        if out.exists():
            old = out.with_name(f".{out.name}.{os.getpid()}.old")
            shutil.rmtree(old, ignore_errors=True)   # left by a run that was killed
            os.replace(out, old)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
            old = None
        raise _output_error(e, out, flag) from None
    except BaseException:  # Ctrl-C, or an error while rendering: no partial folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_plots(result: TuneResult, directory: str | pathlib.Path,
                kinds: Optional[Sequence[str]] = None, *, flag: str = "--out") -> list[str]:
    """Draw ``kinds`` (default: every plot of :func:`plot_kinds`) into ``<directory>/<kind>.png``
    and return them. Each file is written beside its final name and renamed into place."""
    out = check_output_folder(directory, flag)
    kinds = plot_kinds(result) if kinds is None else list(kinds)
    figures = {kind: plot_result(result, kind=kind) for kind in kinds}  # refusals come first
    try:
        out.mkdir(parents=True, exist_ok=True)
        for kind, fig in figures.items():
            tmp = out / f".{kind}.png.tmp"
            try:
                fig.savefig(tmp, dpi=_dpi(fig), format="png")
                os.replace(tmp, out / f"{kind}.png")
            finally:
                if tmp.exists():
                    tmp.unlink()
    except OSError as e:
        raise _output_error(e, out, flag) from None
    return kinds


#: Largest PNG side in pixels: a figure is drawn at a lower resolution rather than wider.
_MAX_PIXELS = 4000


def _dpi(fig: "Figure") -> float:
    w, h = fig.get_size_inches()
    return min(120.0, _MAX_PIXELS / max(w, h, 1.0))


def read_report(path: str | pathlib.Path) -> TuneResult:
    """Read and check a result from a report folder or its ``report.json``: the one reader,
    :func:`dptune.result.load_result` (also ``TuneResult.load``)."""
    return load_result(path)
