"""Reserved memory and the card's whole use, predicted from the simulator's allocation trace.

The simulator's ledger calls a hook for every storage it charges to a card or frees
(:class:`TraceRecorder`: ``(card, +/-bytes, id, stream)`` in order, ids free of addresses). The set-up
(weights, buffers, the optimizer state a warm-up step makes) is one trace per card; each
probe's step is another. :meth:`ReservedModel.predict` replays, per card, set-up + the step
as warm-up + the step measured (peaks reset before it, as ``reset_peak_memory_stats`` after a
warm-up step) through :mod:`dptune.backends.simulated.allocator`, and adds the fixed costs
(:mod:`dptune.budget`). The replay depends only on the trace and the capacity, so
cards of one type given the same work (their traces alike up to the ids' names) share one.

Streams: a DataParallel step runs each replica on its card's current (default) stream, so
every allocation is on stream 0 except the input chunks of a batch that starts on the host:
``Scatter`` copies them on a background stream per card (``_get_stream``), so their blocks
belong to that stream's pools (stream 1 here) and are never reused by the default stream.

Approximations (besides the allocator model's own): the warm-up step's trace is the measured
step's unless other warm-up traces are given (the simulator runs one step; the optimizer state
is made in the set-up, where a real warm-up makes it after its backward); the input chunks'
``record_stream`` hand-over is taken as done at their free (the block goes back to the copy
stream's pool at once, where the allocator waits for the default stream's event); the
capacity the allocator may reserve is the card's memory less other processes, the CUDA
context and NCCL's buffers.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig, AllocatorStats, Event, replay
from dptune.backends.base import Device, ProbeResult
from dptune.budget import DEFAULT_HEADROOM, BudgetLevel, FixedCosts, parse_level
from dptune.errors import UsageError
from dptune.units import format_bytes

__all__ = ["TraceRecorder", "ReservedModel", "ReservedFigures", "WIDE_GAP", "level_settings", "advice_lines",
           "merge_rank_probes", "least_capacity", "canonical_traces",
           "predict_steps", "step_stats", "NO_LIMIT"]

#: reserved over allocated by this share (and by at least 256 MiB) calls for the advice
WIDE_GAP = 0.25
_WIDE_GAP_MIN = 256 * 1024 * 1024


class TraceRecorder:
    """The ledger's hook: each card's mallocs (``+bytes``) and frees (``-bytes``), in order."""

    def __init__(self, n_cards: int):
        self.events: list[list[Event]] = [[] for _ in range(n_cards)]
        self._pending: list[list[Event]] = [[] for _ in range(n_cards)]

    def __call__(self, card: int, delta: int, seq: int, stream: int = 0) -> None:
        self.events[card].append(Event(seq, delta, stream))

    def mark(self) -> list[int]:
        """Where the next step's events begin. Set-up storages the last step freed (a
        replaced buffer, say) are freed in the set-up trace from now on."""
        for e, pending in zip(self.events, self._pending):
            e.extend(pending)
            pending.clear()
        return [len(e) for e in self.events]

    def cut(self, mark: Sequence[int]) -> list[list[Event]]:
        """The events since ``mark``, taken out (what is left is the set-up trace)."""
        step = [e[m:] for e, m in zip(self.events, mark)]
        for card, (e, m) in enumerate(zip(self.events, mark)):
            del e[m:]
            live: set = set()
            for ev in e:
                (live.add if ev.delta > 0 else live.discard)(ev.id)
            self._pending[card] = [ev for ev in step[card] if ev.delta < 0 and ev.id in live]
        return step


@dataclass(frozen=True)
class ReservedFigures:
    """Per-card predictions of one probe (bytes). On a card whose replay ran out of memory
    (``num_ooms``) the peaks are what the step would need on a card without that limit."""

    stats: tuple[AllocatorStats, ...]
    total_bytes: tuple[int, ...]                 # reserved peak + CUDA context + NCCL
    nccl_bytes: int
    expandable: Optional[tuple[AllocatorStats, ...]] = None   # when the gap is wide
    seconds: float = 0.0
    replays: int = 0        # allocator replays run: one per distinct (capacity, trace), per mode

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
                devices: Sequence[Device],
                warmup: Optional[Sequence[Sequence[Sequence[Event]]]] = None) -> ReservedFigures:
        """Replay per card the set-up, the warm-up steps (``warmup``: per-card traces of each
        step run before, in order; default: ``step`` once) and the measured ``step``; once per
        distinct (capacity, trace): like cards given like work share one replay."""
        t0 = time.perf_counter()
        nccl = self.fixed.nccl_for(len(devices))
        before = [step] if warmup is None else list(warmup)

        replays = 0

        def card(traces: Sequence[Sequence[Event]], cap: int, cfg: AllocatorConfig) -> AllocatorStats:
            nonlocal replays
            replays += 1
            s = step_stats(traces, cfg, cap)
            if not s.num_ooms and not s.num_alloc_retries:
                return s
            # past an OOM, or where the allocator had to free its cache and retry a
            # cudaMalloc: the figures the step would need (the peak after a retry is lower
            # than the step's need, and which steps retry depends on fragmentation: a larger
            # step that retries could read lower than a smaller one that runs out, so the
            # level's figure would not grow with the work); the OOM and retries kept
            need = step_stats(traces, cfg)
            return dataclasses.replace(need, num_ooms=s.num_ooms, oom_event=s.oom_event,
                                       num_alloc_retries=s.num_alloc_retries)

        # like cards (the same capacity, the same trace up to the ids' names) replay once
        jobs = [(canonical_traces([setup[i], *(w[i] for w in before), step[i]]),
                 max(0, d.available_bytes - nccl)) for i, d in enumerate(devices)]

        def run(cfg: AllocatorConfig) -> tuple[AllocatorStats, ...]:
            done: dict[tuple, AllocatorStats] = {}
            for job in jobs:
                if job not in done:
                    done[job] = card(job[0], job[1], cfg)
            return tuple(done[job] for job in jobs)

        stats = run(self.config)
        expandable = None
        if not self.config.expandable_segments and any(_wide(s) for s in stats):
            expandable = run(dataclasses.replace(self.config, expandable_segments=True))
        total = tuple(s.reserved_peak + d.context_bytes + nccl for s, d in zip(stats, devices))
        return ReservedFigures(stats, total, nccl, expandable, time.perf_counter() - t0, replays)


#: a capacity no step reaches: the replay's figures without a memory limit
NO_LIMIT = 1 << 62


def step_stats(traces: Sequence[Sequence[Event]], config: AllocatorConfig,
               capacity: int = NO_LIMIT) -> AllocatorStats:
    """The measured (last) step's figures of ``traces`` (set-up, warm-up steps, the measured
    step) replayed through one card's allocator of ``capacity`` bytes (default: no limit)."""
    return replay(traces, capacity, config, measure_from=len(traces) - 1)


def least_capacity(traces: Sequence[Sequence[Event]], config: Optional[AllocatorConfig] = None,
                   granularity: int = 2 * 1024 * 1024) -> int:
    """The least memory (bytes, a multiple of ``granularity``) the allocator may reserve and
    still run ``traces`` (set-up, warm-up steps, the measured step) without running out of
    memory, freeing its cache and retrying where it must (``num_alloc_retries``): what a card
    needs for the step, at most the reserved peak without a limit, at least the allocated
    peak. By bisection over replays (running out is monotone in the capacity for one trace
    only approximately; the bisection reads it as monotone). The reserved level's figure is
    the peak without a limit, which a step that has to retry exceeds (see
    ``benchmarks.fragmentation``)."""
    cfg = config or AllocatorConfig()
    free = step_stats(traces, cfg)
    lo = max(0, free.allocated_peak // granularity - 1)     # runs out at lo * granularity
    hi = -(-free.reserved_peak // granularity)              # runs at hi * granularity
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step_stats(traces, cfg, mid * granularity).num_ooms:
            lo = mid
        else:
            hi = mid
    return hi * granularity


def canonical_traces(traces: Sequence[Sequence[Event]]) -> tuple[tuple[Event, ...], ...]:
    """The traces with their ids renamed 0, 1, 2, ... in order of first use: two cards whose
    traces differ only in the ids' names (each card's storages have their own) replay alike,
    as the replay uses an id only to pair a free with its malloc."""
    names: dict[object, int] = {}
    return tuple(tuple(Event(names.setdefault(ev.id, len(names)), ev.delta, ev.stream) for ev in t)
                 for t in traces)


def level_settings(budget_level: "str | BudgetLevel", headroom: "int | str | None",
                   allocator: "str | AllocatorConfig | None" = None,
                   nccl_bytes: "int | str | None" = None
                   ) -> tuple[BudgetLevel, int, Optional[ReservedModel]]:
    """The level, the headroom in bytes (``None``: the level's default) and, at the reserved
    level, the allocator model (``allocator`` ``None``: ``PYTORCH_CUDA_ALLOC_CONF``, read only
    then); what :class:`dptune.Tuner` and :func:`dptune.ddp.plan` take. Bad values raise
    :class:`UsageError` (a bad allocator option its :class:`~dptune.errors.SpecError`)."""
    from dptune.units import parse_bytes

    level = parse_level(budget_level)
    try:
        room = DEFAULT_HEADROOM[level] if headroom is None else parse_bytes(headroom)
        nccl = None if nccl_bytes is None else parse_bytes(nccl_bytes)
    except ValueError as e:
        raise UsageError(f"headroom/nccl_bytes: {e}") from None
    if level is BudgetLevel.ALLOCATED:
        return level, room, None
    config = (AllocatorConfig.from_env() if allocator is None else allocator
              if isinstance(allocator, AllocatorConfig) else AllocatorConfig.parse(allocator))
    return level, room, ReservedModel(config, FixedCosts(nccl))


def advice_lines(r: ProbeResult) -> list[str]:
    """When the predicted reserved peak exceeds the allocated peak widely: how much, and the
    reserved peak predicted with ``expandable_segments:True``."""
    if r.memory_stats is None or r.expandable_reserved_bytes is None:
        return []
    out = []
    for i, (ms, es) in enumerate(zip(r.memory_stats, r.expandable_reserved_bytes)):
        alloc, res = ms["allocated_bytes.all.peak"], ms["reserved_bytes.all.peak"]
        gap = res - alloc
        if gap > WIDE_GAP * alloc and gap >= _WIDE_GAP_MIN:
            out.append(
                f"card {i}: the caching allocator is predicted to reserve {format_bytes(res)} for "
                f"{format_bytes(alloc)} allocated ({format_bytes(gap)} cached but free, "
                f"fragmentation); with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it is "
                f"predicted to reserve {format_bytes(es)}")
    return out


def merge_rank_probes(probes: Sequence[ProbeResult], devices: Sequence[Device]) -> ProbeResult:
    """One probe of a DDP world from each rank's one-card probe (rank r on card r): per-card
    fields side by side; the OOM card is the one most over its memory, else the first whose
    allocator replay ran out."""
    def cat(name: str) -> Optional[tuple]:
        parts = [getattr(p, name) for p in probes]
        return None if any(x is None for x in parts) else tuple(x[0] for x in parts)

    peaks = tuple(p.peak_bytes[0] for p in probes)
    over = [(x - d.available_bytes) / d.available_bytes for x, d in zip(peaks, devices)]
    worst = max(range(len(over)), key=lambda i: over[i])
    oom = worst if over[worst] > 0 else next(
        (i for i, p in enumerate(probes) if p.oom_device is not None), None)
    expandable = [p.expandable_reserved_bytes[0] if p.expandable_reserved_bytes is not None
                  else (p.reserved_bytes or (0,))[0] for p in probes]
    return ProbeResult(
        chunk_sizes=tuple(p.chunk_sizes[0] for p in probes), peak_bytes=peaks, oom_device=oom,
        breakdown=cat("breakdown"), reserved_bytes=cat("reserved_bytes"),
        alloc_retries=cat("alloc_retries"), total_bytes=cat("total_bytes"),
        memory_stats=cat("memory_stats"),
        expandable_reserved_bytes=(None if all(p.expandable_reserved_bytes is None for p in probes)
                                   else tuple(expandable)),
        seconds=sum(p.seconds for p in probes), note="simulated DDP")


def predict_steps(backend: "SimulatedLike", splits: Sequence[Sequence[int]],
                  model: Optional[ReservedModel] = None) -> ReservedFigures:
    """A run of steps of different shapes (variable batch sizes or lengths): each split is
    simulated in turn, and the last is measured after all the others as warm-up steps, in
    order, so cached segments from each step shape the next (where fragmentation grows).
    ``backend`` is a :class:`~dptune.backends.simulated.SimulatedBackend` built with
    ``reserved=``; ``model`` overrides its allocator model."""
    use = model or backend.reserved
    if use is None:
        raise UsageError("predict_steps needs an allocator model: build the backend with "
                         "reserved=ReservedModel(...) or pass model=")
    traces = []
    for split in splits:
        backend.estimate(split)
        traces.append(backend._step_trace)
    if backend._recorder is None or not traces:
        raise UsageError("predict_steps needs at least one split and a backend built with reserved=")
    return use.predict(backend._recorder.events, traces[-1], backend.devices, warmup=traces[:-1])


class SimulatedLike(Protocol):
    """What :func:`predict_steps` uses of a simulated backend."""

    reserved: Optional[ReservedModel]
    _recorder: Optional[TraceRecorder]
    _step_trace: list

    @property
    def devices(self) -> Sequence[Device]: ...

    def estimate(self, chunk_sizes: Sequence[int], output_device: int = 0) -> object: ...
