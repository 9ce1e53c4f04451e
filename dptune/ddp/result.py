"""The per-rank plan for ``DistributedDataParallel``: batch sizes, loss scales, figures.

A :class:`DDPPlan` is a value: one :class:`RankPlan` per rank (its batch, its loss scale, its
card and the memory figures that justify the batch), how it was made, and the DDP and step
settings it holds for. It is saved as JSON (``plan.json``, with a ``summary.md`` beside it
when saved into a folder), loaded back with :meth:`DDPPlan.load`, and printed by
``dptune show``.

**The gradient.** DDP averages the gradients of the ranks with equal weights:
``g = (1/W) Σ_r g_r``. If rank r's loss is the mean over its ``b_r`` samples,
``g_r = (1/b_r) Σ_{i∈r} ∇ℓ_i``, and with unequal ``b_r`` that average weighs the samples
of a small rank more. :meth:`DDPPlan.scale_loss` multiplies rank r's loss by
``s_r = W·b_r/B`` (``B = Σ b_r``): then ``(1/W) Σ_r s_r g_r = (1/B) Σ_i ∇ℓ_i``, the mean
over the whole global batch, exactly what one process would compute on all ``B`` samples.
With equal batches every ``s_r`` is 1. On a step whose batches are not the planned ones (the
end of an epoch, see :mod:`dptune.ddp.sampler`) the same holds with that step's sizes
``b'_r`` and ``B'``: ``scale_loss(loss, batch_size=len(batch))`` sums them over the ranks.

**Accumulation.** A plan with ``micro_batches = k > 1`` trains a global batch of ``k·B``
samples per optimizer step as ``k`` micro-batches of the planned sizes (the sampler's
consecutive steps): ``scale_loss`` then also divides by ``k``, so the gradients accumulated
over the ``k`` micro-batches are the mean over all ``k·B`` samples (exact when the ``k``
micro-batches are full; the optimizer steps once every ``k`` batches).
"""

from __future__ import annotations

import json
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from dptune.backends.base import Device
from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.errors import OutputError, ReportError, UsageError
from dptune.result.model import read_json
from dptune.search.ranks import RankProbe
from dptune.types import Objective, _StrEnum
from dptune.solve.memory import Fit
from dptune.units import format_bytes

__all__ = ["RankPlan", "RankProbe", "RankReason", "DDPPlan", "PLAN_KIND", "PLAN_VERSION",
           "is_plan_path"]

PLAN_KIND = "dptune-ddp-plan"
#: how the planner's first note names an FSDP2 plan's sharding
_FSDP_NOTE = "strategy fsdp:"
PLAN_VERSION = 1


class RankReason(_StrEnum):
    """Why a rank got its batch (the plan's ``reason`` per rank, its "why" column)."""

    MEMORY_CAP = "memory cap"              # the largest batch that fits its budget
    MEMORY_BALANCE = "memory balance"      # the same share of its budget as the other ranks
    STEP_TIME = "sets the step time"       # the slowest rank: the step waits for it
    TIME_BALANCE = "time balance"          # one more sample would make it the slowest
    REST = "rest of the batch"             # what the others leave (the slowest is at its least)
    EQUAL = "equal share"                  # ranks taken as equally fast: batches as equal as fits


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of the plan.

    ``device`` is the card the rank probed (its UUID, when known, identifies it across
    restarts); ``budget_bytes`` its memory minus others' use minus the headroom;
    ``predicted_peak_bytes`` the fit's figure at ``batch_size`` and ``measured_peak_bytes``
    what the verifying step measured (on real cards: the single-card step's
    ``max_memory_allocated`` plus the counted DDP buckets). Figures are ``None`` on a plan
    made by hand."""

    rank: int
    batch_size: int
    loss_scale: float
    device: Optional[Device] = None
    host: Optional[str] = None
    budget_bytes: Optional[int] = None
    predicted_peak_bytes: Optional[int] = None
    measured_peak_bytes: Optional[int] = None
    ddp_bytes: Optional[int] = None         # the Reducer's buckets on this rank
    fit: Optional[Fit] = None
    max_batch_size: Optional[int] = None    # largest batch measured to fit (max_batch plans)
    reason: Optional[RankReason] = None     # why this rank got its batch (planned ranks)

    @property
    def share(self) -> Optional[float]:
        """Measured (else predicted) peak over budget."""
        peak = self.measured_peak_bytes if self.measured_peak_bytes is not None else self.predicted_peak_bytes
        if peak is None or not self.budget_bytes:
            return None
        return peak / self.budget_bytes

    def to_dict(self) -> dict[str, Any]:
        return dict(rank=self.rank, batch_size=self.batch_size, loss_scale=self.loss_scale,
                    device=None if self.device is None else self.device.to_dict(), host=self.host,
                    budget_bytes=self.budget_bytes, predicted_peak_bytes=self.predicted_peak_bytes,
                    measured_peak_bytes=self.measured_peak_bytes, ddp_bytes=self.ddp_bytes,
                    fit=None if self.fit is None else self.fit.to_dict(),
                    max_batch_size=self.max_batch_size,
                    reason=None if self.reason is None else self.reason.value)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RankPlan":
        def opt_int(k: str) -> Optional[int]:
            return None if d.get(k) is None else int(d[k])

        return cls(rank=int(d["rank"]), batch_size=int(d["batch_size"]),
                   loss_scale=float(d["loss_scale"]),
                   device=None if d.get("device") is None else Device.from_dict(d["device"]),
                   host=d.get("host"), budget_bytes=opt_int("budget_bytes"),
                   predicted_peak_bytes=opt_int("predicted_peak_bytes"),
                   measured_peak_bytes=opt_int("measured_peak_bytes"), ddp_bytes=opt_int("ddp_bytes"),
                   fit=None if d.get("fit") is None else _fit(d["fit"]),
                   max_batch_size=opt_int("max_batch_size"),
                   reason=None if d.get("reason") is None else RankReason(d["reason"]))


def _fit(d: Mapping[str, Any]) -> Fit:
    return Fit(intercept_bytes=float(d["intercept_bytes"]), slope_bytes=float(d["slope_bytes"]),
               batch_slope_bytes=float(d.get("batch_slope_bytes", 0.0)),
               max_error_bytes=float(d.get("max_error_bytes", 0.0)), points=int(d.get("points", 0)),
               zero_bytes=None if d.get("zero_bytes") is None else float(d["zero_bytes"]))


#: The live UnevenBatchSampler objects whose epochs have steps of other sizes than their
#: plan's (the tail, and the step that lends it samples): ``scale_loss`` without the step's
#: sizes refuses for plans of their batch sizes.
_UNPLANNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def note_unplanned_steps(sampler: Any) -> None:
    """Record that ``sampler`` (an ``UnevenBatchSampler``: ``plan``, ``len`` and ``sizes_at``)
    makes steps of other sizes than its plan's."""
    _UNPLANNED.add(sampler)


def loss_scales(batch_sizes: Sequence[int]) -> list[float]:
    """``W·b_r/B`` per rank (see the module docstring)."""
    total, world = sum(batch_sizes), len(batch_sizes)
    return [world * b / total for b in batch_sizes]


def _check_sizes(batch_sizes: Sequence[int], allow_zero: bool = False) -> list[int]:
    sizes, least = list(batch_sizes), 0 if allow_zero else 1
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < least for b in sizes):
        raise UsageError(f"batch_sizes must be one int >= {least} per rank, got "
                         f"{list(batch_sizes)!r}")
    return sizes


@dataclass(frozen=True)
class DDPPlan:
    """Per-rank batch sizes for ``DistributedDataParallel``; see the module docstring.

    ``batch_sizes[r]`` is rank r's local batch, ``global_batch`` their sum (the batch the
    learning rate is tuned for, one micro-batch's with accumulation), ``loss_scales[r] =
    world_size·b_r/B``; ``micro_batches``: micro-batches per optimizer step (1: none).
    """

    ranks: tuple[RankPlan, ...]
    objective: str = "manual"                 # an Objective's value, or "manual"
    backend: str = "manual"                   # "simulated", "cuda" or "manual"
    cluster: str = ""
    model_name: str = ""
    headroom_bytes: Optional[int] = None
    options: DDPOptions = DDPOptions()
    settings: Optional[dict[str, Any]] = None  # the step settings (amp, accumulate, ...)
    probes: tuple[RankProbe, ...] = ()
    rounds: int = 0                            # rounds of probing (one probe per rank each)
    certified: bool = False                    # max_batch: one more sample measured over on every rank
    even_batch_size: Optional[int] = None      # largest global batch with equal local batches
    requested_global_batch: Optional[int] = None
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: the fewest samples a rank may get on any step (2 with BatchNorm, whose training mode
    #: needs more than one value per channel); the sampler's last steps keep to it
    min_batch: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        if not self.ranks:
            raise UsageError("a DDPPlan needs at least one rank")
        if [r.rank for r in self.ranks] != list(range(len(self.ranks))):
            raise UsageError(f"a DDPPlan's ranks must be 0..{len(self.ranks) - 1} in order")
        sizes = _check_sizes([r.batch_size for r in self.ranks])
        if isinstance(self.min_batch, bool) or not isinstance(self.min_batch, int) or \
                not 1 <= self.min_batch <= min(sizes):
            raise UsageError(f"min_batch must be an int from 1 to the smallest batch ({min(sizes)}); "
                             f"got {self.min_batch!r}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or \
                self.micro_batches < 1:
            raise UsageError(f"micro_batches must be an int >= 1, got {self.micro_batches!r}")

    # ---- the numbers a training script needs ----------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def batch_sizes(self) -> list[int]:
        return [r.batch_size for r in self.ranks]

    @property
    def global_batch(self) -> int:
        return sum(self.batch_sizes)

    @property
    def loss_scales(self) -> list[float]:
        return [r.loss_scale for r in self.ranks]

    def batch_size(self, rank: Optional[int] = None) -> int:
        """Rank ``rank``'s local batch (default: this process's rank in ``torch.distributed``)."""
        return self.ranks[self._rank(rank)].batch_size

    def loss_scale(self, rank: Optional[int] = None) -> float:
        return self.ranks[self._rank(rank)].loss_scale

    def scale_loss(self, loss: Any, rank: Optional[int] = None, *, batch_size: Optional[int] = None,
                   sizes: Optional[Sequence[int]] = None) -> Any:
        """``loss × world_size·b_r/B`` for the batches of *this step*, so that DDP's average
        of the ranks' gradients is the gradient of the mean over the step's global batch
        (``loss`` is the mean over this rank's samples).

        - ``batch_size=len(batch)`` (the documented loop): this rank's actual batch; the
          ranks' sizes are summed with one ``all_reduce`` of one number (on the loss's device,
          no host sync), so the scale is right on every step, the tail included, whatever
          sampler made the batches. Every rank must call it on every step, as DDP's backward.
        - ``sizes=sampler.sizes_at(step)``: every rank's batch at the step, no collective
          (``rank`` from ``torch.distributed`` unless given).
        - neither: the planned ``b_r`` and ``B``, right only on steps with the planned
          batches. Where an :class:`~dptune.ddp.UnevenBatchSampler` of these batch sizes in
          this process ends its epochs with other steps (a tail, without ``drop_last``), it
          cannot tell those steps from the others and raises a :class:`UsageError` that says
          what to pass, on every step and rank.

        Whenever ``torch.distributed`` is initialised, a plan made for another world size is
        refused on every rank, whatever ``rank`` says. ``rank`` defaults to this process's
        rank in ``torch.distributed``. With ``micro_batches = k > 1`` the scale is also divided
        by ``k`` (the gradients of ``k`` micro-batches are accumulated)."""
        scaled = self._step_loss(loss, rank, batch_size, sizes)
        return scaled / self.micro_batches if self.micro_batches > 1 else scaled

    def _step_loss(self, loss: Any, rank: Optional[int], batch_size: Optional[int],
                   sizes: Optional[Sequence[int]]) -> Any:
        distributed = check_world_size(self.world_size, "plan.scale_loss")
        if sizes is not None:
            step = _check_sizes(sizes, allow_zero=True)
            if len(step) != self.world_size:
                raise UsageError(f"sizes has {len(step)} entries but the plan has {self.world_size} "
                                 "ranks; pass sampler.sizes_at(step) of this plan's sampler")
            mine = step[self._rank(rank)]
            if batch_size is not None and batch_size != mine:
                raise UsageError(f"batch_size={batch_size} but sizes gives this rank {mine}; pass "
                                 "the sizes of the step this batch belongs to")
            return loss * (self.world_size * mine / max(sum(step), 1))
        if batch_size is None:
            self._refuse_unplanned_steps()
            return loss * self.loss_scale(rank)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise UsageError(f"batch_size must be this rank's batch size, an int >= 0; got "
                             f"{batch_size!r}")
        if not distributed:
            raise UsageError("scale_loss(loss, batch_size=...) sums the ranks' batches over "
                             "torch.distributed, which is not initialised; call "
                             "init_process_group first, or pass sizes=sampler.sizes_at(step)")
        return loss * _step_scale(loss, batch_size, self.world_size)

    def _refuse_unplanned_steps(self) -> None:
        """The planned scale is wrong on a step of other sizes: refuse where a sampler of
        these batch sizes makes such steps (:func:`note_unplanned_steps`)."""
        mine = list(self.batch_sizes)
        for sampler in list(_UNPLANNED):
            if list(sampler.plan.batch_sizes) != mine:
                continue
            steps = len(sampler)
            tail = sampler.sizes_at(steps - 1)
            before = sampler.sizes_at(steps - 2) if steps > 1 else mine
            lent = f" (the step before it {before})" if before != mine else ""
            raise UsageError(
                f"plan.scale_loss(loss) without batch_size= scales by the planned batches "
                f"{mine}, but this plan's UnevenBatchSampler ends each epoch with a step of "
                f"{sum(tail)} samples {tail}{lent}, where that scale is wrong; pass "
                "batch_size=len(batch) (this rank's batch on this step) or "
                "sizes=sampler.sizes_at(step), or drop_last=True to the sampler")

    def rank_of_uuid(self, uuid: str) -> Optional[int]:
        """The rank whose card has this UUID in the plan, or ``None``."""
        for r in self.ranks:
            if r.device is not None and r.device.uuid == uuid:
                return r.rank
        return None

    def _rank(self, rank: Optional[int]) -> int:
        if rank is None:
            rank = _current_rank(self.world_size)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise UsageError(f"rank {rank!r} is not in 0..{self.world_size - 1} (the plan has "
                             f"{self.world_size} ranks)")
        return rank

    # ---- construction -----------------------------------------------------------------
    @classmethod
    def from_batch_sizes(cls, batch_sizes: Sequence[int], **fields: Any) -> "DDPPlan":
        """A plan made by hand: ``DDPPlan.from_batch_sizes([48, 48, 32, 32])``."""
        sizes = _check_sizes(batch_sizes)
        scales = loss_scales(sizes)
        ranks = tuple(RankPlan(rank=r, batch_size=b, loss_scale=s)
                      for r, (b, s) in enumerate(zip(sizes, scales)))
        return cls(ranks=ranks, **fields)

    # ---- files ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dict(kind=PLAN_KIND, version=PLAN_VERSION, objective=self.objective,
                    backend=self.backend, cluster=self.cluster, model_name=self.model_name,
                    world_size=self.world_size, batch_sizes=self.batch_sizes,
                    global_batch=self.global_batch, loss_scales=self.loss_scales,
                    headroom_bytes=self.headroom_bytes, options=self.options.to_dict(),
                    settings=self.settings, ranks=[r.to_dict() for r in self.ranks],
                    probes=[p.to_dict() for p in self.probes], rounds=self.rounds,
                    certified=self.certified, even_batch_size=self.even_batch_size,
                    requested_global_batch=self.requested_global_batch, seconds=self.seconds,
                    notes=list(self.notes), min_batch=self.min_batch,
                    micro_batches=self.micro_batches)

    @classmethod
    def from_dict(cls, d: Any) -> "DDPPlan":
        if not isinstance(d, Mapping) or d.get("kind") != PLAN_KIND:
            raise ReportError("not a dptune DDP plan (no \"kind\": \"dptune-ddp-plan\"); write one "
                             "with `dptune plan` or DDPPlan.save")
        if d.get("version") != PLAN_VERSION:
            raise ReportError(f"DDP plan version {d.get('version')!r} is not supported (this dptune "
                             f"reads version {PLAN_VERSION}); re-run `dptune plan`")
        try:
            plan = cls(
                ranks=tuple(RankPlan.from_dict(r) for r in d["ranks"]),
                objective=str(d.get("objective", "manual")), backend=str(d.get("backend", "manual")),
                cluster=str(d.get("cluster", "")), model_name=str(d.get("model_name", "")),
                headroom_bytes=d.get("headroom_bytes"),
                options=DDPOptions.from_dict(d.get("options") or {}), settings=d.get("settings"),
                probes=tuple(RankProbe.from_dict(p) for p in d.get("probes", [])),
                rounds=int(d.get("rounds", 0)), certified=bool(d.get("certified", False)),
                even_batch_size=d.get("even_batch_size"),
                requested_global_batch=d.get("requested_global_batch"),
                seconds=float(d.get("seconds", 0.0)), notes=tuple(d.get("notes", [])),
                min_batch=int(d.get("min_batch", 1)), micro_batches=int(d.get("micro_batches", 1)))
        except ReportError:
            raise
        except UsageError as e:   # e.g. batch sizes < 1
            raise ReportError(f"the DDP plan is not valid: {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise ReportError(f"the DDP plan is malformed ({type(e).__name__}: {e}); re-run "
                             "`dptune plan`") from None
        if "batch_sizes" in d and list(d["batch_sizes"]) != plan.batch_sizes:
            raise ReportError(f"the DDP plan's batch_sizes {d['batch_sizes']} disagree with its "
                             f"ranks {plan.batch_sizes}; re-run `dptune plan`")
        return plan

    def save(self, path: str) -> str:
        """Write ``path`` if it ends in ``.json``, else ``path/plan.json``, ``path/summary.md``
        and ``path/report.html``; returns the JSON file's path."""
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        folder = os.path.dirname(path) if path.endswith(".json") else path
        try:
            if folder:
                os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot create the folder {folder!r} ({e.strerror or e}); choose "
                              "a path you can write to") from None
        if path.endswith(".json"):
            target = path
        else:
            target = os.path.join(path, "plan.json")
            _write(os.path.join(path, "summary.md"), self.summary() + "\n")
            from dptune.report.html_plans import render_plan_html   # rendering, on top

            _write(os.path.join(path, "report.html"), render_plan_html(self))
        _write(target, text)
        return target

    @classmethod
    def load(cls, path: str) -> "DDPPlan":
        """Read a plan from its JSON file or the folder that holds ``plan.json``."""
        _, data = read_json(path, "plan.json", "DDP plan", "dptune plan")
        return cls.from_dict(data)

    # ---- text -------------------------------------------------------------------------
    @property
    def strategy_name(self) -> str:
        """``"FSDP2"`` for a plan of a model sharded with ``fully_shard`` (the planner's note
        ``strategy fsdp: ...`` says so), else ``"DDP"``."""
        return "FSDP2" if self._fsdp_note() is not None else "DDP"

    def _fsdp_note(self) -> Optional[str]:
        return next((n for n in self.notes if n.startswith(_FSDP_NOTE)), None)

    def describe_options(self) -> str:
        """``"DDP: buckets of 25 MiB"``, or FSDP2's sharding for an FSDP2 plan (whose DDP
        bucket settings do not apply)."""
        note = self._fsdp_note()
        if note is None:
            return f"DDP: {self.options.describe()}"
        what = note[len(_FSDP_NOTE):].split(" (the DDP bucket settings", 1)[0].strip()
        return what if what.startswith("FSDP2") else f"FSDP2: {what}"

    def table(self) -> str:
        """One line per rank: batch, loss scale, card, budget, predicted and measured peak,
        and why the rank got its batch (when the planner said)."""
        head = ["rank", "batch", "loss scale", "card", "budget", "predicted", "measured", "share"]
        why = any(r.reason is not None for r in self.ranks)
        if why:
            head.append("why")
        rows = []
        for r in self.ranks:
            card = "" if r.device is None else r.device.name
            if r.host:
                card = f"{r.host}:{card}"
            share = r.share
            rows.append([str(r.rank), str(r.batch_size), f"{r.loss_scale:.4f}", card,
                         format_bytes(r.budget_bytes) if r.budget_bytes is not None else "",
                         format_bytes(r.predicted_peak_bytes) if r.predicted_peak_bytes is not None else "",
                         format_bytes(r.measured_peak_bytes) if r.measured_peak_bytes is not None else "",
                         "" if share is None else f"{100 * share:.1f}%"]
                        + ([str(r.reason or "")] if why else []))
        from dptune.report.tables import Align, text_table

        align = [Align.LEFT if i in (3, 8) else Align.RIGHT for i in range(len(head))]   # card, why
        return "\n".join(text_table(head, rows, align, rule=True))

    def summary(self) -> str:
        title = f"{self.strategy_name} plan: {self.model_name or 'model'}"
        if self.cluster:
            title += f" on {self.cluster}"
        lines = [title, "",
                 f"objective {self.objective}, global batch {self.global_batch} over "
                 f"{self.world_size} ranks: {self.batch_sizes}"]
        if self.micro_batches > 1:
            lines.append(f"{self.micro_batches} micro-batches per optimizer step: "
                         f"{self.micro_batches * self.global_batch} samples (gradient accumulation)")
        if self.even_batch_size is not None:
            gain = (f" ({100 * (self.global_batch / self.even_batch_size - 1):+.0f}%)"
                    if self.even_batch_size else "")
            lines.append(f"equal local batches fit a global batch of at most {self.even_batch_size}"
                         f"{gain}")
        if self.objective == Objective.MAX_BATCH:
            lines.append("certified: no rank fits one more sample" if self.certified else
                         "not certified: the search stopped before every rank's limit was closed")
        lines.append(self.describe_options())
        if self.settings:
            from dptune.step.workload import StepSettings

            try:
                lines.append("step: " + StepSettings.from_dict(self.settings).describe())
            except (UsageError, KeyError, TypeError, ValueError):
                lines.append(f"step: {self.settings}")
        if self.headroom_bytes is not None:
            lines.append(f"headroom {format_bytes(self.headroom_bytes)} per card; "
                         f"{len(self.probes)} probes in {self.rounds} rounds")
        lines += ["", self.table()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def is_plan_path(path: str) -> bool:
    """Whether ``path`` is a DDP plan's JSON file or a folder holding ``plan.json``."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "plan.json"))
    if not path.endswith(".json") or not os.path.isfile(path):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return f'"kind": "{PLAN_KIND}"' in head


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as e:
        raise OutputError(f"cannot write {path!r} ({e.strerror or e}); choose a path you can "
                          "write to") from None


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def check_world_size(world_size: int, what: str) -> bool:
    """Whether ``torch.distributed`` is initialised; raises a ``UsageError`` (the same on
    every rank, before any collective) when it is and its world size is not the plan's."""
    if not _distributed():
        return False
    import torch.distributed as dist

    job = dist.get_world_size()
    if job != world_size:
        raise UsageError(f"{what}: the plan has {world_size} ranks but this torch.distributed job "
                         f"has {job}; make the plan for {job} ranks (`dptune plan` on {job} cards, "
                         f"or DDPPlan.from_batch_sizes with {job} sizes)")
    return True


def _step_scale(loss: Any, batch_size: int, world_size: int) -> Any:
    """``world_size·b/B'`` as a tensor, ``B'`` the sum of the ranks' ``batch_size`` (one
    ``all_reduce``; the scale stays on the loss's device)."""
    import torch
    import torch.distributed as dist

    device = loss.device if isinstance(loss, torch.Tensor) else torch.device("cpu")
    where = device
    if device.type == "cpu" and dist.get_backend() == "nccl":
        where = torch.device("cuda", torch.cuda.current_device())
    total = torch.tensor(float(batch_size), dtype=torch.float64, device=where)
    dist.all_reduce(total)
    scale = (world_size * batch_size) / total.clamp_min(1)
    dtype = torch.promote_types(loss.dtype, torch.float32) if isinstance(loss, torch.Tensor) else None
    return scale.to(device=device, dtype=dtype or torch.float64)


def _current_rank(world_size: int) -> int:
    import torch.distributed as dist

    if not check_world_size(world_size, "the plan"):
        raise UsageError("no rank given and torch.distributed is not initialised; pass rank=... "
                         "or call init_process_group first (torchrun sets RANK and WORLD_SIZE)")
    return dist.get_rank()
