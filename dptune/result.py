"""The tuner's result: what was probed, what was fitted, the chosen split, and the even split.

A :class:`TuneResult` holds everything needed to rebuild a report; ``to_dict``/``from_dict``
round-trip it through ``report.json`` (``REPORT_VERSION``). Memory figures are ``int`` bytes.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
import warnings
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence, cast

from dptune.backends.base import Device, ProbeResult
from dptune.errors import ReportError, UsageError
from dptune.search.observations import Bracket
from dptune.solver import Fit
from dptune.workload import StepSettings

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from dptune.parallel import BalancedDataParallel

__all__ = ["Fit", "Bracket", "SplitFigures", "TuneResult", "REPORT_VERSION", "OBJECTIVES", "shares",
           "imbalance", "load_result", "BudgetCheck", "budget_check", "wrap_model", "NOT_GIVEN"]

REPORT_VERSION = 1

#: "not given" for :func:`wrap_model`'s step settings (``None`` is a value some of them take)
NOT_GIVEN: Any = type("_NotGiven", (), {"__repr__": lambda self: "NOT_GIVEN"})()


#: What a search optimises: the same batch with memory evened out, or the largest batch.
OBJECTIVES = ("balance", "max_batch")


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
                                                           probe.chunk_sizes)) if i == 0 or c > 0]
    margin, card = min(margins)
    return BudgetCheck(margin >= 0, margin, card)


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
                    open_bracket=self.open_bracket, at_most=self.at_most)


@dataclass
class TuneResult:
    """What :meth:`dptune.Tuner.fit` returns.

    - ``chunk_sizes``: the chosen split, one int per card; ``batch_size`` is their sum and
      ``gpu0_bsz`` the first (for users of the old ``BalancedDataParallel``).
    - ``peak_bytes``/``breakdown``: from the probe that verified the split.
    - ``budget_bytes``: per card, card memory - memory taken by others - headroom.
    - ``even``: the plain even split at the same batch (for ``max_batch``: at the largest
      batch the even split fits).
    - ``probes``: every probe run, in order; ``fits``: one :class:`Fit` per card.
    - ``certified``: the answer is proven: for ``max_batch`` one more sample was measured not
      to fit (every bracket closed); for ``balance`` no split can lower the largest share.
      ``brackets``: per card ``[lo, hi)``, ``lo`` measured within budget, ``hi`` over.
    - ``output_device``: the card DataParallel gathers the outputs on (0 unless another card
      raised the largest batch; ``card0_output_batch_size`` is then the batch with card 0).
    - ``settings``: the training step the split was tuned for (mixed precision,
      accumulation, clipping, the user's step function); a split is only valid for it.
    - ``model``: the user's model wrapped in a ``BalancedDataParallel`` with this split
      (``None`` after ``load``).
    """

    objective: str
    backend: str                          # "simulated" or "cuda"
    cluster: str                          # human description of the cards
    model_name: str
    devices: list[Device]
    headroom_bytes: int
    budget_bytes: list[int]
    chunk_sizes: list[int]
    peak_bytes: list[int]
    even: SplitFigures
    probes: list[ProbeResult]
    fits: list[Fit]
    breakdown: Optional[list[dict[str, int]]] = None
    requested_batch_size: Optional[int] = None
    seconds: float = 0.0
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    certified: bool = False
    brackets: list[Bracket] = field(default_factory=list)
    output_device: int = 0
    card0_output_batch_size: Optional[int] = None
    settings: StepSettings = field(default_factory=StepSettings)
    model: Optional["torch.nn.Module"] = field(default=None, repr=False, compare=False)
    #: the report file this result was read from (set by :func:`load_result`)
    source: Optional[str] = field(default=None, repr=False, compare=False)

    # ---- derived figures -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def gpu0_bsz(self) -> int:
        return self.chunk_sizes[0]

    @property
    def shares(self) -> list[float]:
        return shares(self.peak_bytes, self.budget_bytes)

    @property
    def imbalance(self) -> float:
        return imbalance(self.peak_bytes, self.budget_bytes, self.chunk_sizes)

    @property
    def card0_floor(self) -> bool:
        """Card 0 holds no samples and still the largest share: a floor no split can beat."""
        s = self.shares
        return self.chunk_sizes[0] == 0 and len(s) > 1 and s[0] >= max(s[1:])

    @property
    def output_device_gain(self) -> int:
        """Samples the chosen ``output_device`` adds to the largest batch over gathering on
        card 0 (0 when card 0 was kept or the comparison was not run)."""
        if self.card0_output_batch_size is None:
            return 0
        return self.batch_size - self.card0_output_batch_size

    @property
    def num_probes(self) -> int:
        return len(self.probes)

    @property
    def batch_gain(self) -> float:
        """Relative gain in batch size over the even split (0.25 means +25%); over the lower
        end of the even split's bracket when it is open (``even.open_bracket``), so the most
        the probes allow."""
        return self.batch_size / self.even.batch_size - 1.0 if self.even.batch_size else float("inf")

    def budget_check(self, probe: ProbeResult) -> "BudgetCheck":
        """What the search read from ``probe``: within every budget or not, and by how much."""
        return budget_check(probe, self.budget_bytes)

    def __str__(self) -> str:
        """One line; the per-card table is :func:`dptune.report.render_table`."""
        state = "certified" if self.certified else "not certified"
        return (f"TuneResult({self.model_name} on {self.cluster}: split {list(self.chunk_sizes)}, "
                f"batch {self.batch_size}, {self.objective}, {state}; "
                "dptune.report.render_table(result) prints the table)")

    # ---- using the split ---------------------------------------------------------------
    def wrap(self, model: "torch.nn.Module", device_ids: Optional[Sequence[Any]] = None, *,
             amp: Any = NOT_GIVEN, accumulate: Any = NOT_GIVEN, clip_grad_norm: Any = NOT_GIVEN,
             step: Any = NOT_GIVEN) -> "BalancedDataParallel":
        """``model`` in a :class:`~dptune.parallel.BalancedDataParallel` with this split.

        ``load_result("reports/mynet").wrap(net)`` reuses a saved split without probing again.
        See :func:`wrap_model` for the devices, the move onto the first card and the checks
        of ``amp``, ``accumulate``, ``clip_grad_norm`` and ``step``.
        """
        return wrap_model(self, model, device_ids, amp=amp, accumulate=accumulate,
                          clip_grad_norm=clip_grad_norm, step=step)

    # ---- serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dict(
            version=REPORT_VERSION, objective=self.objective, backend=self.backend,
            cluster=self.cluster, model_name=self.model_name,
            devices=[d.to_dict() for d in self.devices], headroom_bytes=self.headroom_bytes,
            budget_bytes=list(self.budget_bytes), chunk_sizes=list(self.chunk_sizes),
            batch_size=self.batch_size, gpu0_bsz=self.gpu0_bsz,
            peak_bytes=list(self.peak_bytes), imbalance=self.imbalance,
            breakdown=self.breakdown, even=self.even.to_dict(),
            probes=[p.to_dict() for p in self.probes], fits=[f.to_dict() for f in self.fits],
            requested_batch_size=self.requested_batch_size, seconds=self.seconds,
            advice=list(self.advice), notes=list(self.notes), settings=self.settings.to_dict(),
            certified=self.certified,
            brackets=[b.to_dict() for b in self.brackets], output_device=self.output_device,
            card0_output_batch_size=self.card0_output_batch_size,
        )

    @classmethod
    def from_dict(cls, d: Any) -> "TuneResult":
        """Rebuild a result from :meth:`to_dict`'s form, checking every field.

        A missing key, a value of the wrong type, per-card lists whose length is not the
        number of cards, a negative chunk or peak, or a ``batch_size`` that is not the sum of
        the chunks raises :class:`~dptune.errors.ReportError` naming the field.
        """
        return _read_result(d)

    @classmethod
    def load(cls, path: str) -> "TuneResult":
        """Read and check a result from ``report.json`` or from the report folder that holds it.

        The one reader of report files (``dptune show``, ``dptune plot`` and
        :meth:`wrap` after ``load_result`` all come here). Any problem with the file raises
        :class:`~dptune.errors.ReportError` (a usage error, exit 2) in one line.
        """
        return load_result(path)


# ---- reading report.json back, checked -------------------------------------------------

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


def load_result(path: "str | os.PathLike[str]") -> TuneResult:
    """:meth:`TuneResult.load`: read ``report.json`` (or the folder holding it) and check it."""
    p, data = read_json(path, "report.json", "report", "dptune search")
    try:
        return replace(_read_result(data), source=p)
    except ReportError as e:
        raise ReportError(f"the report {p!r} is not valid: {e}") from None


# ---- wrapping a model with a result's split ----------------------------------------------

def wrap_model(result: TuneResult, model: "torch.nn.Module",
               device_ids: Optional[Sequence[Any]] = None, *, amp: Any = NOT_GIVEN,
               accumulate: Any = NOT_GIVEN, clip_grad_norm: Any = NOT_GIVEN,
               step: Any = NOT_GIVEN) -> "BalancedDataParallel":
    """``model`` in a ``BalancedDataParallel`` with ``result``'s split (:meth:`TuneResult.wrap`).

    ``device_ids`` defaults to the first ``len(chunk_sizes)`` visible CUDA devices; the model
    is moved to the first of them (where DataParallel needs its parameters) and the outputs
    are gathered on the result's ``output_device``. On a machine without CUDA (and no
    ``device_ids``) the model stays where it is and the wrapper is a plain pass-through, with
    the constructor's warning that the split is not used, so the same line runs on a laptop.

    ``amp``, ``accumulate``, ``clip_grad_norm`` and ``step`` (a function or its
    ``"module:qualname"``) describe the training step this model will run, as for ``Tuner``;
    each one given is compared with the step the result was tuned for, as is the model's own
    gradient checkpointing flag, and a :class:`~dptune.errors.DptuneWarning` lists any
    difference: the split's memory was measured for the other step.
    """
    import torch

    from dptune.parallel import BalancedDataParallel

    where = f"the report at {result.source!r}" if result.source else "the result"
    _warn_settings(result.settings, model, where, amp=amp, accumulate=accumulate,
                   clip_grad_norm=clip_grad_norm, step=step)
    sizes = list(result.chunk_sizes)
    n = len(sizes)
    if device_ids is None and not torch.cuda.is_available():
        return BalancedDataParallel(model, chunk_sizes=sizes)
    if device_ids is None:
        visible = torch.cuda.device_count()
        if visible < n:
            raise UsageError(
                f"{where} was tuned for {n} cards ({result.cluster}) but {visible} CUDA "
                f"device(s) are visible; run on a machine with {n} cards, check "
                "CUDA_VISIBLE_DEVICES, or re-run `dptune search` for these cards")
        device_ids = list(range(n))
    elif len(device_ids) != n:
        raise UsageError(
            f"{where} has a split for {n} cards {sizes} but device_ids={list(device_ids)} "
            f"names {len(device_ids)}; give {n} device ids")
    ids = list(device_ids)
    first = torch.device("cuda", ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
    if torch.cuda.is_available():   # without CUDA, DataParallel itself is a pass-through
        model = model.to(first)
    return BalancedDataParallel(model, device_ids=ids,
                                output_device=ids[result.output_device], chunk_sizes=sizes)


def _warn_settings(tuned: StepSettings, model: "torch.nn.Module", where: str, **given: Any) -> None:
    """One :class:`DptuneWarning` listing how the step described by ``given`` (those given)
    and the model's gradient checkpointing differ from the result's ``tuned`` settings."""
    from dptune.errors import DptuneWarning
    from dptune.workload import function_name, gradient_checkpointing

    if given.get("step") is not NOT_GIVEN and callable(given.get("step")):
        given["step"] = function_name(given["step"])
    if given.get("clip_grad_norm") not in (NOT_GIVEN, None):
        given["clip_grad_norm"] = float(given["clip_grad_norm"])
    given = {k: v for k, v in given.items() if v is not NOT_GIVEN}
    given.setdefault("gradient_checkpointing", gradient_checkpointing(model))
    mine = StepSettings.from_dict({**tuned.to_dict(), **given})
    diffs = [f"{k}={getattr(tuned, k)!r} in the report, {getattr(mine, k)!r} here"
             for k in given if getattr(tuned, k) != getattr(mine, k)]
    if diffs:
        warnings.warn(
            f"the split in {where} was tuned for another training step ({tuned.describe()}; "
            f"now {mine.describe()}): {'; '.join(diffs)}. Its memory was measured for that step, "
            "so it may run out of memory or leave memory unused: re-run `dptune search` with "
            "these settings", DptuneWarning, stacklevel=4)


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
                        at_most=c.integer("at_most", optional=True))


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
    """A probe's step time (dptune.timing.StepTime), ``None`` where the report has none."""
    from dptune.timing import StepTime

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


def _read_result(d: Any) -> TuneResult:
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
    return TuneResult(
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
