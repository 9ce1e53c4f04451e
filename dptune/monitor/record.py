"""A monitored run's folder: what each rank wrote, and reading it back merged.

Each process (each DDP/FSDP rank; a single process is rank 0) writes its own files, so no
rank waits for another and no collective runs on the training's hot path:

- ``monitor.rank{R}.json``: the run's settings (level, margin, interval, whether peaks are
  per reading or since the start), the cards (torch index, UUID, name, capacity, slot in the
  plan), the plan and its per-card budgets; at the end each card's peaks over the whole run;
- ``timeline.rank{R}.jsonl``: one row per reading of a card: ``rank``, ``card``, ``step``,
  ``seconds`` (since the monitor started), ``batch_size``, ``length``, torch's statistics
  under their own names (``allocated_bytes.all.peak``, ``reserved_bytes.all.peak``,
  ``allocated_bytes.all.current``, ``reserved_bytes.all.current``, ``num_alloc_retries``,
  ``num_ooms``), ``nvml_used_bytes`` (the whole card, every process; ``null`` without
  NVML), ``total_bytes``, ``headroom_bytes``, ``predicted_peak_bytes`` and ``budget_bytes``
  (the plan's, ``null`` without one); every figure an integer number of bytes;
- ``events.rank{R}.jsonl``: one :class:`~dptune.monitor.events.MonitorEvent` a line;
- ``oom.rank{R}.json``: the last out-of-memory forensics of that rank (and, when asked, the
  allocator's snapshot ``oom.rank{R}.step{S}.pickle``, for https://pytorch.org/memory_viz).

:func:`load_run` reads every rank's files into one :class:`RunRecord` (``dptune show RUN``).
"""

from __future__ import annotations

import json
import os
import pathlib
import time
from dataclasses import dataclass
from typing import IO, Any, Mapping, Optional, Sequence

from dptune.errors import ReportError
from dptune.monitor.events import MonitorEvent

__all__ = ["RUN_KIND", "RUN_VERSION", "RunWriter", "RunRecord", "CardInfo", "load_run", "is_run"]

RUN_KIND = "dptune-monitor-run"
RUN_VERSION = 1
_FLUSH_SECONDS = 2.0


@dataclass(frozen=True)
class CardInfo:
    """One card a rank watched: torch's index, its slot in the plan, its capacity (bytes)."""

    rank: int
    card: int
    slot: int
    name: str
    total_bytes: int
    uuid: Optional[str] = None
    budget_bytes: Optional[int] = None

    @property
    def label(self) -> str:
        return f"rank {self.rank} card {self.card}"

    def to_dict(self) -> dict[str, Any]:
        return dict(rank=self.rank, card=self.card, slot=self.slot, name=self.name,
                    total_bytes=self.total_bytes, uuid=self.uuid, budget_bytes=self.budget_bytes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CardInfo":
        return cls(rank=int(d["rank"]), card=int(d["card"]), slot=int(d["slot"]), name=str(d["name"]),
                   total_bytes=int(d["total_bytes"]), uuid=d.get("uuid"),
                   budget_bytes=None if d.get("budget_bytes") is None else int(d["budget_bytes"]))


def _name(kind: str, rank: int, ext: str) -> str:
    return f"{kind}.rank{rank}.{ext}"


class RunWriter:
    """One rank's files in the run folder (created on first use); rows are buffered and
    flushed every couple of seconds, at each event and at :meth:`close`."""

    def __init__(self, folder: "str | os.PathLike[str]", rank: int) -> None:
        self.folder = pathlib.Path(folder)
        self.rank = rank
        self._timeline: Optional[IO[str]] = None
        self._events: Optional[IO[str]] = None
        self._flushed = time.monotonic()

    def path(self, kind: str, ext: str) -> pathlib.Path:
        return self.folder / _name(kind, self.rank, ext)

    def _open(self, kind: str) -> IO[str]:
        self.folder.mkdir(parents=True, exist_ok=True)
        return open(self.path(kind, "jsonl"), "w", encoding="utf-8")

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.path("monitor", "json")
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(meta), indent=2), encoding="utf-8")
        os.replace(tmp, target)

    def rows(self, rows: Sequence[Mapping[str, Any]]) -> None:
        if self._timeline is None:
            self._timeline = self._open("timeline")
        self._timeline.write("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
        now = time.monotonic()
        if now - self._flushed > _FLUSH_SECONDS:
            self._timeline.flush()
            self._flushed = now

    def event(self, event: MonitorEvent) -> None:
        if self._events is None:
            self._events = self._open("events")
        self._events.write(json.dumps(event.to_dict(), separators=(",", ":")) + "\n")
        self._events.flush()
        if self._timeline is not None:
            self._timeline.flush()

    def forensics(self, details: Mapping[str, Any]) -> pathlib.Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path("oom", "json")
        path.write_text(json.dumps(dict(details), indent=2), encoding="utf-8")
        return path

    def close(self) -> None:
        for f in (self._timeline, self._events):
            if f is not None:
                f.close()
        self._timeline = self._events = None


@dataclass(frozen=True)
class RunRecord:
    """Every rank's files of a run, merged: settings per rank, cards, rows, events."""

    folder: str
    metas: tuple[Mapping[str, Any], ...]
    cards: tuple[CardInfo, ...]
    rows: tuple[Mapping[str, Any], ...]
    events: tuple[MonitorEvent, ...]
    ooms: tuple[Mapping[str, Any], ...] = ()

    @property
    def ranks(self) -> list[int]:
        return sorted({int(m["rank"]) for m in self.metas})

    @property
    def level(self) -> str:
        return str(self.metas[0].get("level", "reserved")) if self.metas else "reserved"

    def card_rows(self, card: CardInfo) -> list[Mapping[str, Any]]:
        return [r for r in self.rows if r["rank"] == card.rank and r["card"] == card.card]

    def card_events(self, card: CardInfo) -> list[MonitorEvent]:
        return [e for e in self.events if e.rank == card.rank and e.card == card.card]


def is_run(path: "str | os.PathLike[str]") -> bool:
    """Whether ``path`` is a monitored run's folder (or one of its files)."""
    p = pathlib.Path(path)
    folder = p if p.is_dir() else p.parent
    return any(folder.glob("monitor.rank*.json"))


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file; a torn last line (the process was killed while writing) is
    left out, any other bad line is a :class:`ReportError`."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                break
            raise ReportError(f"{path}: line {i + 1} is not JSON ({e}); the run's record is "
                              "damaged") from None
    return out


def _rank_of(path: pathlib.Path) -> int:
    return int(path.name.split(".rank", 1)[1].split(".", 1)[0])


def load_run(path: "str | os.PathLike[str]") -> RunRecord:
    """Read a monitored run's folder, every rank's files merged (:class:`ReportError` in one
    line when it is not one, or a file is damaged)."""
    p = pathlib.Path(path)
    folder = p if p.is_dir() else p.parent
    metas_files = sorted(folder.glob("monitor.rank*.json"), key=_rank_of)
    if not metas_files:
        raise ReportError(f"{os.fspath(path)!r} is not a monitored run's folder (no "
                          "monitor.rank*.json); write one with dptune.MemoryMonitor(run_dir=...)")
    metas: list[dict[str, Any]] = []
    cards: list[CardInfo] = []
    rows: list[dict[str, Any]] = []
    events: list[MonitorEvent] = []
    ooms: list[dict[str, Any]] = []
    for mf in metas_files:
        try:
            meta = json.loads(mf.read_text(encoding="utf-8"))
            if meta.get("kind") != RUN_KIND:
                raise ReportError(f"{mf}: not a dptune monitor file (kind {meta.get('kind')!r})")
            cards.extend(CardInfo.from_dict(c) for c in meta["cards"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise ReportError(f"{mf}: not a valid monitor file ({type(e).__name__}: {e})") from None
        metas.append(meta)
        rank = int(meta["rank"])
        rows.extend(_jsonl(folder / _name("timeline", rank, "jsonl")))
        try:
            events.extend(MonitorEvent.from_dict(e) for e in _jsonl(folder / _name("events", rank, "jsonl")))
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"{folder / _name('events', rank, 'jsonl')}: a bad event ({e})") from None
        oom = folder / _name("oom", rank, "json")
        if oom.is_file():
            ooms.append(json.loads(oom.read_text(encoding="utf-8")))
    rows.sort(key=lambda r: (r["rank"], r["card"], r["step"]))
    events.sort(key=lambda e: (e.step, e.rank, -1 if e.card is None else e.card))
    return RunRecord(folder=os.fspath(folder), metas=tuple(metas),
                     cards=tuple(sorted(cards, key=lambda c: (c.rank, c.card))), rows=tuple(rows),
                     events=tuple(events), ooms=tuple(ooms))
