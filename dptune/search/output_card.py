"""The search seen from another output card: probes and outcomes with card 0 and card ``k``
swapped (``Tuner(output_device="auto")`` searches as if card ``k`` were card 0, then puts the
cards back in their own order), and what that search may reuse from the first one."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

from dptune.types import Objective, ProbeResult

if TYPE_CHECKING:
    from dptune.search import SearchOutcome

__all__ = ["swapped", "reuse", "swapped_outcome"]


def swapped(r: ProbeResult, perm: list[int]) -> ProbeResult:
    """A probe with its cards reordered by ``perm`` (a swap, its own inverse)."""
    def per_card(xs: Any) -> Any:
        return None if xs is None else tuple(xs[perm[i]] for i in range(len(perm)))
    return dataclasses.replace(
        r, chunk_sizes=per_card(r.chunk_sizes), peak_bytes=per_card(r.peak_bytes),
        oom_device=None if r.oom_device is None else perm[r.oom_device],
        breakdown=per_card(r.breakdown), reserved_bytes=per_card(r.reserved_bytes),
        nvml_used_bytes=per_card(r.nvml_used_bytes), alloc_retries=per_card(r.alloc_retries),
        repeat_spread_bytes=per_card(r.repeat_spread_bytes), total_bytes=per_card(r.total_bytes),
        memory_stats=per_card(r.memory_stats),
        expandable_reserved_bytes=per_card(r.expandable_reserved_bytes),
        allocated_peak_bytes=per_card(r.allocated_peak_bytes))


def reuse(first: Optional["SearchOutcome"], perm: list[int],
           objective: Objective) -> dict[str, Any]:
    """What a search gathering on another card takes from the first search (max_batch)."""
    if first is None or objective is not Objective.MAX_BATCH:
        return {}
    from dptune.search import Known

    return dict(known=Known(prior=[swapped(r, perm) for r in first.probes],
                            prior_cards=[i for i in range(len(perm)) if perm[i] == i]),
                compare_even=False)


def swapped_outcome(out: "SearchOutcome", perm: list[int], k: int) -> "SearchOutcome":
    """A search run with cards 0 and ``k`` swapped, back in the cards' own order."""
    def probe(r: ProbeResult) -> ProbeResult:
        return dataclasses.replace(swapped(r, perm), purpose=f"output {k}: {r.purpose}")
    return dataclasses.replace(
        out, best=probe(out.best), even=None if out.even is None else probe(out.even),
        even_split=tuple(out.even_split[perm[i]] for i in range(len(perm))),
        probes=tuple(probe(r) for r in out.probes),
        fits=tuple(out.fits[perm[i]] for i in range(len(perm))),
        brackets=tuple(dataclasses.replace(b, card=perm[b.card]) for b in out.brackets))

