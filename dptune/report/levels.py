"""The three memory figures of a card in a report, and the budget level the search checked.

A probe's ``peak_bytes`` is the figure checked against each budget: the reserved peak plus
NCCL's buffers at ``reserved`` (the default), the allocated peak at ``allocated``
(:func:`dptune.budget.at_level`, which then keeps the allocated peak in
``allocated_peak_bytes``). Where the probe also carries the allocator's figures (the
allocator model on simulated cards at the reserved level; ``max_memory_reserved`` and NVML
on real cards), a report shows per card:

- the **allocated** peak (``torch.cuda.max_memory_allocated``, ``allocated_bytes.all.peak``),
- the **reserved** peak (``torch.cuda.max_memory_reserved``, ``reserved_bytes.all.peak``),
- the **total use**: on simulated cards predicted (reserved + CUDA context + NCCL), on real
  cards NVML's reading of the card (what nvidia-smi shows).

The level is read from the probes (``allocated_peak_bytes`` set: reserved), so a report
written before levels existed reads as ``allocated``, which it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence

from dptune.budget import RESERVED_MODEL
from dptune.units import format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from dptune.backends.base import ProbeResult
    from dptune.result.model import TuneResult

__all__ = ["CardMemory", "budget_level", "probe_for", "card_memory", "split_memory",
           "memory_stats", "level_lines", "has_total", "ALLOCATED_KEY", "RESERVED_KEY", "RETRIES_KEY"]

#: ``torch.cuda.memory_stats()``'s key names, used in report.json
ALLOCATED_KEY = "allocated_bytes.all.peak"
RESERVED_KEY = "reserved_bytes.all.peak"
RETRIES_KEY = "num_alloc_retries"


class CardMemory(NamedTuple):
    """One card's figures for one split (bytes; ``None`` where not known)."""

    allocated_bytes: int
    reserved_bytes: Optional[int]
    total_bytes: Optional[int]          # predicted (simulated) or NVML's (real cards)
    alloc_retries: Optional[int]


def budget_level(result: "TuneResult") -> str:
    """``"reserved"`` when the search checked reserved peaks, else ``"allocated"``."""
    return "reserved" if any(p.allocated_peak_bytes is not None for p in result.probes) \
        else "allocated"


def probe_for(result: "TuneResult", chunk_sizes: Sequence[int],
              peak_bytes: Sequence[int]) -> Optional["ProbeResult"]:
    """The last probe that measured ``chunk_sizes`` with ``peak_bytes`` (the one a split's
    figures came from), or ``None`` (a split not probed itself)."""
    want_c, want_p = tuple(chunk_sizes), tuple(peak_bytes)
    return next((p for p in reversed(result.probes)
                 if tuple(p.chunk_sizes) == want_c and tuple(p.peak_bytes) == want_p), None)


def card_memory(probe: "ProbeResult") -> Optional[list[CardMemory]]:
    """Per card the allocated, reserved and total figures of ``probe``; ``None`` when it has
    no reserved figure (the allocated level on simulated cards: only the allocated peak)."""
    if probe.reserved_bytes is None:
        return None
    allocated = probe.allocated_peak_bytes or probe.peak_bytes
    total = probe.total_bytes or probe.nvml_used_bytes
    return [CardMemory(int(allocated[i]), probe.reserved_bytes[i],
                       None if total is None else total[i],
                       None if probe.alloc_retries is None else probe.alloc_retries[i])
            for i in range(len(probe.chunk_sizes))]


def split_memory(result: "TuneResult", chunk_sizes: Sequence[int],
                 peak_bytes: Sequence[int]) -> Optional[list[CardMemory]]:
    """:func:`card_memory` of the probe a split's figures came from (``None``: not known)."""
    probe = probe_for(result, chunk_sizes, peak_bytes)
    return None if probe is None else card_memory(probe)


def memory_stats(result: "TuneResult") -> Optional[list[dict[str, int]]]:
    """Per card of dptune's split, the figures under ``torch.cuda.memory_stats()``'s key
    names (``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``, ``num_alloc_retries``,
    where known) plus ``total_bytes`` (the card's total use); ``None`` when only the
    allocated peak is known."""
    probe = probe_for(result, result.chunk_sizes, result.peak_bytes)
    cards = None if probe is None else card_memory(probe)
    if probe is None or cards is None:
        return None
    out = []
    for i, c in enumerate(cards):
        d = dict(probe.memory_stats[i]) if probe.memory_stats is not None else {}
        d[ALLOCATED_KEY], d[RESERVED_KEY] = c.allocated_bytes, int(c.reserved_bytes or 0)
        if c.alloc_retries is not None:
            d[RETRIES_KEY] = c.alloc_retries
        if c.total_bytes is not None:
            d["total_bytes"] = c.total_bytes
        out.append(d)
    return out


def level_lines(result: "TuneResult") -> list[str]:
    """What the peaks of a report are, at which level the budgets were checked, and (when
    known) what the three figures per card mean; the predicted allocator retries."""
    simulated = result.backend == "simulated"
    if budget_level(result) == "allocated":
        lines = ["budget level: allocated (peaks are the allocator's allocated peak, "
                 "max_memory_allocated; fragmentation, NCCL's buffers and the rest are left "
                 "to the headroom)"]
    else:
        probe = probe_for(result, result.chunk_sizes, result.peak_bytes)
        nccl = _nccl(result, probe) if simulated and probe is not None else None
        what = ("the caching allocator's reserved peak plus NCCL's buffers"
                + (f" ({format_bytes(nccl)} per card)" if nccl is not None else "")
                if simulated else "max_memory_reserved")
        lines = [f"budget level: reserved (peaks are {what}: what runs out on a card"
                 + (f"; predicted by {RESERVED_MODEL})" if simulated else ")")]
    cards = split_memory(result, result.chunk_sizes, result.peak_bytes)
    if cards is not None:
        lines.append(_columns_line(cards, simulated))
        retries = [(i, c.alloc_retries) for i, c in enumerate(cards) if c.alloc_retries]
        if retries:
            shown = ", ".join(f"card {i}: {n}" for i, n in retries)
            lines.append(f"num_alloc_retries (the allocator freed its cache and retried a "
                         f"cudaMalloc: close to running out, and slower): {shown}")
    return lines


def has_total(cards: Sequence[CardMemory]) -> bool:
    """Whether any card's total use is known (else the column is left out)."""
    return any(c.total_bytes is not None for c in cards)


def _columns_line(cards: Sequence[CardMemory], simulated: bool) -> str:
    line = ("allocated / reserved: the caching allocator's allocated and reserved peaks (as "
            "torch's max_memory_allocated and max_memory_reserved)")
    if has_total(cards):
        how = ("predicted: reserved + CUDA context + NCCL" if simulated
               else "NVML's reading of the card")
        line += f"; total use: the card's whole use ({how}), what nvidia-smi shows"
    return line


def _nccl(result: "TuneResult", probe: "ProbeResult") -> Optional[int]:
    """NCCL's bytes per card a simulated probe counted (total - reserved - context)."""
    if probe.total_bytes is None or probe.reserved_bytes is None:
        return None
    d = result.devices[0]
    return probe.total_bytes[0] - probe.reserved_bytes[0] - d.context_bytes
