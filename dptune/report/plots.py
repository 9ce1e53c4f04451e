"""Plots of a report: ``peaks``, ``fits`` and ``max_batch`` (:func:`plot_result`).

Drawn on a bare ``matplotlib.figure.Figure`` (no pyplot, no global backend change) unless
``show=True`` asks for a window; matplotlib is imported inside the functions. Titles are
wrapped to the figure's width, and the one "highest peak" a report's plots quote is
:func:`highest_peak` (every probe and both splits).
"""

from __future__ import annotations

import math
import textwrap
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

from dptune.backends.base import CATEGORIES
from dptune.errors import UsageError
from dptune.report.text import PLOT_KINDS, _even_batch, _gain, _pct, _subject, device_label, plot_kinds
from dptune.units import GiB, format_bytes
from dptune.report.levels import CardMemory, budget_level, split_memory

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dptune.result.model import TuneResult

__all__ = ["plot_result", "fit_cards", "highest_peak", "DETAIL_CARDS", "FIT_PANELS"]

# Colours: one per breakdown category (in CATEGORIES order), and the two splits.
_CATEGORY_COLORS = dict(zip(CATEGORIES, (
    "#4c72b0", "#55a868", "#c44e52", "#dd8452", "#8172b3", "#937860", "#b0b0b0")))
_EVEN_COLOR = "#9e9e9e"
_DPTUNE_COLOR = "#1f77b4"
_BUDGET_COLOR = "#d62728"
_RESERVED_COLOR = "#222222"
_FIXED_COLOR = "#dd8452"
#: Budgets are drawn when the highest peak is at least this share of the smallest budget.
_BUDGET_SCALE_SHARE = 0.3


def highest_peak(result: TuneResult) -> int:
    """The highest peak of the report: over every probe, the even split and dptune's split.

    The one figure both plots quote ("the highest peak is x% of the smallest budget") and
    decide the budgets' scale by, so two plots of one report never give two percentages.
    """
    return max([max(p.peak_bytes) for p in result.probes] + list(result.peak_bytes)
               + list(result.even.peak_bytes))


def _axes_width(ax: "Axes", legend_right: bool = False) -> float:
    """The width in inches a title over ``ax`` may take (less a legend drawn to its right)."""
    fig: Any = ax.figure
    width = fig.get_figwidth() * ax.get_position().width + 0.4
    return width - (2.0 if legend_right else 0.0)


def _compact_counts(axis: Any) -> None:
    """Sample counts on ``axis`` as ``12k``, ``3.5M``: 8-digit counts would run together."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    def fmt(x: float, _pos: Any) -> str:
        for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e4, "k")):
            if abs(x) >= scale:
                return f"{x / scale:.3g}{suffix}"
        return f"{x:.0f}"

    axis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    axis.set_major_formatter(FuncFormatter(fmt))


def _wrap_title(text: str, width_inches: float, fontsize: float) -> str:
    """``text`` with each line wrapped to ``width_inches`` at ``fontsize`` points (an average
    character is taken as 0.6 em wide: a safe bound for DejaVu Sans' letters and digits)."""
    chars = max(20, int(width_inches * 72 / (0.6 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) if line else line for line in text.split("\n"))


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


class _Bars(NamedTuple):
    """One split's bars on the peaks plot (the even split on the left, dptune's on the right)."""

    label: str                # "even" or "dptune", also the first row under each bar
    chunks: Sequence[int]
    peaks: Sequence[int]
    breakdown: Optional[Sequence[dict[str, int]]]
    dx: float                 # the offset of the bar from its card's tick


def _draw_peaks(result: TuneResult, ax: "Axes") -> None:
    if len(result.devices) > DETAIL_CARDS:
        _draw_peak_shares(result, ax)
        return
    width = 0.38
    even = result.even
    bars = (_Bars("even", even.chunk_sizes, even.peak_bytes, even.breakdown, -width / 2),
            _Bars("dptune", result.chunk_sizes, result.peak_bytes, result.breakdown, width / 2))
    used_categories: set[str] = set()
    ticks: list[tuple[float, str]] = []  # under each bar: which split, its chunk, share used
    memory = {b.label: split_memory(result, b.chunks, b.peaks) for b in bars}
    data_top = max(max(even.peak_bytes), max(result.peak_bytes),   # the bars' top
                   *(c.total_bytes or c.reserved_bytes or 0
                     for cards in memory.values() if cards for c in cards))
    highest = highest_peak(result)
    budgets_shown = _budgets_on_scale(result, highest)
    for b in bars:
        _draw_split_bars(result, ax, b, width, memory[b.label], used_categories, ticks)
    others = _others_note(result)
    if budgets_shown:
        _draw_card_lines(result, ax, data_top)
    else:
        _note_budgets_off_scale(result, highest, ax, others)
        ax.set_ylim(0, data_top / GiB * 1.15)
    _label_peaks(result, ax, ticks)
    _peaks_legend(ax, used_categories)


def _draw_split_bars(result: TuneResult, ax: "Axes", bars: _Bars, width: float,
                     cards: Optional[Sequence[CardMemory]], used_categories: set[str],
                     ticks: list[tuple[float, str]]) -> None:
    """One split's bar on every card (stacked by category where the breakdown is known), and
    the rows under it in ``ticks``; the categories drawn are added to ``used_categories``."""
    even = result.even
    is_even = bars.label == "even"
    bar_shares = [p / b if b > 0 else math.inf for p, b in zip(bars.peaks, result.budget_bytes)]
    for i in range(len(result.devices)):
        x = i + bars.dx
        # with the allocator's figures the bar is the allocated peak (its breakdown), the
        # reserved peak an outline above it and the total use a black tick
        height = bars.peaks[i] if cards is None else cards[i].allocated_bytes
        stack = _stack(bars.breakdown[i] if bars.breakdown else None, height)
        if stack:
            bottom = 0.0
            for cat, b in stack:
                ax.bar(x, b / GiB, width, bottom=bottom, color=_CATEGORY_COLORS[cat],
                       alpha=0.55 if is_even else 1.0, hatch="//" if is_even else None,
                       edgecolor="white", linewidth=0.5)
                bottom += b / GiB
                used_categories.add(cat)
        else:
            ax.bar(x, height / GiB, width, color=_EVEN_COLOR if is_even else _DPTUNE_COLOR)
        if cards is not None:
            _draw_reserved(ax, x, width, cards[i], first=(i == 0 and not is_even))
            _draw_fixed(ax, x, width, cards[i], bars.peaks[i], first=(i == 0 and not is_even))
        oom = is_even and even.oom_device == i
        if oom:
            ax.bar(x, bars.peaks[i] / GiB, width, fill=False, edgecolor=_BUDGET_COLOR, linewidth=2)
        used = "OOM" if oom else _pct(bar_shares[i])
        if is_even and even.implied_by and not oom:
            used = f"<= {used}"      # not probed: the dominating probe's figures
        ticks.append((x, f"{bars.label}\n{bars.chunks[i]}\n{used}"))


def _draw_card_lines(result: TuneResult, ax: "Axes", data_top: int) -> None:
    """Each card's budget and memory as lines, what other processes hold at its top, and the
    y range that shows them all."""
    first_other = next((i for i, d in enumerate(result.devices) if d.used_bytes > 0), None)
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


def _label_peaks(result: TuneResult, ax: "Axes", ticks: list[tuple[float, str]]) -> None:
    """The rows under the bars, the cards' names, the axis labels and the title."""
    n = len(result.devices)
    even = result.even
    ticks.sort()
    ax.set_xticks([t[0] for t in ticks], [t[1] for t in ticks], minor=True, fontsize=7)
    ax.set_xticks(range(n), [device_label(result, i) for i in range(n)], fontsize=8)
    ax.tick_params(axis="x", which="major", length=0, pad=34)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel("peak memory (GiB)")
    ax.annotate("split\nsamples on the card\nshare of budget", (0, 0), xycoords="axes fraction",
                xytext=(-6, -6), textcoords="offset points", ha="right", va="top", fontsize=7,
                color="#555555")     # below the y axis' "0", level with the rows under the bars
    batches = (f"batch {result.batch_size}" if even.batch_size == result.batch_size
               else f"even at batch {even.batch_size}, dptune at batch {result.batch_size}")
    bound = (f"; not probed, upper bounds from probe {', '.join(f'#{k}' for k in even.implied_by)}"
             if even.implied_by else
             "; its largest batch found on the allocator model, simulated" if even.on_model else "")
    level = ("; shares of budget at the reserved level (reserved + NCCL)"
             if budget_level(result) == "reserved" else "")
    ax.set_title(_wrap_title(f"{_subject(result)}: peak memory per card{level}\n"
                             f"even split (hatched, left{bound}) vs dptune (right), {batches}",
                             _axes_width(ax, legend_right=True), 10), fontsize=10)


def _peaks_legend(ax: "Axes", used_categories: set[str]) -> None:
    """The legend right of the plot: the lines drawn, then the categories (or the two splits)."""
    from matplotlib.patches import Patch

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


def _draw_reserved(ax: "Axes", x: float, width: float, card: CardMemory, first: bool) -> None:
    """The reserved peak as a dashed outline from the floor (above the allocated bar); the
    card's total use (which also counts the CUDA context the budget leaves out) as a black
    marker at the bar's side, to be read against the card's memory (the dotted line), not
    against the budget."""
    if card.reserved_bytes is not None:
        ax.bar(x, card.reserved_bytes / GiB, width, fill=False, edgecolor=_RESERVED_COLOR,
               linestyle="--", linewidth=1.0, label="reserved peak" if first else "_")
    if card.total_bytes is not None:
        ax.plot([x + width / 2], [card.total_bytes / GiB], marker="<", markersize=6,
                color=_RESERVED_COLOR, linestyle="none", gid="total-use",
                label="total use (nvidia-smi), against the card's memory" if first else "_")


def _draw_fixed(ax: "Axes", x: float, width: float, card: CardMemory, peak: int,
                first: bool) -> None:
    """What the budget level adds to the reserved peak (NCCL's buffers: the budget's fixed
    costs) as a hatched segment on top of it, so the bar ends at the peak the budget was
    checked on: a card at 100% of its budget reaches its budget line."""
    if card.reserved_bytes is None or peak <= card.reserved_bytes:
        return
    ax.bar(x, (peak - card.reserved_bytes) / GiB, width, bottom=card.reserved_bytes / GiB,
           color="white", edgecolor=_FIXED_COLOR, hatch="xxx", linewidth=0.8, gid="fixed-costs",
           label="budget's fixed costs (NCCL's buffers)" if first else "_")


def _draw_peak_shares(result: TuneResult, ax: "Axes") -> None:
    """Many cards: each card's peak as a share of its budget, one point per card and split."""
    n = len(result.devices)
    even = result.even
    xs = list(range(n))
    even_shares = [s * 100 for s in even.shares(result.budget_bytes)]
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
    ax.set_title(_wrap_title(f"{result.model_name} on {result.cluster}: peak memory per card as "
                             f"a share of its budget\n{n} cards (one point per card; the split is "
                             "in summary.md and report.json)", _axes_width(ax), 10), fontsize=10)
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
    from dptune.report.fit_groups import report_fits

    B = result.batch_size
    fit = report_fits(result)[i]      # identical replicas share one line
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
        ax.set_title(_wrap_title(name + ("\n(memory also grows with the batch)" if other_batch
                                         else ""), _axes_width(ax), 9), fontsize=9)


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
    data_top = highest_peak(result)
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
        _compact_counts(a.xaxis)
        if k % ncols == 0:
            a.set_ylabel("peak memory (GiB)")
    first = axes.flat[0]
    first.set_ylim(0, first.get_ylim()[1] * 1.05)  # shared by every card
    seen: dict[str, Any] = {}
    for a in axes.flat[:n]:  # an OOM probe may only show on some cards
        for h, lab in zip(*a.get_legend_handles_labels()):
            seen.setdefault(lab, h)
    fig.legend(list(seen.values()), list(seen.keys()), loc="outside lower center",
               ncol=max(1, min(len(seen), 4, int(fig.get_figwidth() / 3.4))), fontsize=8)
    off_scale = "" if shown else "\n" + _budgets_off_scale_text(result, data_top)
    subset = ("" if n == len(result.devices) else
              f"\n{n} of {len(result.devices)} cards: card 0, the fullest and the emptiest "
              "under dptune's split")
    fig.suptitle(_wrap_title(f"{_subject(result)}: memory against chunk size "
                             f"({result.num_probes} probes){subset}{off_scale}",
                             fig.get_figwidth() - 0.4, 10), fontsize=10)


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
    ax.set_title(_wrap_title(f"{_subject(result)}: largest batch that fits{cards}\n"
                             f"even {_even_batch(result)} -> dptune {result.batch_size}"
                             f"{_gain(result)}", _axes_width(ax), 10), fontsize=10)
    if per_card:
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, labels, title="samples per card", fontsize=7, title_fontsize=7,
                  loc="upper left", bbox_to_anchor=(1.01, 1.0))   # beside: the totals stay clear
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


