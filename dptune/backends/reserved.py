"""Reserved memory and the card's whole use, predicted from the simulator's allocation trace.

The simulator's ledger calls a hook for every storage it charges to a card or frees
(:class:`TraceRecorder`: ``(card, +/-bytes, id)`` in order, ids free of addresses). The set-up
(weights, buffers, the optimizer state a warm-up step makes) is one trace per card; each
probe's step is another. :meth:`ReservedModel.predict` replays, per card, set-up + the step
as warm-up + the step measured (peaks reset before it, as ``reset_peak_memory_stats`` after a
warm-up step) through :mod:`dptune.backends.allocator`, and adds the fixed costs
(:mod:`dptune.backends.fixed_costs`).

Approximations (besides the allocator model's own): the warm-up step's trace is the measured
step's (the simulator runs one step; the optimizer state is made in the set-up, where a real
warm-up makes it after its backward); every allocation is on the card's default stream (a
DataParallel step runs each replica on its card's current stream; the copies of a batch that
starts on the host run on a side stream and are handed over with ``record_stream``, which is
not modelled); the capacity the allocator may reserve is the card's memory less other
processes, the CUDA context and NCCL's buffers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from dptune.backends.allocator import AllocatorConfig, AllocatorStats, Event, replay
from dptune.backends.base import Device
from dptune.backends.fixed_costs import FixedCosts

__all__ = ["TraceRecorder", "ReservedModel", "ReservedFigures", "WIDE_GAP"]

#: reserved over allocated by this share (and by at least 256 MiB) calls for the advice
WIDE_GAP = 0.25
_WIDE_GAP_MIN = 256 * 1024 * 1024


class TraceRecorder:
    """The ledger's hook: each card's mallocs (``+bytes``) and frees (``-bytes``), in order."""

    def __init__(self, n_cards: int):
        self.events: list[list[Event]] = [[] for _ in range(n_cards)]

    def __call__(self, card: int, delta: int, seq: int) -> None:
        self.events[card].append(Event(seq, delta))

    def mark(self) -> list[int]:
        """Where the next step's events begin."""
        return [len(e) for e in self.events]

    def cut(self, mark: Sequence[int]) -> list[list[Event]]:
        """The events since ``mark``, taken out (what is left is the set-up trace)."""
        step = [e[m:] for e, m in zip(self.events, mark)]
        for e, m in zip(self.events, mark):
            del e[m:]
        return step


@dataclass(frozen=True)
class ReservedFigures:
    """Per-card predictions of one probe (bytes)."""

    stats: tuple[AllocatorStats, ...]
    total_bytes: tuple[int, ...]                 # reserved peak + CUDA context + NCCL
    nccl_bytes: int
    expandable: Optional[tuple[AllocatorStats, ...]] = None   # when the gap is wide
    seconds: float = 0.0

    @property
    def oom_card(self) -> Optional[int]:
        """The first card whose replay ran out of memory (the allocator's OOM)."""
        return next((i for i, s in enumerate(self.stats) if s.num_ooms), None)

    def wide_gap(self) -> list[int]:
        """Cards whose reserved peak exceeds the allocated peak widely."""
        return [i for i, s in enumerate(self.stats) if _wide(s)]

    def probe_fields(self) -> dict:
        """The :class:`~dptune.backends.base.ProbeResult` fields these figures fill."""
        return dict(
            reserved_bytes=tuple(s.reserved_peak for s in self.stats),
            alloc_retries=tuple(s.num_alloc_retries for s in self.stats),
            total_bytes=self.total_bytes,
            memory_stats=tuple(s.memory_stats() for s in self.stats),
            expandable_reserved_bytes=(None if self.expandable is None
                                       else tuple(s.reserved_peak for s in self.expandable)))


def _wide(s: AllocatorStats) -> bool:
    gap = s.reserved_peak - s.allocated_peak
    return gap > WIDE_GAP * s.allocated_peak and gap >= _WIDE_GAP_MIN


@dataclass(frozen=True)
class ReservedModel:
    """The allocator configuration and the fixed costs a prediction uses."""

    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    fixed: FixedCosts = field(default_factory=FixedCosts)

    def predict(self, setup: Sequence[Sequence[Event]], step: Sequence[Sequence[Event]],
                devices: Sequence[Device]) -> ReservedFigures:
        """Replay set-up, warm-up step, measured step per card; see the module docstring."""
        t0 = time.perf_counter()
        nccl = self.fixed.nccl_for(len(devices))

        def run(cfg: AllocatorConfig) -> tuple[AllocatorStats, ...]:
            return tuple(replay([setup[i], step[i], step[i]],
                                max(0, d.available_bytes - nccl), cfg, measure_from=2)
                         for i, d in enumerate(devices))

        stats = run(self.config)
        expandable = None
        if not self.config.expandable_segments and any(_wide(s) for s in stats):
            expandable = run(AllocatorConfig(**{**self.config.__dict__, "expandable_segments": True}))
        total = tuple(s.reserved_peak + d.context_bytes + nccl for s, d in zip(stats, devices))
        return ReservedFigures(stats, total, nccl, expandable, time.perf_counter() - t0)
