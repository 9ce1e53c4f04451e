"""The probe interface shared by the real-GPU and the simulated backends.

The tuner sees only this: a list of :class:`Device` and a ``probe(chunk_sizes)`` method that
runs one training step with that split and returns a :class:`ProbeResult`. It cannot tell
which backend it talks to. All memory figures are ``int`` bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from dptune.timing import StepTime

__all__ = ["Device", "ProbeResult", "Backend", "CATEGORIES"]

#: Categories of a per-card breakdown, in drawing order.
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "inputs", "outputs", "other")


@dataclass(frozen=True)
class Device:
    """One card as the tuner sees it.

    ``used_bytes`` is memory taken on the card by others (other processes) before dptune
    starts, ``context_bytes`` memory of our own process that the allocator does not count
    (the CUDA context). The allocator can use ``available_bytes`` of the card; the tuner
    plans within ``budget_bytes(headroom)``.
    """

    index: int                      # torch device index (virtual index when simulated)
    name: str
    total_bytes: int
    used_bytes: int = 0             # in bytes, taken by other processes
    context_bytes: int = 0          # in bytes, CUDA context etc. of this process
    uuid: Optional[str] = None      # NVML/CUDA UUID when known

    @property
    def available_bytes(self) -> int:
        return self.total_bytes - self.used_bytes - self.context_bytes

    def budget_bytes(self, headroom_bytes: int = 0) -> int:
        return self.available_bytes - headroom_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Device":
        return cls(**{k: d[k] for k in ("index", "name", "total_bytes", "used_bytes",
                                        "context_bytes", "uuid") if k in d})


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured.

    ``peak_bytes[i]`` is card i's allocator peak over the whole step (comparable with
    ``torch.cuda.max_memory_allocated``). When ``oom_device`` is set the probe ran out of
    memory on that card (a position in the backend's device list) and the peaks are only
    lower bounds. Optional fields are ``None`` where the backend cannot know them.
    """

    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    oom_device: Optional[int] = None
    breakdown: Optional[tuple[dict[str, int], ...]] = None     # category -> bytes at the peak
    reserved_bytes: Optional[tuple[int, ...]] = None          # allocator's max reserved
    nvml_used_bytes: Optional[tuple[Optional[int], ...]] = None  # whole card, NVML's view
    alloc_retries: Optional[tuple[int, ...]] = None           # cudaMalloc retries (at the edge)
    repeat_spread_bytes: Optional[tuple[int, ...]] = None     # max - min over repeats
    seconds: float = 0.0
    purpose: str = ""                                         # set by the tuner: why it ran
    note: str = ""
    # gathered output entries the loss never read: (entry, bytes on the output card)
    unread_outputs: Optional[tuple[tuple[str, int], ...]] = None
    # the step's time, per card and in all, measured or estimated (dptune.timing)
    time: Optional[StepTime] = None

    @property
    def feasible(self) -> bool:
        return self.oom_device is None

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["time"] = None if self.time is None else self.time.to_dict()
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = [list(x) if isinstance(x, tuple) else x for x in v]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProbeResult":
        kw = dict(d)
        for k in ("chunk_sizes", "peak_bytes", "breakdown", "reserved_bytes", "nvml_used_bytes",
                  "alloc_retries", "repeat_spread_bytes"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        if kw.get("unread_outputs") is not None:
            kw["unread_outputs"] = tuple((str(e), int(b)) for e, b in kw["unread_outputs"])
        if isinstance(kw.get("time"), Mapping):
            kw["time"] = StepTime.from_dict(kw["time"])
        return cls(**{k: v for k, v in kw.items() if k in cls.__dataclass_fields__})


@runtime_checkable
class Backend(Protocol):
    """What the tuner needs from a backend."""

    kind: str                        # "simulated" or "cuda"

    @property
    def devices(self) -> Sequence[Device]:
        """The cards, in the order of ``chunk_sizes``."""
        ...

    def describe(self) -> str:
        """A short name for reports, e.g. ``'4x24GB (simulated)'`` or ``'2x NVIDIA H100'``."""
        ...

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        """Run one training step with this split; OOM is a result, not an exception.

        Errors in the user's code raise :class:`dptune.errors.UserCodeError`.
        """
        ...

    def close(self) -> None:
        """Release what the backend holds; the user's objects are as they were."""
        ...
