"""The lines a report draws and tabulates: cards that run identical replicas share one.

Under DataParallel every card but the output card runs the same replica, so two such cards of
the same kind (the same name, memory, context and others' use) have the same memory as a
function of their chunk. The search keeps one local line per card (each drawn near that card's
own chunk), which made three identical cards show three different lines. A report shows one
line per group of identical replicas instead: a least-squares line through every probe the
group measured within budget, its ``max_error_bytes`` over every one of those points and its
``points`` their number (:func:`report_fits`). Cards alone in their group keep the search's
line (whose error is also over every point it counts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from dptune.solve.memory import Fit

if TYPE_CHECKING:  # pragma: no cover
    from dptune.result.model import TuneResult

__all__ = ["replica_groups", "shared_fit", "report_fits", "group_note"]


def replica_groups(result: "TuneResult") -> list[list[int]]:
    """Groups (two cards or more) of cards running identical replicas: every card but the
    output card, grouped by the kind of card (name, memory, context, others' use)."""
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(result.devices):
        if i == result.output_device:
            continue
        groups.setdefault((d.name, d.total_bytes, d.context_bytes, d.used_bytes), []).append(i)
    return [g for g in groups.values() if len(g) > 1]


def shared_fit(result: "TuneResult", cards: Sequence[int]) -> Optional[Fit]:
    """The least-squares line through every probe of ``cards`` measured within budget with
    samples on the card (``None`` with fewer than two distinct chunks)."""
    pts = [(p.chunk_sizes[i], p.peak_bytes[i]) for p in result.probes for i in cards
           if p.feasible and p.chunk_sizes[i] > 0]
    xs = [float(c) for c, _ in pts]
    if len(set(xs)) < 2:
        return None
    n = len(pts)
    mx, my = sum(xs) / n, sum(float(m) for _, m in pts) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (m - my) for x, (_, m) in zip(xs, pts)) / sxx
    intercept = my - slope * mx
    err = max(abs(intercept + slope * c - m) for c, m in pts)
    return Fit(intercept, slope, 0.0, max_error_bytes=float(err), points=n)


def report_fits(result: "TuneResult") -> list[Fit]:
    """Per card the line the report shows: its group's shared line, else the search's."""
    fits = list(result.fits)
    for group in replica_groups(result):
        line = shared_fit(result, group)
        if line is not None:
            for i in group:
                fits[i] = line
    return fits


def group_note(result: "TuneResult") -> list[str]:
    """One line per group whose cards share a line, for the fits table."""
    out = []
    for group in replica_groups(result):
        line = shared_fit(result, group)
        if line is not None:
            names = ", ".join(str(result.devices[i].index) for i in group)
            out.append(f"cards {names} run identical replicas: one line through all "
                       f"{line.points} of their probes within budget (least squares)")
    return out
