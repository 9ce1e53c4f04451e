"""``dptune.ddp.plan``: per-rank batch sizes for DDP, offline on a simulated cluster or
inside a ``torchrun`` job.

The same loop runs in both places. Every round, each rank runs (at most) one training step
of its own at a batch size decided from what all ranks know, and the results are shared:

- offline (``simulate="2x32GB,2x24GB"``, no process group), one process simulates every
  rank in turn;
- inside a job (``torch.distributed`` initialised), each rank probes its own card (its
  CUDA device, or card ``rank`` of ``simulate``) and the rounds' results are exchanged with
  ``all_gather_object``. Every decision is made from the gathered results only, so every
  rank makes the same one and returns the same plan; an error on one rank (its step raised,
  or it cannot fit even the smallest batch) is gathered too and raised on every rank.

Per rank, memory is affine-ish in its own batch ``b`` (DDP gathers nothing, so ranks do
not depend on each other). The plan uses :mod:`dptune.solve.memory`'s fits and splits with
``every_card=True`` (no rank may sit out a step):

1. every rank probes the smallest batch (1, or 2 with BatchNorm); a rank over its budget
   there makes the plan infeasible;
2. every rank probes a second batch (its budget's share of ``global_batch`` for
   ``balance`` and ``throughput``, ``8×`` the first for ``max_batch``);
3. ``balance``: fit each rank on its two probes nearest the proposal, solve the split of
   ``global_batch`` that equalises the shares of budget, probe it; repeat until a proposal
   is measured within budget on every rank. ``max_batch``: each rank's largest batch is
   bracketed (largest measured within budget, smallest measured over), secant and
   bisection steps alternating, until every bracket is closed (``certified``) or the
   rounds run out; with ``global_batch`` given and more fitting, that batch is balanced.
   ``throughput`` (the default): the batches with the shortest step within every rank's
   memory cap (:mod:`dptune.ddp.throughput`), probed until measured within budget.

The searches run on :mod:`dptune.search.ranks` (each rank's probes and its bracket); the
arguments are checked once (:class:`dptune.settings.Settings`). **The default objective** is
the fastest batches that fit: each rank's step time comes with its probes (gathered with the
peaks inside a job), estimated on the simulated cluster, measured by CUDA events on each
rank's own card, so no plan where memory does not bind is slower than equal batches. With
FSDP no time is known, nor where a rank's step was not timed (then the explicit
``objective="throughput"`` fails on every rank), and the ranks are taken as equally fast
(batches as equal as the memory caps allow). Each rank's reason
(:class:`dptune.ddp.result.RankReason`) is in the plan.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from dptune.budget import RESERVED_CERTIFICATE, RESERVED_MODEL, BudgetLevel, Collectives
from dptune.ddp.group import Group, LocalGroup, TorchGroup
from dptune.ddp.probers import Prober, SimulatedProber, local_cuda_prober
from dptune.ddp.ranks import RankInfo
from dptune.ddp.result import DDPPlan, RankPlan, RankReason, loss_scales
from dptune.errors import NoFeasibleSplitError, UsageError
from dptune.search.ranks import RankObservations, Runner, balance_ranks, bracket_ranks, cap_of
from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.settings import Budget, Settings, sort_keywords
from dptune.types import BackendKind, CardWindow, Objective, Strategy
from dptune.units import format_bytes

__all__ = ["plan", "OBJECTIVES"]

#: the objectives ``plan`` takes (:class:`dptune.types.Objective`'s values)
OBJECTIVES = tuple(o.value for o in Objective)


@dataclass(frozen=True)
class _Job:
    """Where the plan is made: the simulated cluster (``None``: real cards), the ranks
    together, this rank's host (inside a job), the cards' kind and the objective decided
    (``default``: none was given)."""

    cluster: Any
    group: Group
    host: Optional[str]
    backend: BackendKind
    in_job: bool
    objective: Objective
    default: bool = False


@dataclass(frozen=True)
class _Found:
    """What the search found: the batches, whether certified, and the lines saying why."""

    sizes: list[int]
    certified: bool = False
    why: tuple[str, ...] = ()
    reasons: tuple[RankReason, ...] = ()     # per rank, in short
    micro_batches: int = 1                    # the global batch as that many micro-batches
    #: max_batch: each rank's cap before any was raised past a fall (where a user raising the
    #: ranks' equal batch until one fails stops); ``None``: the caps measured
    first_caps: Optional[tuple[int, ...]] = None


def plan(model: Any, sample: Callable[[int], Any], loss_fn: Optional[Callable[..., Any]] = None,
         optimizer: Optional[Callable[..., Any]] = None, *, global_batch: Optional[int] = None,
         objective: Optional[str] = None, simulate: Optional[Union[str, Any]] = None,
         device: Optional[int] = None, budget: Optional[Budget] = None, strategy: Any = "ddp",
         micro_batches: Union[int, str] = 1, **keywords: Any) -> DDPPlan:
    """Per-rank batch sizes for ``DistributedDataParallel`` on unequal cards.

    ``model``, ``sample``, ``loss_fn``, ``optimizer`` and the step's keywords (``amp``,
    ``accumulate``, ``clip_grad_norm``, ``step``) describe one rank's training step as for
    :class:`dptune.Tuner`; ``sample(b)`` builds a local batch of ``b``. ``budget``: a
    :class:`dptune.Budget`, as for :class:`dptune.Tuner` (or its keywords ``headroom=``,
    ``budget_level=``, ``allocator=``, ``nccl_bytes=``); ``max_rounds=`` (default 16) bounds
    the probing rounds, every rank probing once a round.

    - ``objective``: by default (``None``) the fastest per-rank batches of ``global_batch``
      that fit (``"throughput"``: each rank's step time estimated on the simulated cluster,
      measured by CUDA events on its card inside a job; with FSDP, where no step time is
      known, batches as equal as the memory caps allow). ``"balance"``: split ``global_batch`` so
      every rank uses the same share of its budget. ``"max_batch"``: the largest global
      batch, each rank at its own limit (at most ``global_batch`` when given).
    - ``simulate``: a cluster spec such as ``"2x32GB,2x24GB"``, one rank per card. Without a
      process group the whole plan is made in this process; inside a ``torchrun`` job rank
      r simulates card r. Inside a job without ``simulate``, each rank probes its own CUDA
      card (``device``, default ``torch.cuda.current_device()``): call ``plan`` on every rank.
    - ``strategy``: ``"ddp"`` (the default; ``bucket_cap_mb=``, ``gradient_as_bucket_view=``:
      the DDP arguments you will use, or ``strategy=DDPOptions(...)``) or ``"fsdp"`` (below).
    - ``micro_batches``: ``global_batch`` trained as that many equal micro-batches with
      gradient accumulation (1: one step; an int that divides it; ``"auto"``: with the
      throughput objective, the number and the split that finish it fastest within every
      rank's memory); the plan's batches are one micro-batch's, ``plan.micro_batches`` the
      number, and ``plan.scale_loss`` divides each micro-batch's loss by it.
    - ``budget``: at the reserved level (the default) each rank's peak is the caching
      allocator's reserved peak plus NCCL's buffers (simulated ranks: the allocator model;
      real cards: ``max_memory_reserved``).
    - ``strategy="fsdp"`` (or ``strategy=FSDPOptions(...)``): the model is sharded with FSDP2
      (``fully_shard``) instead, by ``shard(model, mesh)`` or by default each ``ModuleList``
      block then the root with ``reshard_after_forward`` and ``mp_policy`` (see
      :mod:`dptune.ddp.fsdp`); on simulated
      cards, or inside a job on each rank's own CUDA card (:mod:`dptune.backends.cuda.fsdp`).

    The arguments are checked once (:class:`dptune.settings.Settings`). Every rank returns
    the same :class:`DDPPlan`. Raises :class:`NoFeasibleSplitError` (on every rank) when
    some rank cannot fit its share.
    """
    from dptune.backends.simulated.ddp import make_workload

    t0 = time.perf_counter()
    if "max_probes" in keywords or "tolerance" in keywords:
        raise UsageError("plan() takes max_rounds= (the probing rounds, every rank at once), "
                         "not max_probes= or tolerance=")
    kw = sort_keywords("plan()", keywords, budget=budget, own=_PLAN_KEYWORDS, takes_search=False)
    how, options, fsdp = _strategy(strategy, kw.rest)
    settings = Settings.for_plan(
        global_batch=global_batch, objective=objective, budget=kw.budget,
        max_rounds=kw.rest.get("max_rounds", 16), simulate=simulate, strategy=how, ddp=options,
        fsdp=fsdp, device=device, micro_batches=micro_batches)
    workload = make_workload(model, sample, loss_fn, optimizer, dict(kw.step))
    job = _job(settings)
    probers: dict[int, Prober] = {}
    shared: dict = {}     # simulated ranks on one card type share one simulator
    timer = None
    if job.cluster is not None and not settings.fsdp:  # the simulated ranks' estimated speed
        from dptune.ddp.throughput import RankTimer

        timer = RankTimer(probers, job.cluster)

    def start(r: int) -> RankInfo:
        # built inside the first round, so that a rank failing here fails every rank
        probers[r] = _prober(workload, settings, job, r, fsdp, shared)
        return probers[r].info()

    def probe(r: int, b: int) -> Optional[int]:
        return probers[r].probe(b) if timer is None else timer.probe(r, b)

    def timed(r: int, b: int) -> Optional[float]:
        # the rank's time, gathered with its peak: estimated, or measured by its card's events
        return timer.seconds(r, b) if timer is not None else probers[r].seconds(b)  # type: ignore[attr-defined]

    try:
        infos = job.group.each(start)
        obs = RankObservations([i.budget_bytes for i in infos], max(i.min_batch for i in infos))
        times = None if settings.fsdp else _times(obs, timer)
        hosted = None if times is None or timer is None else timer.host_seconds
        def look(r: int, b: int) -> Any:
            past = getattr(probers[r], "look_past", None)
            return None if past is None else past(b)

        found = _search(settings, job, obs, infos, lambda sizes: obs.run(
            job.group.each, sizes, probe, None if times is None else timed, hosted), times, look)
    finally:
        for p in probers.values():
            p.close()
    return _the_plan(settings, job, obs, infos, found, fsdp, time.perf_counter() - t0)


_DDP_KEYWORDS = ("bucket_cap_mb", "gradient_as_bucket_view")
_FSDP_KEYWORDS = ("shard", "reshard_after_forward", "mp_policy")
_PLAN_KEYWORDS = ("max_rounds",) + _DDP_KEYWORDS + _FSDP_KEYWORDS


def _strategy(strategy: Any, rest: Mapping[str, Any]) -> tuple[Strategy, DDPOptions, Any]:
    """``strategy=`` (``"ddp"``, ``"fsdp"``, a :class:`DDPOptions` or an
    :class:`~dptune.ddp.fsdp.FSDPOptions`) and the strategy's keywords, as the strategy, the
    DDP options and the FSDP2 options (``None`` under DDP)."""
    from dptune.ddp.fsdp import FSDPOptions

    ddp_kw = {k: rest[k] for k in _DDP_KEYWORDS if k in rest}
    fsdp_kw = {k: rest[k] for k in _FSDP_KEYWORDS if k in rest}
    if isinstance(strategy, (DDPOptions, FSDPOptions)) and (ddp_kw or fsdp_kw):
        raise UsageError(f"strategy= is given as options already: drop {', '.join(ddp_kw | fsdp_kw)}")
    if isinstance(strategy, DDPOptions):
        return Strategy.DDP, strategy, None
    if isinstance(strategy, FSDPOptions):
        return Strategy.FSDP, DDPOptions(), strategy
    if not (isinstance(strategy, Strategy) or strategy in tuple(s.value for s in Strategy)):
        raise UsageError(f"strategy must be 'ddp' or 'fsdp' (or a DDPOptions / FSDPOptions), got {strategy!r}")
    how = Strategy(strategy)
    if how is Strategy.DDP:
        if fsdp_kw:
            raise UsageError("shard, reshard_after_forward and mp_policy are FSDP's: pass strategy='fsdp'")
        return how, DDPOptions(**ddp_kw), None
    return how, DDPOptions(**ddp_kw), FSDPOptions(**fsdp_kw)


def _job(settings: Settings) -> _Job:
    """The cards and the ranks: a simulated cluster and/or the ``torch.distributed`` job."""
    from dptune.hardware.cluster import parse_cluster

    cluster = parse_cluster(settings.simulate) if settings.simulate is not None else None
    settings.budget.check_cards(cluster is not None)

    import torch.distributed as dist

    in_job = dist.is_available() and dist.is_initialized()
    group: Group
    if in_job:
        group = TorchGroup()
        host: Optional[str] = socket.gethostname()
        if cluster is not None and len(cluster) != group.world_size:
            raise UsageError(f"simulate={cluster.describe()!r} has {len(cluster)} cards but the job "
                             f"has {group.world_size} ranks; give one card per rank")
    else:
        if cluster is None:
            raise UsageError(
                "not inside a torch.distributed job: pass simulate='2x32GB,2x24GB' (one card per "
                "rank) to plan offline, or call dptune.ddp.plan(...) on every rank of your torchrun "
                "job after init_process_group to probe the real cards")
        group = LocalGroup(len(cluster))
        host = None
    objective = settings.objective or Objective.THROUGHPUT   # the default: the fastest that fits
    return _Job(cluster, group, host, BackendKind.SIMULATED if cluster is not None else
                BackendKind.CUDA, in_job, objective, settings.objective is None)


def _prober(workload: Any, settings: Settings, job: _Job, r: int, fsdp: Any, shared: dict) -> Prober:
    """Rank r's prober: an FSDP2 or DDP rank on card r of the cluster, or this rank's GPU."""
    budget = settings.budget
    if fsdp is not None and job.cluster is None:
        from dptune.ddp.fsdp import CudaFSDPProber

        return CudaFSDPProber(workload, settings.device, job.group.world_size, r, fsdp,
                              budget.headroom_bytes, job.host, budget.level)
    if fsdp is not None:
        from dptune.ddp.fsdp import SimulatedFSDPProber

        return SimulatedFSDPProber(workload, job.cluster, r, fsdp, budget.headroom_bytes, job.host,
                                   shared, budget.reserved)
    if job.cluster is not None:
        return SimulatedProber(workload, job.cluster, r, settings.ddp, budget.headroom_bytes,
                               job.host, shared, budget.reserved)
    return local_cuda_prober(workload, settings.device, settings.ddp, budget.headroom_bytes,
                             job.host, budget.level)


def _times(obs: RankObservations, timer: Any) -> Any:
    """The ranks' step times from their probes: the simulator's estimates (``timer``, with
    the ring all-reduce over its link), else each real card's own, measured."""
    from dptune.ddp.throughput import ProbeTimes

    if timer is not None:
        return ProbeTimes(obs, "estimated", timer.speed.link.bandwidth)
    return ProbeTimes(obs, "measured")


def _search(settings: Settings, job: _Job, obs: RankObservations, infos: Sequence[RankInfo],
            run: Runner, times: Any, look: Callable[[int, int], Any] = lambda r, b: None) -> _Found:
    """The objective's search on the ranks' observations (:mod:`dptune.search.ranks`);
    ``times``: the ranks' step times (:func:`_times`), ``None`` where none are known (FSDP);
    ``look(rank, batch)``: past a certified rank's cap on the allocator model (simulated
    ranks at the reserved level), a :class:`~dptune.types.CardWindow` or ``None``."""
    n, m, batch = obs.n, obs.m, settings.batch_size
    if isinstance(settings.micro_batches, int) and batch is not None:
        batch //= settings.micro_batches      # a fixed number of micro-batches: split one
    rounds = settings.max_probes
    grad_bytes = infos[0].ddp_bytes
    if job.objective is Objective.MAX_BATCH:
        _first_rounds(obs, infos, run, [8 * m] * n)
        certified = bracket_ranks(obs, run, rounds, batch,
                                  staircase=settings.budget.level is BudgetLevel.RESERVED)
        sizes = [obs.lo(r) for r in range(n)]
        why = RankReason.MEMORY_CAP
        if batch is not None and sum(sizes) > batch:
            sizes = balance_ranks(obs, run, batch, rounds + 4, sizes)
            certified, why = False, RankReason.MEMORY_BALANCE
        contradiction = obs.not_monotone()
        looked: tuple[str, ...] = ()
        first_caps: Optional[tuple[int, ...]] = None
        if certified and contradiction is None and why is RankReason.MEMORY_CAP \
                and settings.budget.level is BudgetLevel.RESERVED:
            windows = [(r, w) for r, w in enumerate(job.group.each(lambda r: look(r, sizes[r])))
                       if w is not None]
            falls = [(r, w) for r, w in windows if w.fits is not None]
            if falls:
                first_caps = tuple(sizes)
                sizes, looked, missed = _past_the_falls(obs, run, sizes, falls, rounds)
                over = [(r, w) for r, w in falls if r in missed]
                looked += _looked(w for w in windows if w[1].fits is None)
                if over:
                    contradiction = "on the allocator model, past the caps: " + "; ".join(
                        w.describe(f"rank {r}") for r, w in over)
                    certified = False
            else:
                looked = _looked(windows)
        open_ = [obs.bracket(r).describe().replace("card", "rank") for r in range(n)
                 if not obs.bracket(r).closed]
        notes: tuple[str, ...] = ()
        if open_ and contradiction is None and why is RankReason.MEMORY_CAP and obs.rounds >= rounds:
            notes = (f"not certified: {obs.rounds} of {rounds} rounds run (ddp.plan's "
                     f"max_rounds=) and {len(open_)} bracket(s) still open ({'; '.join(open_)}); "
                     "each rank's batch measured within its budget is returned",)
        elif contradiction is not None:
            notes = (f"the figures are not monotone ({contradiction}; the caching allocator's "
                     "reserved peak depends on fragmentation): one more sample measured over does "
                     "not prove that no larger batch fits, so the caps are not certified; "
                     "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes the reserved figure "
                     "follow the allocated one",)
        return _Found(sizes, certified, _speed(times, sizes, grad_bytes) + looked + notes, (why,) * n,
                      first_caps=first_caps if first_caps != tuple(sizes) else None)
    assert batch is not None
    if batch < m * n:
        raise UsageError(f"global_batch {batch} is too small for {n} ranks: every rank "
                         f"needs at least {m} sample{'s' if m > 1 else ''}")
    total = sum(obs.budgets)
    second = [max(m + 1, batch * b // total) for b in obs.budgets]
    _first_rounds(obs, infos, run, second)
    if job.objective is Objective.BALANCE:
        sizes = balance_ranks(obs, run, batch, rounds, second)
        return _Found(sizes, why=_speed(times, sizes, grad_bytes),
                      reasons=(RankReason.MEMORY_BALANCE,) * n)
    from dptune.ddp.throughput import EqualSpeed, plan_throughput

    speed, untimed = _timed(job, times)
    fast = plan_throughput(obs, run, EqualSpeed() if speed is None else speed, batch, rounds,
                           grad_bytes, cap_of, accumulate=settings.micro_batches == "auto")
    default = (DEFAULT_NOTE,) if job.default else ()
    return _Found(fast.sizes, why=fast.reasons + fast.notes + untimed + default,
                  reasons=fast.labels, micro_batches=fast.micro_batches)


def _timed(job: _Job, times: Any) -> tuple[Any, tuple[str, ...]]:
    """The times the fastest plan uses, and a note when a rank's step was not timed: then an
    explicit ``objective='throughput'`` fails (on every rank, the same words: they come from
    the gathered probes) and the default takes the ranks as equally fast."""
    if times is None:
        return None, ()
    from dptune.ddp.throughput import untimed_note

    missing = times.untimed()
    if not missing:
        return times, ()
    what = untimed_note(missing)
    if not job.default:
        from dptune.errors import BackendUnavailableError

        raise BackendUnavailableError(
            f"objective='throughput' needs every rank's step time, and {what}; use "
            "objective='balance', or leave objective out (batches as equal as memory allows)")
    return None, (f"{what}: the ranks are taken as equally fast",)


DEFAULT_NOTE = ("objective: the default, the fastest per-rank batches that fit (throughput); "
                "objective='balance' gives every rank the same share of its memory instead")


def _speed(times: Any, sizes: Sequence[int], grad_bytes: int) -> tuple[str, ...]:
    """A plan's speed beside equal batches (none without every rank's time)."""
    if times is None or times.untimed():
        return ()
    from dptune.ddp.throughput import speed_note

    return speed_note(times, sizes, grad_bytes)


def _describe_rank(info: RankInfo, r: int) -> str:
    where = f"{info.host}:" if info.host else ""
    return f"rank {r} ({where}{info.device.name}, budget {format_bytes(info.budget_bytes)})"


def _first_rounds(obs: RankObservations, infos: Sequence[RankInfo], run: Runner,
                  second: Sequence[int]) -> None:
    """Every rank at the smallest batch (a rank over budget there: no plan fits), then at
    ``second``."""
    m = obs.m
    run([m] * obs.n)
    bad = [r for r in range(obs.n) if not obs.measured(r, m).fits]  # type: ignore[union-attr]
    if bad:
        parts = []
        short = 0
        for r in bad:
            p = obs.measured(r, m)
            assert p is not None
            if p.peak_bytes is None:
                parts.append(f"{_describe_rank(infos[r], r)} runs out of memory")
            else:
                over = p.peak_bytes - obs.budgets[r]
                short = max(short, over)
                parts.append(f"{_describe_rank(infos[r], r)} needs "
                             f"{format_bytes(p.peak_bytes)}, {format_bytes(over)} over")
        raise NoFeasibleSplitError(
            f"no plan fits: with {m} sample{'s' if m > 1 else ''} per rank, " + "; ".join(parts)
            + ". Every rank runs every step; free memory on that card, lower the headroom, "
            + ("use gradient_as_bucket_view=True, " if any(i.ddp_bytes for i in infos) else "")
            + "or leave that card out of the job.",
            shortfall_bytes=short or None)
    run([max(m + 1, b) for b in second])


def _past_the_falls(obs: RankObservations, run: Callable[[Sequence[Optional[int]]], None],
                    sizes: Sequence[int], falls: Sequence[tuple[int, CardWindow]], rounds: int
                    ) -> tuple[list[int], tuple[str, ...], set[int]]:
    """Past the falls the look found above the ranks' caps: each such rank raised to the last
    batch of its window within budget on the model (``last_fits``; every batch above it over
    there, up to where its allocated peak alone is over), the raised ranks probed in one round
    (the others sit it out). Returns the sizes (a raised rank measured within budget takes its
    raised batch, certified on the allocator model), the note on those, and the ranks left
    uncertified (a window not looked at whole, no round left, or measured over)."""
    up = {r: int(w.last_fits) for r, w in falls
          if w.scaled and w.end is not None and w.last_fits is not None}
    if not up or obs.rounds >= rounds:
        return list(sizes), (), {r for r, _ in falls}
    before = len(obs.probes)
    run([up.get(r) for r in range(obs.n)])
    got = {p.rank: p for p in obs.probes[before:]}
    raised = {r: b for r, b in up.items() if r in got and got[r].fits}

    def words(r: int, w: CardWindow) -> str:
        b = raised[r]
        over = (f"over from batch {b + 1} to batch {int(w.end or 0) - 1}, and from batch "
                if b + 1 < int(w.end or 0) else "from batch ")
        return (f"rank {r}: over at batch {w.start}, within budget again at batch {w.fits} and "
                f"last at batch {b} (measured), {over}{w.end} its allocated peak alone is over")
    said = "; ".join(words(r, w) for r, w in falls if r in raised)
    note = () if not raised else (
        "past the caps the ranks' figures fall as the batch grows (the caching allocator's "
        f"fragmentation); on the allocator model: {said}. The raised caps are certified on the "
        "allocator model; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True makes the reserved "
        "figure follow the allocated one",)
    return ([raised.get(r, b) for r, b in enumerate(sizes)], note,
            {r for r, _ in falls if r not in raised})


def _looked(windows: Any) -> tuple[str, ...]:
    """The note on the ranks looked past and over throughout (none: no note)."""
    said = "; ".join(w.describe(f"rank {r}") for r, w in windows)
    return (f"looked past each rank's cap on the allocator model: {said}",) if said else ()


def _the_plan(settings: Settings, job: _Job, obs: RankObservations, infos: Sequence[RankInfo],
              found: _Found, fsdp: Any, seconds: float) -> DDPPlan:
    """The plan object: per rank its batch, loss scale, card and memory figures."""
    sizes, objective = found.sizes, job.objective
    ranks = []
    for r, (b, s) in enumerate(zip(sizes, loss_scales(sizes))):
        info, fit = infos[r], obs.fit(r, b)
        meas = obs.measured(r, b)
        ranks.append(RankPlan(
            rank=r, batch_size=b, loss_scale=s, device=info.device, host=info.host,
            budget_bytes=info.budget_bytes, predicted_peak_bytes=int(round(fit.predict(b, 0))),
            measured_peak_bytes=None if meas is None else meas.peak_bytes, ddp_bytes=info.ddp_bytes,
            fit=fit, max_batch_size=obs.lo(r) if objective is Objective.MAX_BATCH else None,
            reason=found.reasons[r] if found.reasons else None))
    # equal local batches: a rank raised past a fall is over between its first cap and the
    # batch it fits again at, so the equal batch stops at the caps before any was raised
    caps = found.first_caps or tuple(obs.lo(r) for r in range(obs.n))
    even = obs.n * min(caps) if objective is Objective.MAX_BATCH else None
    return DDPPlan(
        ranks=tuple(ranks), objective=objective.value, backend=job.backend.value,
        cluster=(job.cluster.describe() if job.cluster is not None else
                 " + ".join(i.device.name for i in infos)),
        model_name=infos[0].model_name, headroom_bytes=settings.budget.headroom_bytes,
        options=settings.ddp, settings=infos[0].settings, probes=tuple(obs.probes),
        rounds=obs.rounds, certified=found.certified, even_batch_size=even,
        requested_global_batch=settings.batch_size, seconds=seconds,
        notes=_notes(settings, job, obs, found, fsdp), min_batch=obs.m,
        micro_batches=(found.micro_batches if settings.micro_batches == "auto"
                       else int(settings.micro_batches)))


def _notes(settings: Settings, job: _Job, obs: RankObservations, found: _Found,
           fsdp: Any) -> tuple[str, ...]:
    notes = list(found.why)
    k = settings.micro_batches
    if isinstance(k, int) and k > 1:
        notes.append(f"global batch {settings.batch_size} per optimizer step: {k} micro-batches of "
                     f"{sum(found.sizes)} (micro_batches={k}); plan.scale_loss divides each "
                     f"micro-batch's loss by {k}")
    if fsdp is not None:
        notes.insert(0, f"strategy fsdp: {fsdp.describe()} (the DDP bucket settings do not apply)")
    if job.backend is BackendKind.CUDA and fsdp is not None:
        notes.append("measured peaks are each card's max_memory_allocated over a step of one FSDP2 "
                     "rank sharded for the job's world size (collectives on a fake process group: "
                     "NCCL's own buffers are not included)")
    elif job.backend is BackendKind.CUDA:
        notes.append("measured peaks are the single-card step's max_memory_allocated plus the "
                     "counted DDP buckets" + (" (an upper bound with gradient_as_bucket_view)"
                                              if settings.ddp.gradient_as_bucket_view else ""))
    # the allocator model is the simulated ranks': real cards measure max_memory_reserved
    reserved = settings.budget.reserved if job.backend is BackendKind.SIMULATED else None
    collectives = Collectives.DDP if fsdp is None else Collectives.FSDP
    if settings.budget.level is BudgetLevel.RESERVED:
        notes.append("budgets checked against the reserved level: each rank's peak is the caching "
                     "allocator's reserved peak plus NCCL's buffers" + (
                         f" ({format_bytes(reserved.fixed.nccl_for(obs.n, collectives))} per rank); "
                         + RESERVED_MODEL if reserved is not None else
                         "; DDP's buckets counted on top of the single-card step's "
                         "max_memory_reserved"))
        notes.append(f"a rank's batch certified (one more sample measured over): "
                     f"{RESERVED_CERTIFICATE}")
    if obs.m > 1:
        notes.append("the model has BatchNorm: every rank gets at least 2 samples (or use "
                     "SyncBatchNorm, whose statistics span the global batch)")
    return tuple(notes)
