"""dptune's small types, at the bottom of the package: they import nothing of dptune above them.

- :class:`Device` (one card as the tuner sees it) and :class:`ProbeResult` (what one probe
  measured), shared by every backend, the search, the result and the reports;
- :class:`CardWindow` and :class:`WindowCheck`: what a look past the over points of a
  certificate found (the simulator's allocator model, at the reserved level);
- the closed sets as enums: :class:`Objective` (what a search optimises), :class:`Strategy`
  (how a DDP plan's ranks hold the model), :class:`Category`
  (the parts of a per-card breakdown) and :class:`BackendKind` (real or simulated cards);
- the per-card rules every layer applies the same way: :func:`card_in_use` (card 0 always
  counts: it holds the master weights and gathers the outputs, even with no samples),
  :func:`within_budget` (every card in use at or under its budget; a probe's:
  :meth:`ProbeResult.within_budget`) and :func:`budget_share` (a peak as a share of the
  card's budget).

All memory figures are ``int`` bytes. Each enum is a ``str``: a member equals its value
(``Objective.MAX_BATCH == "max_batch"``) and is written to JSON as that value.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Mapping, Optional, Sequence, Union

from dptune.errors import UsageError

__all__ = ["StepTime", "TimeSource", "Device", "ProbeResult", "CardWindow", "WindowCheck", "CardCurve", "BalanceMap", "MapCheck", "EvenLine", "CATEGORIES", "Category", "Objective", "Strategy", "BackendKind",
           "card_in_use", "within_budget", "budget_share"]


class TimeSource(str, enum.Enum):
    """Where a time comes from."""

    MEASURED = "measured"       # CUDA events on a real card, median of timed steps
    ESTIMATED = "estimated"     # the simulator's roofline model (unvalidated unless stated)


@dataclass(frozen=True)
class StepTime:
    """The time of one training step, per card and in all (seconds).

    ``card_seconds[i]``: card i's own work for its chunk (its replica's forward and backward,
    or a DDP rank's whole step), 0.0 for a card with no samples; ``serial_seconds``: what runs
    on the output card alone, outside the replicas (loss, gradient clipping, the optimizer's
    step, DataParallel's gather); ``transfer_seconds``: the copies between cards that the
    step waits for (DataParallel's broadcast of the weights and reduction of the gradients,
    DDP's all-reduce). ``step_seconds``: the whole step as it runs. ``gather_seconds`` (part
    of ``serial_seconds``): DataParallel's copies of the other cards' outputs onto the output
    card and of their gradients back, which grow with the samples on those cards.

    ``card_seconds``, ``serial_seconds`` and ``transfer_seconds`` are the cards' work (the
    device part, :attr:`device_seconds`). An estimated step also has the host's part:
    ``host_seconds``, the time the Python thread takes to issue the whole step (every
    replica's ops and card 0's own), and ``card_host_seconds[i]`` (part of it), the issue time
    of card i's replica (0.0 for a card with no samples); the estimate's step is then
    ``max(host_seconds, device_seconds)`` (see :mod:`dptune.hardware.speeds`). A measured step has no
    host part (0.0, ``()``): its ``step_seconds`` is the wall time, whatever bound it.
    """

    card_seconds: tuple[float, ...]
    step_seconds: float
    source: TimeSource
    serial_seconds: float = 0.0
    transfer_seconds: float = 0.0
    gather_seconds: float = 0.0
    flops: tuple[int, ...] = ()          # per card (estimated steps only)
    bytes_moved: tuple[int, ...] = ()    # per card, memory traffic (estimated steps only)
    host_seconds: float = 0.0            # the host's issue time (estimated steps only)
    card_host_seconds: tuple[float, ...] = ()    # per card, part of host_seconds

    @property
    def device_seconds(self) -> float:
        """The cards' part of the step: the slowest card, card 0's own work, the copies."""
        return max(self.card_seconds, default=0.0) + self.serial_seconds + self.transfer_seconds

    @property
    def host_bound(self) -> bool:
        """The host's issue time sets the step (an estimate's verdict; False when measured)."""
        return self.host_seconds > self.device_seconds

    def samples_per_second(self, batch: int) -> float:
        return batch / self.step_seconds if self.step_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {"card_seconds": list(self.card_seconds), "step_seconds": self.step_seconds,
                "source": self.source.value, "serial_seconds": self.serial_seconds,
                "transfer_seconds": self.transfer_seconds, "gather_seconds": self.gather_seconds,
                "flops": list(self.flops),
                "bytes_moved": list(self.bytes_moved), "host_seconds": self.host_seconds,
                "card_host_seconds": list(self.card_host_seconds)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "StepTime":
        return cls(card_seconds=tuple(float(x) for x in d["card_seconds"]),
                   step_seconds=float(d["step_seconds"]), source=TimeSource(d["source"]),
                   serial_seconds=float(d.get("serial_seconds", 0.0)),
                   transfer_seconds=float(d.get("transfer_seconds", 0.0)),
                   gather_seconds=float(d.get("gather_seconds", 0.0)),
                   flops=tuple(int(x) for x in d.get("flops", ())),
                   bytes_moved=tuple(int(x) for x in d.get("bytes_moved", ())),
                   host_seconds=float(d.get("host_seconds", 0.0)),
                   card_host_seconds=tuple(float(x) for x in d.get("card_host_seconds", ())))


class _StrEnum(str, Enum):
    """A ``str`` enum whose ``str()`` and format are its value (as 3.11's ``StrEnum``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Category(_StrEnum):
    """A part of a card's memory in a per-card breakdown, in drawing order."""

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"
    INPUTS = "inputs"
    OUTPUTS = "outputs"
    OTHER = "other"


class Objective(_StrEnum):
    """What a search optimises: memory evened out at a given batch, the largest batch, or the
    fastest step at a given batch (dptune.search.throughput)."""

    BALANCE = "balance"
    MAX_BATCH = "max_batch"
    THROUGHPUT = "throughput"

    @property
    def flag(self) -> str:
        """The spelling of the command line (``--objective max-batch``)."""
        return self.value.replace("_", "-")

    @classmethod
    def parse(cls, value: Union[str, "Objective"]) -> "Objective":
        """``'balance'``, ``'max_batch'`` or ``'max-batch'`` (or a member); anything else is a
        :class:`dptune.errors.UsageError` naming the accepted values."""
        if isinstance(value, str):
            try:
                return cls(value.replace("-", "_"))
            except ValueError:
                pass
        raise UsageError(f"objective must be 'balance', 'max_batch' or 'throughput', got {value!r}")


class Strategy(_StrEnum):
    """How the DDP planner's ranks hold the model: replicated (DDP) or sharded (FSDP2)."""

    DDP = "ddp"
    FSDP = "fsdp"


class BackendKind(_StrEnum):
    """Which cards a backend probes: real GPUs through CUDA, or simulated ones."""

    CUDA = "cuda"
    SIMULATED = "simulated"


def card_in_use(card: int, chunk: int) -> bool:
    """Whether card ``card`` with ``chunk`` samples counts in a split: a card with samples,
    and card 0 always (it holds the master weights, the optimizer state and the gathered
    outputs even when it runs no replica)."""
    return card == 0 or chunk > 0


def within_budget(peak_bytes: Sequence[float], budget_bytes: Sequence[int],
                  chunk_sizes: Sequence[int]) -> bool:
    """Every card in use (:func:`card_in_use`) peaks at or under its budget."""
    return all(p <= b for i, (p, b, c) in enumerate(zip(peak_bytes, budget_bytes, chunk_sizes))
               if card_in_use(i, c))


def budget_share(peak_bytes: float, budget_bytes: int) -> float:
    """A peak as a share of the card's budget (1.0 = full); ``inf`` for a card with no budget."""
    return peak_bytes / budget_bytes if budget_bytes > 0 else float("inf")


#: Categories of a per-card breakdown, in drawing order (plain strings: the keys of a breakdown).
CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)


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
    ``torch.cuda.max_memory_allocated``), or, where the tuner checks budgets at the reserved
    level, the reserved peak plus NCCL (``allocated_peak_bytes`` then holds the allocated
    peak). When ``oom_device`` is set the probe ran out of memory on that card (a position in
    the backend's device list) and the peaks are only lower bounds. Optional fields are
    ``None`` where the backend cannot know them.
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
    # the allocator model (dptune.backends.simulated.reserved): predicted card use (reserved peak + CUDA
    # context + NCCL), per-card figures under torch.cuda.memory_stats()'s key names, and the
    # reserved peak with expandable_segments:True (set when reserved exceeds allocated widely)
    total_bytes: Optional[tuple[int, ...]] = None
    memory_stats: Optional[tuple[dict[str, int], ...]] = None
    expandable_reserved_bytes: Optional[tuple[int, ...]] = None
    # set when peak_bytes holds the budget level 'reserved' (dptune.budget.at_level):
    # the allocated peak, which peak_bytes holds otherwise
    allocated_peak_bytes: Optional[tuple[int, ...]] = None
    # the step's time, per card and in all, measured or estimated (dptune.hardware.speeds)
    time: Optional[StepTime] = None

    @property
    def feasible(self) -> bool:
        return self.oom_device is None

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    def within_budget(self, budget_bytes: Sequence[int]) -> bool:
        """Measured to fit: no card ran out of memory, and every card in use peaked at or
        under its budget (:func:`within_budget`)."""
        return self.feasible and within_budget(self.peak_bytes, budget_bytes, self.chunk_sizes)

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
                  "alloc_retries", "repeat_spread_bytes", "total_bytes", "memory_stats",
                  "expandable_reserved_bytes", "allocated_peak_bytes"):
            if kw.get(k) is not None:
                kw[k] = tuple(kw[k])
        if kw.get("unread_outputs") is not None:
            kw["unread_outputs"] = tuple((str(e), int(b)) for e, b in kw["unread_outputs"])
        if isinstance(kw.get("time"), Mapping):
            kw["time"] = StepTime.from_dict(kw["time"])
        return cls(**{k: v for k, v in kw.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class CardWindow:
    """One card's window past its over point, looked at on the simulator's allocator model:
    the figure at every chunk from ``start`` (one past the chunk measured, or on card 0 the
    answer's chunk, over) to where the allocated peak alone passes the budget, each step
    replayed from the card's traces scaled per sample.

    ``card``: the card (a position in the search's card list); ``start``: the first chunk
    looked at; ``end``: the first chunk whose allocated peak (a bound the level's figure never
    goes below) is over, so every chunk from there is over, ``None`` where the look stopped
    first (``limit`` replays); ``fits``: the first chunk in the window whose figure is within
    budget (``None``: none), and ``fits_bytes`` its figure. ``scaled``: ``False`` where the
    card's steps drawn between two simulated ones missed a third (a size that does not grow
    linearly with the samples), so nothing was looked at. Card 0 is looked at where the
    certificate says it is over: at the least it can take of each larger batch, the others at
    their caps (``batch_start``: the batch at ``start``); with no samples while the others'
    caps hold the batch (``no_samples``: ``start``, ``end`` and ``fits`` are then batches),
    then one more sample a step with the batch."""

    card: int
    start: int
    end: Optional[int]
    fits: Optional[int] = None
    fits_bytes: Optional[int] = None
    scaled: bool = True
    batch_start: Optional[int] = None
    no_samples: bool = False
    #: the last chunk within budget in the window (``None``: none): the card's cap on the model
    last_fits: Optional[int] = None

    @property
    def closed(self) -> bool:
        """Every chunk from ``start`` on is over budget (on the model)."""
        return self.scaled and self.fits is None and self.end is not None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, who: Optional[str] = None) -> str:
        """The window in words. ``who``: a DDP or FSDP2 rank's label ("rank 2"), whose
        window runs over its own batch (a rank holds no one else's samples)."""
        where = (who if who is not None else
                 "card 0 with no samples as the batch grows" if self.no_samples else
                 "card 0 with the batch, the others at their caps" if self.card == 0
                 else f"card {self.card}")
        if not self.scaled:
            return (f"{where}: its steps drawn between two simulated ones missed a third, "
                    "not looked at")

        def at(x: int) -> str:
            if self.no_samples or who is not None:
                return f"batch {x}"
            if self.card == 0 and self.batch_start is not None:
                return f"{x} samples (batch {self.batch_start + x - self.start})"
            return f"{x} samples"
        if self.fits is not None and self.fits == self.start:
            return f"{where} fits at {at(self.fits)}"
        if self.fits is not None:
            return f"{where} is over at {at(self.start)} and fits again at {at(self.fits)}"
        if self.end is None:
            return f"{where}: over from {at(self.start)} as far as looked"
        settled = ("card 0 must take samples, or its allocated peak alone is over"
                   if self.no_samples else "its allocated peak alone is over")
        if self.end == self.start:
            return f"{where}: from {at(self.start)} {settled}"
        return (f"{where}: over from {at(self.start)} to {at(self.end - 1)}, and from "
                f"{at(self.end)} {settled}")


@dataclass(frozen=True)
class WindowCheck:
    """A certificate's over points looked past (:class:`CardWindow` per card looked at)."""

    cards: tuple[CardWindow, ...]
    replays: int = 0

    @property
    def falls(self) -> tuple[CardWindow, ...]:
        """Cards that fit again above a chunk measured over: the certificate does not hold."""
        return tuple(w for w in self.cards if w.fits is not None)

    @property
    def closed(self) -> bool:
        """Every card looked at is over at every chunk past its over point."""
        return bool(self.cards) and all(w.closed for w in self.cards)

    def describe(self) -> str:
        return "; ".join(w.describe() for w in self.cards)

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [w.to_dict() for w in self.cards], "replays": self.replays}


@dataclass(frozen=True)
class CardCurve:
    """A balance map's card (:func:`dptune.backends.simulated.balance_map.balance_map`): its figure (the level's bytes: reserved peak + NCCL's buffers) at every chunk
    from ``lo`` to ``lo + len(figures) - 1``; ``zero`` its figure with no samples where
    ``lo`` reaches down to it (``None``: the card cannot hold no samples in a split at the
    level). Every other chunk is over the map's level, or cannot be in a split of the batch
    that holds every card at or below it."""

    card: int
    lo: int
    figures: tuple[int, ...]
    zero: Optional[int] = None

    def chunks(self) -> dict[int, int]:
        """chunk -> figure, for every chunk the curve holds."""
        out = {self.lo + k: f for k, f in enumerate(self.figures)}
        if self.zero is not None:
            out[0] = self.zero
        return out


@dataclass(frozen=True)
class BalanceMap:
    """Every card's :class:`CardCurve` at ``batch`` below ``level`` (a share of each card's
    budget), and the allocator replays it took."""

    batch: int
    level: float
    curves: tuple[CardCurve, ...]
    replays: int


@dataclass(frozen=True)
class MapCheck:
    """A balance solved on the allocator model's map (:class:`BalanceMap`): ``bound`` the
    largest share of the probes' answer the map was drawn below, ``least`` the least
    largest share of any split on the map, ``level`` the least of the splits that keep alike
    cards within one sample of each other (``least`` where none or no alike cards; the
    answer's where certified), ``ranges`` per card the chunks drawn ``[lo, hi)`` (every
    other chunk over ``bound``, or in no split of the batch at it), ``replays`` the
    allocator replays it took."""

    bound: float
    least: float
    level: float
    ranges: tuple[tuple[int, int], ...]
    replays: int

    def describe(self) -> str:
        spans = ", ".join(f"card {i}: {lo}-{hi - 1}" for i, (lo, hi) in enumerate(self.ranges))
        return (f"every split of the batch holds a card at {self.least:.2%} of its budget or "
                f"more (each card's figure at every chunk it could take in a split at most as "
                f"high as {self.bound:.2%}: {spans}; {self.replays} replays)")

    def to_dict(self) -> dict[str, Any]:
        return {"bound": self.bound, "least": self.least, "level": self.level,
                "ranges": [list(r) for r in self.ranges], "replays": self.replays}


@dataclass(frozen=True)
class EvenLine:
    """The even split's largest batch found on the simulator's allocator model past the
    probes' last known fit ``start``: every valid even batch from ``start + 1`` to
    ``largest`` replayed within budget, the next valid one, ``over``, over on card ``card``;
    ``replays`` the allocator replays it took, ``steps`` the simulated steps it drew them
    from."""

    start: int
    largest: int
    over: int
    card: int
    replays: int
    steps: int

    def describe(self) -> str:
        between = (f"every even batch from {self.start + 1} to {self.largest} within budget, "
                   if self.largest > self.start else "")
        return (f"{between}the even batch {self.over} over on card {self.card} ({self.replays} "
                f"replays from {self.steps} simulated steps)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
