"""The figures of a split, below the result type: each card's share of its budget, the
imbalance, what the search reads from a probe (:func:`budget_check`), and
:class:`SplitFigures` (a split and what a probe measured for it, e.g. the even split).

:mod:`dptune.result.model` re-exports them; the report's reader (:mod:`dptune.result.read`) builds
them. Memory figures are ``int`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence

from dptune.types import ProbeResult, card_in_use

__all__ = ["GainRange", "MAX_GAIN_SPAN", "shares", "imbalance", "BudgetCheck", "budget_check", "SplitFigures",
           "AllocatorAnswer"]


def shares(peak_bytes: Sequence[int], budget_bytes: Sequence[int]) -> list[float]:
    """Each card's peak as a share of its budget."""
    return [p / b if b > 0 else float("inf") for p, b in zip(peak_bytes, budget_bytes)]


def imbalance(peak_bytes: Sequence[int], budget_bytes: Sequence[int],
              chunk_sizes: Sequence[int]) -> float:
    """max/min share of budget over the cards that hold samples (1.0 is perfectly balanced).

    Card 0 with no samples is left out: it runs no replica, so what it holds (the master
    weights, the gradients, the optimizer state, the gathered outputs) is a floor that no split
    changes (:attr:`TuneResult.card0_floor` says when that floor is the largest share).
    """
    s = [x for i, x in enumerate(shares(peak_bytes, budget_bytes)) if chunk_sizes[i] > 0]
    if not s:
        return float("inf")
    lo = min(s)
    return max(s) / lo if lo > 0 else float("inf")


class BudgetCheck(NamedTuple):
    """What the search read from one probe (:func:`budget_check`)."""

    #: every card in use (card 0, and each card given samples) measured within its budget,
    #: without running out of memory: what the search counts as fitting
    within_budget: bool
    #: the smallest ``budget - peak`` over the cards in use (negative: over by that much);
    #: ``None`` when the probe ran out of memory (its peaks are lower bounds)
    margin_bytes: Optional[int]
    #: the card with that smallest margin (the one that ran out of memory, for an OOM probe)
    card: Optional[int]


def budget_check(probe: ProbeResult, budget_bytes: Sequence[int]) -> BudgetCheck:
    """Within budget or not, and by how much, as the search decides it: a card with no
    samples other than card 0 runs no replica and is not counted."""
    if probe.oom_device is not None:
        return BudgetCheck(False, None, probe.oom_device)
    margins = [(b - p, i) for i, (p, b, c) in enumerate(zip(probe.peak_bytes, budget_bytes,
                                                           probe.chunk_sizes)) if card_in_use(i, c)]
    margin, card = min(margins)
    return BudgetCheck(margin >= 0, margin, card)


@dataclass(frozen=True)
class GainRange:
    """dptune's largest batch over the even split's, minus 1 (0.25 means +25%), as far as
    the probes prove it: ``low`` with the even split's largest batch at the upper end of its
    bracket, ``high`` at the lower end (equal when the bracket is closed)."""

    low: float
    high: float

    @property
    def proven(self) -> bool:
        """Tight enough to print as a headline: the range spans at most 10 points."""
        return self.high - self.low <= MAX_GAIN_SPAN

    @staticmethod
    def of(batch: int, certified: bool, even: "SplitFigures") -> "Optional[GainRange]":
        """The range for ``batch`` against ``even`` (``None``: no even split known to fit, or
        nothing bounds the gain from below: the even bracket's upper end unknown and the
        answer not certified)."""
        lo = even.batch_size if even.feasible else 0
        if lo <= 0:
            return None
        hi = even.at_most if even.open_bracket else lo
        if hi is None:
            # the even split's largest batch is at most the largest batch of any split,
            # which a certified answer is
            return GainRange(0.0, batch / lo - 1.0) if certified else None
        return GainRange(batch / hi - 1.0, batch / lo - 1.0)


#: the widest gain range (high - low) printed as a gain; wider is "not proven"
MAX_GAIN_SPAN = 0.10


@dataclass(frozen=True)
class SplitFigures:
    """A split and what a probe measured for it (used for the even-split comparison)."""

    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    imbalance: float
    feasible: bool = True
    oom_device: Optional[int] = None
    breakdown: Optional[tuple[dict[str, int], ...]] = None
    #: not probed itself: known to fit from these probes (numbered from 1, as in every table,
    #: text and plot of a report), which measured every card
    #: within budget at a chunk (card 0: a chunk and a batch) at least as large; the peaks
    #: are then upper bounds taken from those probes
    implied_by: tuple[int, ...] = ()
    #: max_batch: the even split's largest batch was not bracketed to one sample; it is at
    #: least ``batch_size`` and at most ``at_most`` (``None``: no upper bound measured)
    open_bracket: bool = False
    at_most: Optional[int] = None
    #: max_batch on simulated cards at the reserved level: the even split's largest batch
    #: found on the allocator model past the probes' last known fit (every even batch
    #: replayed there; this split and the next simulated, not probed)
    on_model: bool = False

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    def shares(self, budget_bytes: Sequence[int]) -> list[float]:
        """Each card's peak as a share of its budget."""
        return shares(self.peak_bytes, budget_bytes)

    def to_dict(self) -> dict[str, Any]:
        return dict(chunk_sizes=list(self.chunk_sizes), peak_bytes=list(self.peak_bytes),
                    imbalance=self.imbalance, feasible=self.feasible, oom_device=self.oom_device,
                    breakdown=list(self.breakdown) if self.breakdown is not None else None,
                    batch_size=self.batch_size, implied_by=list(self.implied_by),
                    open_bracket=self.open_bracket, at_most=self.at_most, on_model=self.on_model)


@dataclass(frozen=True)
class AllocatorAnswer:
    """The largest batch searched again on the simulated cards with another setting of the
    caching allocator (``setting``, as ``PYTORCH_CUDA_ALLOC_CONF`` takes it), where the first
    search showed fragmentation: its reserved figures fall as the work grows (its answer is
    then not certified), or its answer's reserved peak lies widely over the allocated one
    (:func:`dptune.backends.simulated.reserved.advice_lines`). ``chunk_sizes`` and
    ``peak_bytes`` (at the budget level: the setting's reserved peak plus NCCL) are those of
    the split measured within every budget;
    ``certified``: one more sample measured over on every card; ``probes``: the probes this
    search ran (besides the first search's)."""

    setting: str
    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    certified: bool
    probes: int

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    def advice(self, batch_size: int) -> str:
        """The advice line beside the first search's answer of ``batch_size`` samples."""
        d = self.batch_size - batch_size
        gain = (f" ({d:,} more than the answer above, {d / batch_size:+.0%})" if d > 0 and batch_size
                else f" ({-d:,} fewer than the answer above)" if d < 0 else
                " (the answer's batch)")
        proof = ("certified: one more sample measured over on every card" if self.certified
                 else "not certified either")
        return (f"with PYTORCH_CUDA_ALLOC_CONF={self.setting} (segments grow in place, so the "
                "reserved figure follows the allocated one) the simulated cards fit batch "
                f"{self.batch_size}{gain} as {list(self.chunk_sizes)}, {proof} "
                f"({self.probes} more simulated probes); set it in the environment before the "
                "run starts (on real cards, tune again with it set)")

    def to_dict(self) -> dict[str, Any]:
        return dict(setting=self.setting, chunk_sizes=list(self.chunk_sizes),
                    batch_size=self.batch_size, peak_bytes=list(self.peak_bytes),
                    certified=self.certified, probes=self.probes)
