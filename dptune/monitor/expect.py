"""What a plan predicts for one step on one card: the reference the monitor's readings meet.

The monitor is given a search result (:class:`~dptune.TuneResult`, a DataParallel split), a
per-rank plan (:class:`~dptune.ddp.result.DDPPlan`, DDP or FSDP2), a plan per length bucket
(:class:`~dptune.lengths.plan.LengthPlan`), a path to one of them as saved, or nothing.
:func:`expectation` turns it into an :class:`Expectation`, which answers, for a card's
``slot`` (its place in the split, or its rank) and a step's shape, the peak the plan predicts
and the card's budget (:class:`Expected`). The figures are the plan's own, at the budget level
it was planned at (``reserved`` by default):

- a split: the verifying probe's peak at the planned batch; at another batch the card's
  fitted line at that batch's proportional split (``None`` without fits);
- a per-rank plan: the rank's measured (else predicted) peak at its batch; at another batch
  its fitted line;
- a length plan: the peak of the bucket the step's (padded) length falls in, at the bucket's
  planned batch, an upper bound for a smaller batch; a length past the longest bucket, or a
  batch over the bucket's, is compared with that bucket and said to be off the plan.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from dptune.errors import UsageError

__all__ = ["PlanKind", "Expected", "Expectation", "expectation", "load_plan"]


class PlanKind(str, enum.Enum):
    NONE = "none"
    SPLIT = "split"          # TuneResult: one DataParallel batch split over the cards
    RANKS = "ranks"          # DDPPlan: each rank's own batch (DDP or FSDP2)
    LENGTHS = "lengths"      # LengthPlan: a split (or per-rank batches) per length bucket


@dataclass(frozen=True)
class Expected:
    """The plan's figures for one card at one step's shape (bytes; ``None``: no figure).

    ``off_plan``: why the shape is not one the plan was made for (``""`` when it is)."""

    predicted: Optional[int]
    budget: Optional[int]
    where: str = ""
    off_plan: str = ""


_NOTHING = Expected(None, None)


@dataclass(frozen=True)
class Expectation:
    """The plan, seen per card slot; see the module docstring."""

    kind: PlanKind
    plan: Any = None
    slots: int = 0
    headroom_bytes: Optional[int] = None

    def budget(self, slot: int) -> Optional[int]:
        return self.expect(slot, None, None).budget

    def expect(self, slot: int, batch_size: Optional[int], length: Optional[int]) -> Expected:
        if self.kind is PlanKind.NONE or not 0 <= slot < self.slots:
            return _NOTHING
        if self.kind is PlanKind.SPLIT:
            return _split(self.plan, slot, batch_size)
        if self.kind is PlanKind.RANKS:
            return _ranks(self.plan, slot, batch_size)
        return _lengths(self.plan, slot, batch_size, length)

    def to_dict(self) -> dict[str, Any]:
        """The plan as saved beside the run (``plan.json``)."""
        plan = None if self.plan is None else self.plan.to_dict()
        return dict(kind=self.kind.value, slots=self.slots, headroom_bytes=self.headroom_bytes,
                    budget_bytes=[self.budget(s) for s in range(self.slots)], plan=plan)


def _int(x: Optional[float]) -> Optional[int]:
    return None if x is None else int(round(x))


def _split(result: Any, slot: int, batch_size: Optional[int]) -> Expected:
    from dptune.split import scale_split

    budget = result.budget_bytes[slot]
    total = result.batch_size
    if batch_size is None or batch_size == total:
        return Expected(int(result.peak_bytes[slot]), budget, f"the split {list(result.chunk_sizes)}")
    chunks = scale_split(result.chunk_sizes, batch_size)
    off = f"batch {batch_size} is over the planned {total}" if batch_size > total else ""
    fit = result.fits[slot] if slot < len(result.fits) else None
    predicted = None if fit is None else _int(fit.predict(chunks[slot], batch_size))
    return Expected(predicted, budget, f"the split {chunks} (fitted)", off)


def _ranks(plan: Any, slot: int, batch_size: Optional[int]) -> Expected:
    r = plan.ranks[slot]
    peak = r.measured_peak_bytes if r.measured_peak_bytes is not None else r.predicted_peak_bytes
    if batch_size is None or batch_size == r.batch_size:
        return Expected(peak, r.budget_bytes, f"rank {slot}'s batch {r.batch_size}")
    off = f"batch {batch_size} is over rank {slot}'s planned {r.batch_size}" \
        if batch_size > r.batch_size else ""
    predicted = None if r.fit is None else _int(r.fit.predict(batch_size, 0))
    return Expected(predicted, r.budget_bytes, f"rank {slot}'s batch {batch_size} (fitted)", off)


def _lengths(plan: Any, slot: int, batch_size: Optional[int], length: Optional[int]) -> Expected:
    from dptune.lengths.buckets import padded

    budget = plan.budget_bytes[slot] if slot < len(plan.budget_bytes) else None
    longest = plan.buckets[-1]
    off = ""
    if length is None:
        bucket, where = longest, f"the longest bucket (<= {longest.length}; no length given)"
    else:
        pad = padded(int(length), plan.pad_to_multiple_of)
        if pad > longest.length:
            bucket = longest
            off = f"length {length} is past the plan's longest bucket (<= {longest.length})"
        else:
            bucket = plan.bucket_for(pad)
        where = f"the bucket <= {bucket.length}"
    planned = bucket.chunk_sizes[slot] if plan.ddp else bucket.batch_size
    if batch_size is not None and batch_size > planned and not off:
        off = f"batch {batch_size} is over the {planned} planned for lengths <= {bucket.length}"
    peak = bucket.peak_bytes[slot] if slot < len(bucket.peak_bytes) else None
    return Expected(peak, budget, where, off)


def load_plan(path: "str | os.PathLike[str]") -> Any:
    """A saved plan: a DDP/FSDP plan (``plan.json``), a length plan (``lengths.json``) or a
    search report (``report.json``), or the folder holding one."""
    from dptune.ddp.result import DDPPlan, is_plan_path
    from dptune.lengths.plan import PLAN_FILE, LengthPlan

    p = os.fspath(path)
    if is_plan_path(p):
        return DDPPlan.load(p)
    if (os.path.isdir(p) and os.path.isfile(os.path.join(p, PLAN_FILE))
            and not os.path.exists(os.path.join(p, "report.json"))) or os.path.basename(p) == PLAN_FILE:
        return LengthPlan.load(p)
    from dptune.result.model import load_result

    return load_result(p)


def _is(obj: Any, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)``, without importing the module (a plan of that class
    exists only once its module was imported)."""
    mod = sys.modules.get(module)
    return mod is not None and isinstance(obj, getattr(mod, name))


def expectation(plan: Any) -> Expectation:
    """The :class:`Expectation` of a plan, a saved plan's path, or ``None``."""
    if plan is None:
        return Expectation(PlanKind.NONE)
    if isinstance(plan, (str, os.PathLike)):
        plan = load_plan(plan)
    if _is(plan, "dptune.lengths.plan", "LengthPlan"):
        return Expectation(PlanKind.LENGTHS, plan, len(plan.budget_bytes), plan.headroom_bytes)
    if _is(plan, "dptune.ddp.result", "DDPPlan"):
        return Expectation(PlanKind.RANKS, plan, plan.world_size, plan.headroom_bytes)
    if _is(plan, "dptune.result.model", "TuneResult"):
        return Expectation(PlanKind.SPLIT, plan, len(plan.chunk_sizes), plan.headroom_bytes)
    raise UsageError(f"MemoryMonitor(plan=...) takes a TuneResult, a DDPPlan, a LengthPlan, the "
                     f"path of a saved one, or None; got {type(plan).__name__}")
