"""Reading ``report.json`` back, checked: the report format's version, the objectives it
knows, and a typed read of every field that names the field and says what to do when it is
wrong (:class:`~dptune.errors.ReportError`, a usage error, exit 2, in one line).

This sits below the result type: :func:`result_fields` returns the checked keyword arguments
of :class:`dptune.result.model.TuneResult`, which :meth:`~dptune.result.model.TuneResult.from_dict` and
:func:`dptune.result.model.load_result` build the result from. :func:`read_json` is the one reader of
dptune's JSON files (DDP plans too).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence, cast

from dptune.errors import ReportError, UsageError
from dptune.result.figures import AllocatorAnswer, SplitFigures
from dptune.search.observations import Bracket
from dptune.solve.memory import Fit
from dptune.types import CardWindow, Device, MapCheck, Objective, ProbeResult, WindowCheck
from dptune.step.workload import StepSettings

__all__ = ["REPORT_VERSION", "OBJECTIVES", "read_json", "result_fields"]

REPORT_VERSION = 1

#: What a report's search optimised: every :class:`~dptune.types.Objective`.
OBJECTIVES = tuple(o.value for o in Objective)

_AGAIN = "re-run `dptune search` to write it again"


def read_json(path: "str | os.PathLike[str]", filename: str, what: str, command: str
              ) -> tuple[str, Any]:
    """Read ``filename`` in the folder ``path`` (or the file ``path``) as JSON.

    Returns the file's path and its data; every failure is one :class:`ReportError` line that
    names the file and says what to do (``command`` is the dptune command that writes it).
    """
    p = os.path.join(path, filename) if os.path.isdir(path) else os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            return p, json.load(f)
    except FileNotFoundError:
        raise ReportError(f"no {what} at {p!r}; give a folder written by `{command}` "
                          f"or its {filename}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{p!r} is not valid JSON ({e.msg} at line {e.lineno}, column "
                          f"{e.colno}); re-run `{command}` to write it again") from None
    except UnicodeDecodeError:
        raise ReportError(f"{p!r} is not a text file; give {filename} or its folder") from None
    except OSError as e:
        raise ReportError(f"cannot read the {what} {p!r}: {e.strerror or e}") from None


class _Checked:
    """Typed reads of one JSON object of a report, each raising :class:`ReportError` with the
    field's path (e.g. ``probes[2].peak_bytes``) and what was expected."""

    def __init__(self, d: Any, where: str = "") -> None:
        if not isinstance(d, dict):
            raise ReportError(f"{where or 'report.json'} holds {_kind(d)}, expected a JSON object; "
                              + _AGAIN)
        self.d = d
        self.where = where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, expected: str, value: Any) -> ReportError:
        return ReportError(f"{self.path(key)} is {_kind(value)}, expected {expected}; {_AGAIN}")

    def raw(self, key: str, optional: bool = False) -> Any:
        if key not in self.d:
            if optional:
                return None
            raise ReportError(f"{self.path(key)} is missing; {_AGAIN}")
        return self.d[key]

    def integer(self, key: str, *, optional: bool = False, minimum: Optional[int] = 0) -> Any:
        v = self.raw(key, optional)
        if v is None and optional:
            return None
        if not _is_int(v) or (minimum is not None and v < minimum):
            raise self.fail(key, "an integer" + ("" if minimum is None else f" >= {minimum}"), v)
        return int(v)

    def number(self, key: str, *, optional: bool = False, default: float = 0.0) -> float:
        v = self.raw(key, optional)
        if v is None and optional:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(key, "a number", v)
        return float(v)

    def text(self, key: str, *, optional: bool = False, default: str = "") -> str:
        v = self.raw(key, optional)
        if v is None and optional:
            return default
        if not isinstance(v, str):
            raise self.fail(key, "a string", v)
        return v

    def ints(self, key: str, n: Optional[int], *, optional: bool = False,
             nullable_items: bool = False) -> Any:
        v = self.raw(key, optional)
        if v is None and optional:
            return None
        what = "a list of integers >= 0" + (f" (one per card, {n})" if n is not None else "")
        if not isinstance(v, list):
            raise self.fail(key, what, v)
        for k, x in enumerate(v):   # the first bad entry, by its index
            if not ((x is None and nullable_items) or (_is_int(x) and x >= 0)):
                raise self.fail(f"{key}[{k}]", "an integer >= 0", x)
        if n is not None and len(v) != n:
            raise ReportError(f"{self.path(key)} has {len(v)} entries for {n} cards; {_AGAIN}")
        return [None if x is None else int(x) for x in v]

    def objects(self, key: str, n: Optional[int] = None, optional: bool = False) -> Any:
        v = self.raw(key, optional)
        if v is None and optional:
            return None
        if not isinstance(v, list):
            raise self.fail(key, "a list", v)
        if n is not None and len(v) != n:
            raise ReportError(f"{self.path(key)} has {len(v)} entries for {n} cards; {_AGAIN}")
        return [_Checked(x, f"{self.path(key)}[{k}]") for k, x in enumerate(v)]

    def strings(self, key: str) -> list[str]:
        v = self.raw(key, optional=True)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self.fail(key, "a list of strings", v)
        return list(v)

    def breakdowns(self, key: str, n: int) -> Optional[list[dict[str, int]]]:
        items = self.objects(key, n, optional=True)
        if items is None:
            return None
        out = []
        for c in items:
            for k, v in c.d.items():
                if not _is_int(v) or v < 0:
                    raise c.fail(k, "an integer >= 0 (bytes)", v)
            out.append({k: int(v) for k, v in c.d.items()})
        return out

    def card(self, key: str, n: int, optional: bool = True) -> Optional[int]:
        v = self.integer(key, optional=optional)
        if v is not None and v >= n:
            raise ReportError(f"{self.path(key)} is {v}, but there are only {n} cards; {_AGAIN}")
        return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, dict):
        return "a JSON object"
    if isinstance(v, list):
        return "a JSON array"
    if isinstance(v, str):
        return f"a string ({v[:40]!r})"
    return f"{type(v).__name__} {v!r}"


def _read_split(c: _Checked, n: int) -> SplitFigures:
    chunks = c.ints("chunk_sizes", n)
    if sum(chunks) == 0:
        raise ReportError(f"{c.path('chunk_sizes')} {chunks} gives no card a sample; {_AGAIN}")
    feasible = c.raw("feasible", optional=True)
    if feasible is not None and not isinstance(feasible, bool):
        raise c.fail("feasible", "true or false", feasible)
    imbalance_value = c.raw("imbalance", optional=True)
    if imbalance_value is not None and (isinstance(imbalance_value, bool)
                                        or not isinstance(imbalance_value, (int, float))):
        raise c.fail("imbalance", "a number", imbalance_value)
    bd = c.breakdowns("breakdown", n)
    _check_sum(c, chunks)
    return SplitFigures(chunk_sizes=tuple(chunks), peak_bytes=tuple(c.ints("peak_bytes", n)),
                        imbalance=float(imbalance_value) if imbalance_value is not None else math.inf,
                        feasible=True if feasible is None else feasible,
                        oom_device=c.card("oom_device", n),
                        breakdown=tuple(bd) if bd is not None else None,
                        implied_by=tuple(c.ints("implied_by", None, optional=True) or ()),
                        open_bracket=c.raw("open_bracket", optional=True) is True,
                        at_most=c.integer("at_most", optional=True),
                        on_model=c.raw("on_model", optional=True) is True)


def _check_sum(c: _Checked, chunks: Sequence[int]) -> None:
    batch = c.integer("batch_size", optional=True)
    if batch is not None and batch != sum(chunks):
        raise ReportError(f"{c.path('batch_size')} is {batch} but "
                          f"{c.path('chunk_sizes')} {list(chunks)} sum to {sum(chunks)}; {_AGAIN}")


def _read_probe(c: _Checked, n: int) -> ProbeResult:
    bd = c.breakdowns("breakdown", n)
    arrays = {k: c.ints(k, n, optional=True, nullable_items=k == "nvml_used_bytes")
              for k in ("reserved_bytes", "nvml_used_bytes", "alloc_retries", "repeat_spread_bytes",
                        "total_bytes", "expandable_reserved_bytes", "allocated_peak_bytes")}
    return ProbeResult(chunk_sizes=tuple(c.ints("chunk_sizes", n)),
                       peak_bytes=tuple(c.ints("peak_bytes", n)), oom_device=c.card("oom_device", n),
                       breakdown=tuple(bd) if bd is not None else None,
                       **cast("dict[str, Any]", {k: tuple(v) if v is not None else None
                                                 for k, v in arrays.items()}),
                       seconds=c.number("seconds", optional=True), purpose=c.text("purpose", optional=True),
                       note=c.text("note", optional=True), unread_outputs=_read_unread(c),
                       memory_stats=_read_memory_stats(c, n), time=_read_time(c))


def _read_memory_stats(c: _Checked, n: int) -> Optional[tuple[dict[str, int], ...]]:
    """Per card, the allocator model's figures under torch.cuda.memory_stats()'s key names."""
    raw = c.raw("memory_stats", optional=True)
    if raw is None:
        return None
    if not (isinstance(raw, list) and len(raw) == n and all(
            isinstance(d, dict) and all(isinstance(k, str) and _is_int(v) for k, v in d.items())
            for d in raw)):
        raise c.fail("memory_stats", f"a list of {n} objects of byte counts", raw)
    return tuple({str(k): int(v) for k, v in d.items()} for d in raw)


def _read_time(c: _Checked) -> Any:
    """A probe's step time (dptune.types.StepTime), ``None`` where the report has none."""
    from dptune.types import StepTime

    raw = c.raw("time", optional=True)
    if raw is None:
        return None
    try:
        return StepTime.from_dict(raw)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise c.fail("time", "a step time (card_seconds, step_seconds, source)", raw) from None


def _read_unread(c: _Checked) -> Optional[tuple[tuple[str, int], ...]]:
    raw = c.raw("unread_outputs", optional=True)
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _is_int(x[1]) and x[1] >= 0
            for x in raw):
        raise c.fail("unread_outputs", "a list of [output entry, bytes] pairs", raw)
    return tuple((str(e), int(b)) for e, b in raw)


def _read_device(c: _Checked) -> Device:
    uuid = c.raw("uuid", optional=True)
    if uuid is not None and not isinstance(uuid, str):
        raise c.fail("uuid", "a string or null", uuid)
    return Device(index=c.integer("index"), name=c.text("name"), total_bytes=c.integer("total_bytes"),
                  used_bytes=c.integer("used_bytes", optional=True) or 0,
                  context_bytes=c.integer("context_bytes", optional=True) or 0, uuid=uuid)


def _read_fit(c: _Checked) -> Fit:
    zero = c.raw("zero_bytes", optional=True)
    return Fit(intercept_bytes=c.number("intercept_bytes"), slope_bytes=c.number("slope_bytes"),
               batch_slope_bytes=c.number("batch_slope_bytes", optional=True),
               max_error_bytes=c.number("max_error_bytes", optional=True),
               points=c.integer("points", optional=True) or 0,
               zero_bytes=None if zero is None else c.number("zero_bytes"))


def _read_flag(c: _Checked, key: str) -> bool:
    v = c.raw(key, optional=True)
    if v is not None and not isinstance(v, bool):
        raise c.fail(key, "true or false", v)
    return bool(v)


def _check_implied(even: SplitFigures, probes: int) -> None:
    """The probes an even split rests on (numbered from 1) must be in the report."""
    bad = [k for k in even.implied_by if not 1 <= k <= probes]
    if bad:
        have = f"#1..#{probes}" if probes else "none"
        raise ReportError(f"even.implied_by names probe #{bad[0]}, but the report has {probes} "
                          f"probe(s) ({have}); {_AGAIN}")


def _read_allocator_answer(c: _Checked, n: int) -> Optional[AllocatorAnswer]:
    """None recorded (the first answer was certified, or the search not run), or one."""
    raw = c.raw("allocator_answer", optional=True)
    if raw is None:
        return None
    a = _Checked(raw, "allocator_answer")
    chunks = a.ints("chunk_sizes", n)
    _check_sum(a, chunks)
    return AllocatorAnswer(setting=a.text("setting"), chunk_sizes=tuple(chunks),
                           peak_bytes=tuple(a.ints("peak_bytes", n)),
                           certified=_read_flag(a, "certified"), probes=a.integer("probes"))


def _read_looked_past(c: _Checked, n: int) -> Optional[WindowCheck]:
    """None recorded (no look past the over points), or the windows looked at."""
    if c.raw("looked_past", optional=True) is None:
        return None
    w = _Checked(c.raw("looked_past"), "looked_past")
    cards = []
    for x in w.objects("cards"):
        card = x.integer("card")
        if card >= n:
            raise x.fail("card", f"a card of the report (0..{n - 1})", card)
        scaled = x.raw("scaled")
        if not isinstance(scaled, bool):
            raise x.fail("scaled", "true or false", scaled)
        cards.append(CardWindow(card=card, start=x.integer("start"),
                                end=x.integer("end", optional=True),
                                fits=x.integer("fits", optional=True),
                                fits_bytes=x.integer("fits_bytes", optional=True), scaled=scaled,
                                batch_start=x.integer("batch_start", optional=True),
                                no_samples=_read_flag(x, "no_samples"),
                                last_fits=x.integer("last_fits", optional=True)))
    return WindowCheck(tuple(cards), w.integer("replays"))


def _read_balance_map(c: _Checked, n: int) -> Optional[MapCheck]:
    """None recorded (no map), or what solving the balance on it found."""
    if c.raw("balance_map", optional=True) is None:
        return None
    m = _Checked(c.raw("balance_map"), "balance_map")
    ranges = m.raw("ranges")
    if not isinstance(ranges, list) or len(ranges) != n or not all(
            isinstance(r, list) and len(r) == 2 and all(type(x) is int and x >= 0 for x in r)
            and r[0] <= r[1] for r in ranges):
        raise m.fail("ranges", f"{n} pairs [lo, hi] of chunks, lo <= hi", ranges)
    return MapCheck(bound=m.number("bound"), least=m.number("least"), level=m.number("level"),
                    ranges=tuple((r[0], r[1]) for r in ranges), replays=m.integer("replays"))


def _read_brackets(c: _Checked, n: int) -> list[Bracket]:
    """None recorded, or one per card."""
    items = c.objects("brackets", n if c.raw("brackets", optional=True) else None, optional=True)
    return [_read_bracket(x, n) for x in items or []]


def _read_bracket(c: _Checked, n: int) -> Bracket:
    what = c.text("what", optional=True, default="chunk")
    if what not in ("chunk", "batch"):
        raise ReportError(f"{c.path('what')} is {what!r}, expected 'chunk' or 'batch'; {_AGAIN}")
    card = c.card("card", n, optional=False)
    assert card is not None
    return Bracket(card=card, lo=c.integer("lo"), hi=c.integer("hi", optional=True),
                   what=what, min_chunk=c.integer("min_chunk", optional=True, minimum=1) or 1)


def result_fields(d: Any) -> dict[str, Any]:
    """The keyword arguments of :class:`dptune.result.model.TuneResult` read from ``d`` (the
    form of ``TuneResult.to_dict``), every field checked."""
    c = _Checked(d)
    version = c.raw("version", optional=True)
    if version != REPORT_VERSION:
        raise ReportError(f"report version {version!r} is not supported (this dptune reads "
                          f"version {REPORT_VERSION}); {_AGAIN}")
    objective = c.text("objective")
    if objective not in OBJECTIVES:
        raise ReportError(f"objective is {objective!r}, expected one of "
                          f"{', '.join(OBJECTIVES)}; {_AGAIN}")
    devices = [_read_device(x) for x in c.objects("devices")]
    n = len(devices)
    if n == 0:
        raise ReportError(f"devices is empty: the report names no card; {_AGAIN}")
    chunks = c.ints("chunk_sizes", n)
    if sum(chunks) == 0:
        raise ReportError(f"chunk_sizes {chunks} gives no card a sample; {_AGAIN}")
    _check_sum(c, chunks)
    gpu0 = c.integer("gpu0_bsz", optional=True)
    if gpu0 is not None and gpu0 != chunks[0]:
        raise ReportError(f"gpu0_bsz is {gpu0} but chunk_sizes {chunks} gives card 0 "
                          f"{chunks[0]}; {_AGAIN}")
    requested = c.integer("requested_batch_size", optional=True, minimum=1)
    even = _read_split(_Checked(c.raw("even"), "even"), n)
    probes = [_read_probe(x, n) for x in c.objects("probes")]
    _check_implied(even, len(probes))
    return dict(
        objective=objective, backend=c.text("backend"), cluster=c.text("cluster"),
        model_name=c.text("model_name"), devices=devices,
        headroom_bytes=c.integer("headroom_bytes"),
        budget_bytes=c.ints("budget_bytes", n), chunk_sizes=chunks,
        peak_bytes=c.ints("peak_bytes", n), even=even, probes=probes,
        fits=[_read_fit(x) for x in c.objects("fits", n)], breakdown=c.breakdowns("breakdown", n),
        requested_batch_size=requested, seconds=c.number("seconds", optional=True),
        advice=c.strings("advice"), notes=c.strings("notes"), settings=_read_settings(c),
        certified=_read_flag(c, "certified"),
        brackets=_read_brackets(c, n),
        output_device=c.card("output_device", n) or 0,
        card0_output_batch_size=c.integer("card0_output_batch_size", optional=True),
        allocator_answer=_read_allocator_answer(c, n),
        looked_past=_read_looked_past(c, n),
        balance_map=_read_balance_map(c, n),
    )


def _read_settings(c: _Checked) -> StepSettings:
    raw = c.raw("settings", optional=True)
    if raw is None:       # a report written before the step's settings were recorded
        return StepSettings()
    if not isinstance(raw, dict):
        raise c.fail("settings", "a JSON object", raw)
    try:
        return StepSettings.from_dict(raw)
    except (UsageError, TypeError, ValueError) as e:
        raise ReportError(f"settings: {e}; {_AGAIN}") from None
