"""The monitor's events: what it saw go wrong on a card, one line each, rate-limited.

- ``drift``: the step's measured peak is above the plan's prediction for that step's shape
  (its bucket, for a length plan) by more than the margin;
- ``off_plan``: the step's shape is not one the plan was made for (a length past its
  longest bucket, a batch over the planned one);
- ``headroom``: the room left to the card's capacity at the step's peak is below the margin
  (another process took memory, or the plan's headroom was too thin);
- ``fragmentation``: the allocator's ``num_alloc_retries`` rose (it freed its cache and
  retried a ``cudaMalloc``): fragmentation, advice ``expandable_segments:True``;
- ``oom``: an out-of-memory error, raised in the monitor's step (with forensics) or caught by
  the user's code (``num_ooms`` rose).

A lasting condition (a shape off the plan, headroom that stays low) is an event when it
starts and again every ``quiet_steps`` steps while it lasts; every other event is recorded
each time. :class:`Limiter` decides which recorded events are also warned
(:class:`MonitorWarning`): one per kind and card every ``quiet_steps`` steps, and at most
:data:`MAX_WARNINGS` in all (then one line saying the rest go only to the record).
"""

from __future__ import annotations

import enum
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from dptune.errors import DptuneWarning

__all__ = ["EventKind", "MonitorEvent", "MonitorWarning", "Limiter", "MAX_WARNINGS",
           "fragmentation_advice", "shape_text"]

#: the most event lines one monitor warns; later events are recorded only
MAX_WARNINGS = 20


class MonitorWarning(DptuneWarning):
    """A line from :class:`dptune.MemoryMonitor` (an event, or: no CUDA card to watch)."""


class EventKind(str, enum.Enum):
    DRIFT = "drift"
    OFF_PLAN = "off_plan"
    HEADROOM = "headroom"
    FRAGMENTATION = "fragmentation"
    OOM = "oom"


@dataclass(frozen=True)
class MonitorEvent:
    """One event on one card (bytes; ``None`` where there is no figure). ``details``: the
    out-of-memory forensics (every card's last reading against the plan, the error, the
    snapshot's file), empty for other kinds."""

    kind: EventKind
    step: int
    card: Optional[int]
    rank: int
    message: str
    batch_size: Optional[int] = None
    length: Optional[int] = None
    predicted_bytes: Optional[int] = None
    measured_bytes: Optional[int] = None
    budget_bytes: Optional[int] = None
    details: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind.value
        d["details"] = dict(self.details)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MonitorEvent":
        def opt(k: str) -> Optional[int]:
            return None if d.get(k) is None else int(d[k])

        return cls(kind=EventKind(d["kind"]), step=int(d["step"]), card=opt("card"),
                   rank=int(d.get("rank", 0)), message=str(d["message"]),
                   batch_size=opt("batch_size"), length=opt("length"),
                   predicted_bytes=opt("predicted_bytes"), measured_bytes=opt("measured_bytes"),
                   budget_bytes=opt("budget_bytes"), details=dict(d.get("details") or {}))


def shape_text(batch_size: Optional[int], length: Optional[int]) -> str:
    """``batch 8 x length 512``, ``batch 8``, ``length 512`` or ``shape not given``."""
    parts = ([f"batch {batch_size}"] if batch_size is not None else []) + \
        ([f"length {length}"] if length is not None else [])
    return " x ".join(parts) if parts else "shape not given"


def fragmentation_advice() -> str:
    """What to do when retries rise, given the allocator settings this process runs with."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        return ("expandable_segments is already on: lower the batch, or plan again with more "
                "headroom (--headroom)")
    return ("start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (fewer, "
            "growable segments: less fragmentation), or lower the batch")


class Limiter:
    """Which events are warned: one per (kind, card) every ``quiet_steps`` steps, at most
    :data:`MAX_WARNINGS` in all."""

    def __init__(self, quiet_steps: int) -> None:
        self.quiet_steps = quiet_steps
        self.last: dict[tuple[EventKind, Optional[int]], int] = {}
        self.warned = 0
        self.silenced = 0

    def allow(self, event: MonitorEvent) -> Optional[str]:
        """The line to warn for ``event``, or ``None`` to record it only."""
        key = (event.kind, event.card)
        last = self.last.get(key)
        if last is not None and event.step - last < self.quiet_steps and event.kind is not EventKind.OOM:
            self.silenced += 1
            return None
        if self.warned >= MAX_WARNINGS:
            self.silenced += 1
            return None
        self.last[key] = event.step
        self.warned += 1
        if self.warned == MAX_WARNINGS:
            return (event.message + f" [{MAX_WARNINGS} monitor warnings given: later events go "
                    "to the run's record only]")
        return event.message
