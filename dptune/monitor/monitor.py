"""The training-time monitor: every card read after each step (or every N), against the plan.

Usage in a plain loop (see docs/guides/monitor.md for the Trainer, Lightning and DDP)::

    monitor = dptune.MemoryMonitor(plan, run_dir="runs/monitor")
    for x, y in loader:
        with monitor.step(batch_size=len(x), length=x.shape[1]):
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    monitor.close()

**Peaks, and what the user's code reads.** By default (``reset_peaks=False``) the monitor never
resets torch's peak counters, so ``torch.cuda.max_memory_allocated`` and the like read in the
user's code are exactly what they would be without it. The peak it records is then the peak
since the start (or since the user's own reset), and a step's own peak is known when it sets a
new high (or the user reset the counters); a step that stays below the high so far is below a
figure already compared with the plan, and is not compared again. With ``reset_peaks=True``
(for code that does not read the peaks itself) the monitor resets them after each reading, so
each row holds the peak of the steps since the previous reading; the run's peaks are kept
aside (:meth:`MemoryMonitor.run_peaks`). A reserved peak that did not rise above what the
allocator's cache held at the reset belongs to an earlier step (the cache keeps what a longer
step reserved) and is not compared with this interval's shapes. Nothing else of the user's is touched: no tensor, no
RNG, no synchronisation (the allocator's statistics are host-side counters).

Without any CUDA card the monitor warns once and does nothing: the steps run as they would.
"""

from __future__ import annotations

import collections
import datetime
import os
import sys
import time
import warnings
import weakref
from typing import Any, Literal, Optional, Sequence

from dptune.budget import DEFAULT_HEADROOM, BudgetLevel, parse_level
from dptune.errors import UsageError
from dptune.monitor.cards import CardReading, CardRuntime, current_device, default_runtime, read_card
from dptune.monitor.events import (EventKind, Limiter, MonitorEvent, MonitorWarning, fragmentation_advice,
                                   shape_text)
from dptune.monitor.expect import Expectation, Expected, PlanKind, expectation
from dptune.monitor.forensics import is_oom, oom_card
from dptune.monitor.record import RUN_KIND, RUN_VERSION, CardInfo, RunWriter
from dptune.units import format_bytes as fb
from dptune.units import parse_bytes

__all__ = ["MemoryMonitor", "StepScope", "ROWS_KEPT", "SNAPSHOT_ENTRIES"]

#: rows kept in memory (:attr:`MemoryMonitor.rows`); the run folder has them all
ROWS_KEPT = 10_000
#: allocator events the opt-in snapshot keeps (``_record_memory_history(max_entries=...)``)
SNAPSHOT_ENTRIES = 100_000
_CACHE = 4096


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"MemoryMonitor({name}=...) must be an int >= 1, got {value!r}")
    return value


def _distributed() -> tuple[int, int]:
    """``(rank, world_size)`` of an initialised ``torch.distributed`` group, else ``(0, 1)``
    (``torch.distributed`` is not imported for it)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


class StepScope:
    """``with monitor.step(...):``; reads the cards after the step, and on CUDA's
    out-of-memory error records the forensics, then lets the same exception go on."""

    __slots__ = ("monitor", "batch_size", "length", "index")

    def __init__(self, monitor: "MemoryMonitor", batch_size: Optional[int], length: Optional[int],
                 index: Optional[int]) -> None:
        self.monitor, self.batch_size, self.length, self.index = monitor, batch_size, length, index

    def __enter__(self) -> "MemoryMonitor":
        return self.monitor

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> Literal[False]:
        if exc is None:
            self.monitor.observe(self.batch_size, self.length, step=self.index)
        elif self.monitor.active and is_oom(exc):
            self.monitor.record_oom(exc, self.batch_size, self.length, step=self.index)
        return False               # never swallow: the user's exception goes on, the same object


class MemoryMonitor:
    """Watches every card a run trains on, against a plan; see the module docstring.

    - ``plan``: a :class:`~dptune.TuneResult`, a :class:`~dptune.ddp.result.DDPPlan` (DDP or
      FSDP2), a :class:`~dptune.lengths.plan.LengthPlan`, the path of a saved one, or ``None``
      (figures and headroom/fragmentation events only).
    - ``devices``: torch indices of the cards to read (default: the current card under
      ``torch.distributed``, else the plan's cards, else every visible card).
    - ``every``: read the cards every N steps (1: after each).
    - ``run_dir``: the run's folder (:mod:`dptune.monitor.record`); ``None`` keeps the last
      :data:`ROWS_KEPT` rows and the events in memory only.
    - ``level``: which peak meets the plan: ``"reserved"`` (the default, as plans are made)
      or ``"allocated"`` (a plan made with ``budget_level="allocated"``).
    - ``margin``: bytes (or ``"512MiB"``) a peak may exceed the prediction by, and the least
      room left on a card, before an event (default: the level's default headroom).
    - ``reset_peaks``: reset torch's peak counters after each reading (see the module docstring).
    - ``snapshot``: record the allocator's history and save its snapshot on out-of-memory.
    - ``rank``: this process's rank in the plan (default: ``torch.distributed``'s).
    - ``runtime``: the CUDA runtime to read (:class:`~dptune.monitor.cards.CardRuntime`).
    - ``quiet_steps``: the fewest steps between two warned events of one kind on one card.
    """

    def __init__(self, plan: Any = None, *, devices: Optional[Sequence[int]] = None, every: int = 1,
                 run_dir: "str | os.PathLike[str] | None" = None, level: "str | BudgetLevel" = "reserved",
                 margin: "int | str | None" = None, reset_peaks: bool = False, snapshot: bool = False,
                 rank: Optional[int] = None, runtime: Optional[CardRuntime] = None,
                 quiet_steps: int = 100) -> None:
        self.every = _positive_int(every, "every")
        self.quiet_steps = _positive_int(quiet_steps, "quiet_steps")
        self.level = parse_level(level)
        self.margin = DEFAULT_HEADROOM[self.level] if margin is None else parse_bytes(margin)
        self.reset_peaks = bool(reset_peaks)
        self.snapshot = bool(snapshot)
        self.expectation: Expectation = expectation(plan)
        self.runtime: CardRuntime = runtime if runtime is not None else default_runtime()
        self.events: list[MonitorEvent] = []
        self.rows: collections.deque[dict[str, Any]] = collections.deque(maxlen=ROWS_KEPT)
        self.steps = 0
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self._closed = False
        self.active = bool(self.runtime.is_available()) and self.runtime.device_count() > 0
        if not self.active:
            self.cards: tuple[CardInfo, ...] = ()
            warnings.warn("dptune.MemoryMonitor: no CUDA card is visible, so there is nothing to "
                          "watch; the run goes on untouched and nothing is recorded",
                          MonitorWarning, stacklevel=2)
            return
        dist_rank, self.world_size = _distributed()
        self.rank = dist_rank if rank is None else rank
        self.cards = self._cards(devices)
        self._setup()

    # ---- set-up -----------------------------------------------------------------------------
    def _cards(self, devices: Optional[Sequence[int]]) -> tuple[CardInfo, ...]:
        rt, exp = self.runtime, self.expectation
        per_rank = exp.kind is PlanKind.RANKS or (exp.kind is PlanKind.LENGTHS and exp.plan.ddp)
        if devices is not None:
            ids = [int(d) for d in devices]
        elif self.world_size > 1 or per_rank:
            ids = [current_device(rt)]
        elif exp.kind is not PlanKind.NONE:
            ids = list(range(min(exp.slots, rt.device_count())))
        else:
            ids = list(range(rt.device_count()))
        count = rt.device_count()
        bad = [d for d in ids if not 0 <= d < count]
        if bad or not ids:
            raise UsageError(f"MemoryMonitor(devices={ids}) names cards torch cannot see "
                             f"({count} visible: 0..{count - 1})")
        slots = [self.rank if per_rank else i for i in range(len(ids))]
        return tuple(CardInfo(rank=self.rank, card=d, slot=s, name=str(rt.name(d)), total_bytes=int(rt.total(d)),
                              uuid=rt.uuid(d), budget_bytes=exp.budget(s)) for d, s in zip(ids, slots))

    def _setup(self) -> None:
        rt = self.runtime
        n = len(self.cards)
        self._ids = [c.card for c in self.cards]
        self._totals = [c.total_bytes for c in self.cards]
        self._limiter = Limiter(self.quiet_steps)
        self._cache: list[dict[tuple[Optional[int], Optional[int]], Expected]] = [{} for _ in range(n)]
        self._interval: list[Optional[tuple[Expected, Optional[int], Optional[int]]]] = [None] * n
        self._off_plan_at: list[Optional[int]] = [None] * n
        self._low_at: list[Optional[int]] = [None] * n     # the last headroom event while it stays low
        self._start = time.monotonic()
        self._started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.last: list[Optional[dict[str, Any]]] = [None] * n
        first = [read_card(rt, d, t) for d, t in zip(self._ids, self._totals)]
        if self.reset_peaks:
            for d in self._ids:
                rt.reset_peak_memory_stats(d)
        self._prev_peak = [r.reserved if self.reset_peaks else self._measured(r) for r in first]
        self._retries = [r.retries for r in first]
        self._ooms = [r.ooms for r in first]
        self._others0 = [self._others(r) for r in first]
        self._run_alloc = [r.allocated_peak for r in first]
        self._run_reserved = [r.reserved_peak for r in first]
        self._writer = None if self.run_dir is None else RunWriter(self.run_dir, self.rank)
        self._finalizer = None if self._writer is None else weakref.finalize(self, self._writer.close)
        if self.snapshot:
            from dptune import _torch_private

            if not _torch_private.record_memory_history(SNAPSHOT_ENTRIES):
                warnings.warn("dptune.MemoryMonitor(snapshot=True): this torch cannot record the "
                              "allocator's history; out-of-memory forensics go on without a snapshot",
                              MonitorWarning, stacklevel=3)
                self.snapshot = False
        self._write_meta()

    def _known(self, i: int, r: CardReading, measured: int) -> bool:
        """Whether ``measured`` is the interval's own peak: a new high since the last reading
        (or since the user's own reset, which lowers it). With the peaks reset, an allocated
        peak always is; a reserved peak only when it rose above what the cache held at the
        reset (memory a longer step reserved earlier stays in the cache, and its figure then
        belongs to that step)."""
        prev = self._prev_peak[i]
        if self.reset_peaks:
            self._prev_peak[i] = r.reserved
            return self.level is BudgetLevel.ALLOCATED or measured > prev
        self._prev_peak[i] = measured
        return measured != prev

    def _measured(self, r: CardReading) -> int:
        return r.reserved_peak if self.level is BudgetLevel.RESERVED else r.allocated_peak

    @staticmethod
    def _others(r: CardReading) -> int:
        """Bytes on the card that are not this process's allocator (other processes, the CUDA
        context): the card's use less what the allocator reserves."""
        return r.total - r.free - r.reserved

    def _write_meta(self, final: bool = False) -> None:
        if self._writer is None:
            return
        meta: dict[str, Any] = dict(
            kind=RUN_KIND, version=RUN_VERSION, rank=self.rank, world_size=self.world_size,
            level=self.level.value, margin_bytes=self.margin, every=self.every,
            peak_scope="reading" if self.reset_peaks else "run", snapshot=self.snapshot,
            cards=[c.to_dict() for c in self.cards], plan=self.expectation.to_dict(),
            started=self._started,
            steps=self.steps, finished=final)
        if final:
            meta["run_peaks"] = [dict(card=c.card, **{"allocated_bytes.all.peak": a, "reserved_bytes.all.peak": r})
                                 for c, a, r in zip(self.cards, self._run_alloc, self._run_reserved)]
        self._writer.write_meta(meta)

    # ---- the steps --------------------------------------------------------------------------
    def step(self, batch_size: Optional[int] = None, length: Optional[int] = None, *,
             step: Optional[int] = None) -> StepScope:
        """A context manager around one training step: ``with monitor.step(batch_size=8,
        length=512): ...``; ``step`` numbers it (default: one more than the last)."""
        return StepScope(self, batch_size, length, step)

    def _expect(self, i: int, batch_size: Optional[int], length: Optional[int]) -> Expected:
        cache = self._cache[i]
        key = (batch_size, length)
        found = cache.get(key)
        if found is None:
            found = self.expectation.expect(self.cards[i].slot, batch_size, length)
            if len(cache) < _CACHE:
                cache[key] = found
        return found

    def observe(self, batch_size: Optional[int] = None, length: Optional[int] = None, *,
                step: Optional[int] = None) -> list[MonitorEvent]:
        """After a step: note its shape, and every ``every`` steps read the cards. Returns the
        events of this call (also in :attr:`events`)."""
        if not self.active or self._closed:
            return []
        self.steps += 1
        index = self.steps if step is None else int(step)
        new: list[MonitorEvent] = []
        for i in range(len(self.cards)):
            exp = self._expect(i, batch_size, length)
            held = self._interval[i]
            if held is None or (exp.predicted is not None and
                                (held[0].predicted is None or exp.predicted > held[0].predicted)):
                self._interval[i] = (exp, batch_size, length)
            if exp.off_plan:
                at = self._off_plan_at[i]
                if at is None or index - at >= self.quiet_steps:
                    self._off_plan_at[i] = index
                    new.append(self._off_plan(i, index, exp, batch_size, length))
        if self.steps % self.every == 0:
            new.extend(self._read(index, batch_size, length))
        for e in new:
            self._emit(e)
        return new

    def _read(self, index: int, batch_size: Optional[int], length: Optional[int]) -> list[MonitorEvent]:
        rt, new, rows = self.runtime, [], []
        seconds = round(time.monotonic() - self._start, 6)
        for i, card in enumerate(self.cards):
            r = read_card(rt, card.card, self._totals[i])
            measured = self._measured(r)
            known = self._known(i, r, measured)
            held = self._interval[i]
            exp, b, n = held if held is not None else (Expected(None, card.budget_bytes), batch_size, length)
            self._interval[i] = None
            if known and exp.predicted is not None and measured > exp.predicted + self.margin:
                new.append(self._drift(i, index, exp, measured, b, n))
            if r.headroom >= self.margin:
                self._low_at[i] = None
            elif self._low_at[i] is None or index - self._low_at[i] >= self.quiet_steps:   # type: ignore[operator]
                self._low_at[i] = index
                new.append(self._headroom(i, index, r, b, n))
            if r.retries > self._retries[i]:
                new.append(self._fragmentation(i, index, r, b, n))
            if r.ooms > self._ooms[i]:
                new.append(self._caught_oom(i, index, r, b, n))
            self._retries[i], self._ooms[i] = r.retries, r.ooms
            self._run_alloc[i] = max(self._run_alloc[i], r.allocated_peak)
            self._run_reserved[i] = max(self._run_reserved[i], r.reserved_peak)
            row = dict(rank=card.rank, card=card.card, step=index, seconds=seconds, batch_size=b, length=n,
                       **r.torch_stats(), nvml_used_bytes=r.nvml_used, total_bytes=r.total,
                       headroom_bytes=r.headroom, predicted_peak_bytes=exp.predicted,
                       budget_bytes=exp.budget if exp.budget is not None else card.budget_bytes)
            rows.append(row)
            self.last[i] = row
            if self.reset_peaks:
                rt.reset_peak_memory_stats(card.card)
        self.rows.extend(rows)
        if self._writer is not None:
            self._writer.rows(rows)
        return new

    # ---- events -----------------------------------------------------------------------------
    def _where(self, i: int, index: int, b: Optional[int], n: Optional[int]) -> str:
        c = self.cards[i]
        who = f"rank {c.rank} card {c.card}" if self.world_size > 1 else f"card {c.card}"
        return f"dptune monitor: {who}, step {index}, {shape_text(b, n)}"

    def _event(self, kind: EventKind, i: int, index: int, message: str, b: Optional[int], n: Optional[int],
               **figures: Any) -> MonitorEvent:
        c = self.cards[i]
        return MonitorEvent(kind=kind, step=index, card=c.card, rank=c.rank, message=message,
                            batch_size=b, length=n, **figures)

    def _drift(self, i: int, index: int, exp: Expected, measured: int, b: Optional[int],
               n: Optional[int]) -> MonitorEvent:
        assert exp.predicted is not None
        over = measured - exp.predicted
        budget = exp.budget
        near = "" if budget is None or measured <= budget else \
            f"; it is {fb(measured - budget)} over the card's budget {fb(budget)}: an out-of-memory error is near"
        why = f" ({exp.off_plan})" if exp.off_plan else ""
        todo = ("keep the steps to the plan's shapes (dptune.lengths.BucketBatchSampler) or plan again "
                "for these" if exp.off_plan else
                "plan again on this workload (model, data or step settings differ from what was "
                "planned), or lower the batch")
        msg = (f"{self._where(i, index, b, n)}: {self.level.value} peak {fb(measured)} is over the plan's "
               f"{fb(exp.predicted)} for {exp.where}{why} by {fb(over)} (margin {fb(self.margin)}){near}. "
               f"Do: {todo}")
        return self._event(EventKind.DRIFT, i, index, msg, b, n, predicted_bytes=exp.predicted,
                           measured_bytes=measured, budget_bytes=budget)

    def _off_plan(self, i: int, index: int, exp: Expected, b: Optional[int], n: Optional[int]) -> MonitorEvent:
        msg = (f"{self._where(i, index, b, n)}: {exp.off_plan}; compared with {exp.where} "
               f"(predicted {fb(exp.predicted)}). Do: draw batches the plan covers "
               "(dptune.lengths.BucketBatchSampler), or plan again for this shape")
        return self._event(EventKind.OFF_PLAN, i, index, msg, b, n, predicted_bytes=exp.predicted,
                           budget_bytes=exp.budget)

    def _headroom(self, i: int, index: int, r: CardReading, b: Optional[int], n: Optional[int]) -> MonitorEvent:
        others, was = self._others(r), self._others0[i]
        rose = f" (was {fb(was)} when the monitor started)" if others > was else ""
        seen = f"NVML sees {fb(r.nvml_used)} used" if r.nvml_used is not None else \
            f"the driver has {fb(r.free)} free"
        msg = (f"{self._where(i, index, b, n)}: {fb(r.headroom)} left on the {fb(r.total)} card at this "
               f"step's reserved peak {fb(r.reserved_peak)}, under the margin {fb(self.margin)}; {seen}, "
               f"{fb(others)} of it outside this process's allocator{rose}. Do: free the card of the other "
               "process, or lower the batch: a longer step may run out of memory")
        return self._event(EventKind.HEADROOM, i, index, msg, b, n, measured_bytes=r.headroom,
                           budget_bytes=self.cards[i].budget_bytes)

    def _fragmentation(self, i: int, index: int, r: CardReading, b: Optional[int],
                       n: Optional[int]) -> MonitorEvent:
        msg = (f"{self._where(i, index, b, n)}: num_alloc_retries rose from {self._retries[i]} to {r.retries} "
               f"(the allocator freed its cache and retried a cudaMalloc: fragmentation; reserved peak "
               f"{fb(r.reserved_peak)}, allocated peak {fb(r.allocated_peak)}). Do: {fragmentation_advice()}")
        return self._event(EventKind.FRAGMENTATION, i, index, msg, b, n, measured_bytes=r.reserved_peak)

    def _caught_oom(self, i: int, index: int, r: CardReading, b: Optional[int], n: Optional[int]) -> MonitorEvent:
        msg = (f"{self._where(i, index, b, n)}: num_ooms rose from {self._ooms[i]} to {r.ooms}: an out-of-memory "
               "error was raised and caught since the last reading. Do: lower the batch, or plan again")
        return self._event(EventKind.OOM, i, index, msg, b, n, measured_bytes=r.reserved_peak)

    def _emit(self, event: MonitorEvent) -> None:
        self.events.append(event)
        if self._writer is not None:
            self._writer.event(event)
        line = self._limiter.allow(event)
        if line is not None:
            warnings.warn(line, MonitorWarning, stacklevel=4)

    # ---- out of memory ----------------------------------------------------------------------
    def record_oom(self, exc: BaseException, batch_size: Optional[int] = None, length: Optional[int] = None,
                   *, step: Optional[int] = None) -> Optional[MonitorEvent]:
        """Record the forensics of CUDA's out-of-memory error ``exc`` raised in a step (the
        step context does it; a callback may call it). Never raises: a failure here is warned
        and the user's error stays the one that is raised."""
        if not self.active:
            return None
        try:
            return self._record_oom(exc, batch_size, length, self.steps + 1 if step is None else step)
        except Exception as failure:  # noqa: BLE001 - the user's error must win
            warnings.warn(f"dptune.MemoryMonitor could not record the out-of-memory forensics "
                          f"({type(failure).__name__}: {failure}); the training's error follows",
                          MonitorWarning, stacklevel=3)
            return None

    def _record_oom(self, exc: BaseException, b: Optional[int], n: Optional[int], index: int) -> MonitorEvent:
        rt = self.runtime
        now: list[Optional[CardReading]] = []
        for card, total in zip(self.cards, self._totals):
            try:
                now.append(read_card(rt, card.card, total))
            except Exception:  # noqa: BLE001 - a card that cannot be read after the error
                now.append(None)
        hit = oom_card(exc, self._ids, self._ooms, [None if r is None else r.ooms for r in now])
        per_card = []
        for i, (card, r) in enumerate(zip(self.cards, now)):
            exp = self._expect(i, b, n)
            per_card.append(dict(card=card.card, rank=card.rank, uuid=card.uuid, slot=card.slot,
                                 predicted_peak_bytes=exp.predicted, budget_bytes=exp.budget, plan_where=exp.where,
                                 off_plan=exp.off_plan, last_reading=self.last[i],
                                 at_error=None if r is None else dict(r.torch_stats(), nvml_used_bytes=r.nvml_used,
                                                                       headroom_bytes=r.headroom)))
            if r is not None:
                self._ooms[i], self._retries[i] = r.ooms, r.retries
        details: dict[str, Any] = dict(step=index, card=hit, rank=self.rank, batch_size=b, length=n,
                                       error=f"{type(exc).__name__}: {str(exc)[:2000]}", level=self.level.value,
                                       cards=per_card)
        if self.snapshot and self._writer is not None:
            from dptune import _torch_private

            path = self._writer.path("oom", f"step{index}.pickle")
            self._writer.folder.mkdir(parents=True, exist_ok=True)
            if _torch_private.dump_memory_snapshot(os.fspath(path)):
                details["snapshot"] = path.name
        where = "" if self._writer is None else f"; forensics in {self._writer.forensics(details)}"
        i = self._ids.index(hit) if hit is not None else 0
        exp = self._expect(i, b, n)
        who = f"card {hit}" if hit is not None else "a card (which one CUDA did not say)"
        msg = (f"dptune monitor: step {index}, {shape_text(b, n)}: out of memory on {who}; the plan "
               f"predicted {fb(exp.predicted)} for {exp.where} within a budget of {fb(exp.budget)}"
               f"{' (' + exp.off_plan + ')' if exp.off_plan else ''}{where}. Do: lower the batch for "
               "this shape, or plan again with the run's shapes")
        event = MonitorEvent(kind=EventKind.OOM, step=index, card=hit, rank=self.rank, message=msg,
                             batch_size=b, length=n, predicted_bytes=exp.predicted,
                             budget_bytes=exp.budget, details=details)
        self._emit(event)
        return event

    # ---- figures and the end ---------------------------------------------------------------
    def run_peaks(self) -> list[dict[str, int]]:
        """Each card's peaks over the whole run (what torch's counters would say had the
        monitor never reset them), under torch's key names, with the card's index."""
        if not self.active:
            return []
        return [{"card": c.card, "allocated_bytes.all.peak": a, "reserved_bytes.all.peak": r}
                for c, a, r in zip(self.cards, self._run_alloc, self._run_reserved)]

    def figures(self, prefix: str = "memory") -> dict[str, int]:
        """The last reading of each card as flat figures for a logger (the Trainer's logs,
        Lightning's): ``memory/rank0/card1/reserved_bytes.all.peak`` and the like, in bytes."""
        out: dict[str, int] = {}
        for card, row in zip(self.cards, self.last if self.active else ()):
            if row is None:
                continue
            base = f"{prefix}/rank{card.rank}/card{card.card}/"
            for key in ("allocated_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries",
                        "headroom_bytes", "predicted_peak_bytes", "nvml_used_bytes"):
                if row.get(key) is not None:
                    out[base + key] = int(row[key])
        return out

    def close(self) -> None:
        """Write the run's end (the peaks over the run) and close the files; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.active or self._writer is None:
            return
        if self._limiter.silenced:
            warnings.warn(f"dptune monitor: {self._limiter.silenced} more event(s) were recorded "
                          f"without a warning; `dptune show {self.run_dir}` lists them all",
                          MonitorWarning, stacklevel=2)
        self._write_meta(final=True)
        self._writer.close()

    def __enter__(self) -> "MemoryMonitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
