"""A length plan as text, markdown, CSV and the ``lengths.png`` staircase (rendering only)."""

from __future__ import annotations

import csv
import io
import os
from typing import Any, Optional, Sequence

from dptune.lengths.budget import snippets, token_budgets
from dptune.lengths.plan import PLAN_FILE, LengthPlan
from dptune.report.tables import markdown_table
from dptune.units import format_bytes

__all__ = ["render_text", "render_markdown", "render_csv", "plot_lengths", "lengths_figure",
           "write_plan_report"]

COLUMNS = ("bucket", "lengths", "samples", "batch", "per_card", "tokens_per_step",
           "binding_card", "certified", "probes")


def _rows(plan: LengthPlan) -> list[list[str]]:
    return [[str(k), f"({b.lo}, {b.length}]", str(b.samples), str(b.batch_size),
             " ".join(str(c) for c in b.chunk_sizes), str(b.tokens_per_step),
             str(b.binding_card), "yes" if b.certified else "no", str(b.probes)]
            for k, b in enumerate(plan.buckets)]


def render_text(plan: LengthPlan) -> str:
    """One line per bucket, then the single token budget beside it, then the speed: each
    bucket's and the epoch's tokens per second and the DDP ranks' fastest batches (where
    the plan's notes give them)."""
    n = len(plan.buckets)
    head = (f"{plan.model_name} on {plan.cluster}: {n} bucket{'s' if n != 1 else ''}, "
            f"{plan.probes} probes, {plan.seconds:.1f} s")
    speed = [n for n in plan.notes if n.startswith(("speed: ", "epoch: "))]
    ranks = [f"note: {n}" for n in plan.notes if "DDP ranks' fastest batches" in n]
    return "\n".join([head, *plan.lines(), *larger_than_data(plan), token_budgets(plan).describe(),
                      *ranks, *speed])


def larger_than_data(plan: LengthPlan) -> list[str]:
    """A line for each bucket whose batch holds more sequences than the data has in it: the
    largest batch that fits, never drawn full from that bucket (every step of it is short)."""
    return [f"note: lengths <= {b.length}: the batch that fits ({b.batch_size}) is larger than "
            f"the bucket's {b.samples} samples; its steps take every sample of the bucket, fewer "
            "than fit" for b in plan.buckets if 0 < b.samples < b.batch_size]


def render_markdown(plan: LengthPlan) -> str:
    budgets = ", ".join(f"card {i} ({n}) {format_bytes(b)}" for i, (n, b) in
                        enumerate(zip(plan.devices, plan.budget_bytes)))
    out = [f"# {plan.model_name}: a batch per length bucket on {plan.cluster}", "",
           f"Budgets: {budgets}. Headroom {format_bytes(plan.headroom_bytes)}. "
           f"{plan.probes} probes in {plan.seconds:.1f} s; "
           f"{'every bucket certified' if plan.certified else 'NOT every bucket certified'} "
           "(one more sample measured not to fit).", "",
           *markdown_table(COLUMNS, _rows(plan))]
    out += ["", token_budgets(plan).describe(), "", "```python", *snippets(plan), "```"]
    if plan.notes:
        out += ["", "Notes:", *[f"- {n}" for n in plan.notes]]
    return "\n".join(out) + "\n"


def render_csv(plan: LengthPlan) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows(_rows(plan))
    return buf.getvalue()


#: per card a line style and a marker, so identical cards (the same staircase) stay visible
_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def lengths_figure(plan: LengthPlan, lengths: Optional[Sequence[int]] = None) -> Any:
    """The staircase as a matplotlib ``Figure``: per card the largest chunk against the
    length (each bucket's chunk over its range of lengths), over the data's length histogram;
    tokens per step in the labels. Both axes start at 0 (a fall to half is drawn as half);
    cards with the same staircase are drawn with their own line style and marker, nudged apart
    by a little, so none hides another."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    if lengths:
        hist = ax.twinx()
        hist.hist(list(lengths), bins=min(60, max(10, len(set(lengths)))), color="0.85")
        hist.set_ylabel("samples")
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
    xs = [0] + [b.length for b in plan.buckets]
    top = max(max(b.chunk_sizes) for b in plan.buckets) or 1
    seen: dict[tuple[int, ...], int] = {}
    for i, name in enumerate(plan.devices):
        ys = [b.chunk_sizes[i] for b in plan.buckets]
        twin = seen.setdefault(tuple(ys), 0)
        seen[tuple(ys)] = twin + 1
        nudge = twin * 0.006 * top       # identical staircases side by side, not on top
        style, marker = _STYLES[i % len(_STYLES)]
        line = ax.stairs([y + nudge for y in ys], xs, linewidth=2, baseline=None,
                         linestyle=style, label=f"card {i} ({name})")
        mids = [(a + b) / 2 for a, b in zip(xs, xs[1:])]
        ax.plot(mids, [y + nudge for y in ys], linestyle="none", marker=marker,
                markersize=5, color=line.get_edgecolor(), gid=f"card-{i}")
    for b in plan.buckets:
        ax.annotate(f"{b.tokens_per_step:,} tok", (b.length, max(b.chunk_sizes)),
                    textcoords="offset points", xytext=(-4, 4), ha="right", fontsize=7)
    ax.set_xlim(0, xs[-1] * 1.02)
    ax.set_ylim(0, top * 1.15)
    ax.set_xlabel("padded length (bucket edges)")
    ax.set_ylabel("largest chunk per card")
    ax.set_title(f"{plan.model_name} on {plan.cluster}: batch per length")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def plot_lengths(plan: LengthPlan, lengths: Optional[Sequence[int]], path: str) -> None:
    """:func:`lengths_figure` written to ``path`` (beside it first, then renamed)."""
    fig = lengths_figure(plan, lengths)
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_plan_report(plan: LengthPlan, folder: str, lengths: Optional[Sequence[int]] = None,
                      plots: bool = True) -> list[str]:
    """``lengths.json``, ``lengths.csv``, ``summary.md``, ``report.html`` and ``lengths.png``
    in ``folder``."""
    os.makedirs(folder, exist_ok=True)
    written = []
    from dptune.lengths.budget import token_budgets
    from dptune.report.html_plans import render_lengths_html

    for name, text in ((PLAN_FILE, plan.to_json()), ("lengths.csv", render_csv(plan)),
                       ("summary.md", render_markdown(plan)),
                       ("report.html", render_lengths_html(plan, token_budgets(plan).describe()))):
        _write(os.path.join(folder, name), text)
        written.append(name)
    if plots:
        plot_lengths(plan, lengths, os.path.join(folder, "lengths.png"))
        written.append("lengths.png")
    return written
