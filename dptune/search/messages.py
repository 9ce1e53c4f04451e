"""The search's messages to the user (prose lives here, not in the solver)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.errors import NoFeasibleSplitError
from dptune.types import card_in_use
from dptune.units import format_bytes

__all__ = ["infeasible_error", "card0_holdings", "fixed_costs_fill"]


def card0_holdings(probes: Sequence[ProbeResult]) -> str:
    """What card 0 holds besides its own samples, as the probes measured it: the optimizer
    state is named only when a probe's breakdown shows one (or no breakdown is known)."""
    known = [p.breakdown[0] for p in probes if p.breakdown]
    if known and all(int(b.get("optimizer", 0)) == 0 for b in known):
        return "master weights, gradients and the gathered outputs"
    return "master weights, gradients, optimizer state and the gathered outputs"


def _closest_oom(probes: Sequence[ProbeResult], budgets: Sequence[int]
                 ) -> Optional[tuple[float, int, ProbeResult]]:
    """The out-of-memory probe that came closest: (bytes over, card, probe), or None when no
    probe recorded a peak above a budget (real cards may stop before the peak)."""
    best: Optional[tuple[float, int, ProbeResult]] = None
    for r in probes:
        if r.feasible or len(r.peak_bytes) != len(budgets):
            continue
        over, card = max((r.peak_bytes[i] - budgets[i], i) for i in range(len(budgets))
                         if card_in_use(i, r.chunk_sizes[i]))
        if over > 0 and (best is None or over < best[0]):
            best = (over, card, r)
    return best


def fixed_costs_fill(probes: Sequence[ProbeResult], budgets: Sequence[int]) -> Optional[str]:
    """When the fixed costs a probe's figure carries (at the reserved level on simulated
    cards: NCCL's buffers, the figure less the allocator's reserved peak) and not the model
    put a card over its budget (its reserved peak alone fits), the sentence that says so and
    names the flags; ``None`` otherwise."""
    for r in probes:
        if r.reserved_bytes is None or len(r.peak_bytes) != len(budgets):
            continue
        for i, (peak, res, budget) in enumerate(zip(r.peak_bytes, r.reserved_bytes, budgets)):
            fixed = peak - res
            if peak > budget and fixed > 0 and res <= budget:
                room = "leave no room on it" if fixed >= budget else \
                    f"leave {format_bytes(budget - fixed)} of it to the model"
                return (f"fixed costs, not the model, fill card {i}: NCCL's buffers "
                        f"({format_bytes(fixed)} per card, charged at the reserved budget level) "
                        f"against its budget of {format_bytes(budget)} {room}; give the figure "
                        "your system shows with --nccl-bytes (nccl_bytes=), or check the "
                        "allocated peak with --budget-level allocated (budget_level=\"allocated\")")
    return None


def infeasible_error(card: Optional[int], shortfall_bytes: Optional[float], batch_size: int,
                     detail: str = "", *, probes: Sequence[ProbeResult] = (),
                     budgets: Sequence[int] = (), proven: bool = True,
                     likely: bool = False) -> NoFeasibleSplitError:
    """The error for "no split fits", saying where, by how much, and what to try.

    Without a ``shortfall_bytes``, the amount comes from the out-of-memory probe among
    ``probes`` that came closest to the ``budgets`` (a lower bound: a step stops at the
    allocation that fails). ``proven=False``: the probes ran out before one fitted, and
    nothing they measured shows that none fits: the message says so, and that more probes
    may find one, instead of claiming no split fits. ``likely``: the fits predict every split
    over by more than the tolerance: the smaller batch leads the advice, more probes settle it.
    """
    short = None if shortfall_bytes is None else max(0, int(math.ceil(shortfall_bytes)))
    where = ""
    closest = _closest_oom(probes, budgets) if short is None else None
    if card is not None and short is not None:
        where = f": at best, card {card} is {format_bytes(short)} over its budget"
    elif closest is not None:
        over, card, r = closest
        short = int(math.ceil(over))
        where = (f": the closest probe, split {list(r.chunk_sizes)}, is at least "
                 f"{format_bytes(short)} over card {card}'s budget")
    elif card is not None:
        where = f": card {card} runs out of memory"
    fixed = fixed_costs_fill(probes, budgets)
    if fixed is not None:
        return NoFeasibleSplitError(f"no split of batch size {batch_size} fits: {fixed}.",
                                    shortfall_bytes=short)
    if not proven:
        head = (f"no split of batch size {batch_size} was measured within every card's budget, "
                f"and none is proven not to fit{where}{'; ' + detail if detail else ''}. ")
        if likely:
            advice = ("Try a smaller batch_size, a smaller headroom, more or larger cards, or "
                      "gradient accumulation (several smaller batches per step); more probes "
                      "(--max-probes, max_probes=) would settle it.")
        else:
            advice = ("More probes may find one (--max-probes, max_probes=); else try a smaller "
                      "batch_size, a smaller headroom, more or larger cards, or gradient "
                      "accumulation (several smaller batches per step).")
        return NoFeasibleSplitError(head + advice, shortfall_bytes=short)
    msg = (f"no split of batch size {batch_size} fits every card's budget{where}"
           f"{'; ' + detail if detail else ''}. Try a smaller batch_size, a smaller headroom, "
           "more or larger cards, or gradient accumulation (several smaller batches per step).")
    return NoFeasibleSplitError(msg, shortfall_bytes=short)
