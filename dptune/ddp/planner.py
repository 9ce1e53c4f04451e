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
not depend on each other). The plan uses :mod:`dptune.solver`'s fits and splits with
``every_card=True`` (no rank may sit out a step):

1. every rank probes the smallest batch (1, or 2 with BatchNorm); a rank over its budget
   there makes the plan infeasible;
2. every rank probes a second batch (its budget's share of ``global_batch`` for
   ``balance``, ``8×`` the first for ``max_batch``);
3. ``balance``: fit each rank on its two probes nearest the proposal, solve the split of
   ``global_batch`` that equalises the shares of budget, probe it; repeat until a proposal
   is measured within budget on every rank. ``max_batch``: each rank's largest batch is
   bracketed (largest measured within budget, smallest measured over), secant and
   bisection steps alternating, until every bracket is closed (``certified``) or the
   rounds run out; with ``global_batch`` given and more fitting, that batch is balanced.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, TypeVar, Union

from dptune.backends.allocator_config import AllocatorConfig
from dptune.backends.ddp_memory import DDPOptions, bucket_bytes, params_of
from dptune.backends.fixed_costs import FixedCosts
from dptune.backends.reserved import (BudgetLevel, ReservedModel, at_level, level_settings,
                                      real_cards_measured)
from dptune.backends.reserved import DEFAULT_LEVEL
from dptune.ddp.ranks import RankInfo as _RankInfo
from dptune.ddp.ranks import min_batch as _min_batch
from dptune.ddp.ranks import step_settings as _settings
from dptune.ddp.result import DDPPlan, RankPlan, RankProbe, loss_scales
from dptune.errors import (BackendUnavailableError, DptuneError, NoFeasibleSplitError, UsageError,
                           UserCodeError)
from dptune.solver import MIN_SLOPE_BYTES, Fit, fit_affine, solve_balance
from dptune.units import format_bytes

__all__ = ["plan", "OBJECTIVES"]

OBJECTIVES = ("balance", "max_batch", "throughput")
STRATEGIES = ("ddp", "fsdp")
T = TypeVar("T")


# ---- one rank's card ---------------------------------------------------------------------

class _Prober(Protocol):
    def info(self) -> _RankInfo: ...
    def probe(self, batch_size: int) -> Optional[int]:
        """Peak bytes of one step, or ``None`` when it ran out of memory."""
        ...
    def close(self) -> None: ...


class _SimulatedProber:
    """Rank ``rank`` on card ``rank`` of a simulated cluster."""

    def __init__(self, workload: Any, cluster: Any, rank: int, options: DDPOptions,
                 headroom_bytes: int, host: Optional[str], shared: Optional[dict] = None,
                 reserved: Optional[ReservedModel] = None):
        from dptune.backends.simulated_ddp import SimulatedDDPRank, card_of
        from dptune.workload import model_name

        self.device = cluster.devices[rank]
        # a rank's peak depends only on its card type: ranks simulated in one process share
        # one simulator and its results per card type
        shared = {} if shared is None else shared
        card = cluster.names[rank]
        if card not in shared:
            # at the reserved level each rank's trace is replayed through the allocator model,
            # NCCL's buffers as for a world of all the ranks (as SimulatedDDP(reserved=...))
            model = None if reserved is None else dataclasses.replace(
                reserved, fixed=FixedCosts(reserved.fixed.nccl_for(len(cluster))))
            shared[card] = (SimulatedDDPRank(workload, card_of(cluster, rank), options, model), {})
        self.backend, self._memo = shared[card]
        self.workload, self.headroom, self.host = workload, headroom_bytes, host
        self.name = model_name(workload.model)

    def info(self) -> _RankInfo:
        ddp = self.backend.ddp_bytes()
        return _RankInfo(device=self.device, host=self.host,
                         budget_bytes=self.device.budget_bytes(self.headroom), ddp_bytes=ddp,
                         min_batch=_min_batch(self.workload.model), model_name=self.name,
                         settings=_settings(self.workload))

    def probe(self, batch_size: int) -> Optional[int]:
        if batch_size not in self._memo:
            self._memo[batch_size] = (
                self.backend.estimate([batch_size]).peak_bytes[0] if self.backend.reserved is None
                else at_level(self.backend.probe([batch_size]), [self.device],
                              BudgetLevel.RESERVED).peak_bytes[0])
        return self._memo[batch_size]

    def close(self) -> None:
        self.backend.close()


class _CudaProber:
    """This process's CUDA card: the single-card step measured, DDP's buckets counted."""

    def __init__(self, workload: Any, device_index: int, options: DDPOptions, headroom_bytes: int,
                 host: Optional[str], level: BudgetLevel = BudgetLevel.ALLOCATED):
        from dptune.backends.cuda import CudaBackend
        from dptune.workload import model_name

        self.backend = CudaBackend(workload, device_ids=[device_index])
        self.workload, self.options, self.headroom, self.host = workload, options, headroom_bytes, host
        self.name = model_name(workload.model)
        self._ddp: Optional[int] = None
        self.level = level

    def _ddp_bytes(self) -> int:
        if self._ddp is None:
            import torch

            model = self.workload.model
            if not isinstance(model, torch.nn.Module):
                with torch.device("meta"):
                    model = model()
            self._ddp = bucket_bytes(params_of(model), self.options)
        return self._ddp

    def info(self) -> _RankInfo:
        device = self.backend.devices[0]
        return _RankInfo(device=device, host=self.host, budget_bytes=device.budget_bytes(self.headroom),
                         ddp_bytes=self._ddp_bytes(), min_batch=_min_batch(self.workload.model),
                         model_name=self.name, settings=_settings(self.workload))

    def probe(self, batch_size: int) -> Optional[int]:
        res = at_level(self.backend.probe([batch_size]), self.backend.devices, self.level)
        if not res.feasible:
            return None
        return res.peak_bytes[0] + self._ddp_bytes()

    def close(self) -> None:
        self.backend.close()


# ---- the ranks together ---------------------------------------------------------------------

class _Group(Protocol):
    world_size: int

    def each(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` for every rank; the results in rank order, on every rank."""
        ...


class _LocalGroup:
    """All ranks simulated in this process, one after another."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def each(self, fn: Callable[[int], T]) -> list[T]:
        return [fn(r) for r in range(self.world_size)]


@dataclass(frozen=True)
class _Failed:
    rank: int
    kind: str
    message: str


_ERRORS: dict[str, type] = {c.__name__: c for c in (UsageError, NoFeasibleSplitError,
                                                     BackendUnavailableError, UserCodeError)}


class _TorchGroup:
    """This process is one rank of an initialised ``torch.distributed`` job."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def each(self, fn: Callable[[int], T]) -> list[T]:
        mine: Any
        error: Optional[BaseException] = None
        try:
            mine = fn(self.rank)
        except Exception as e:  # gathered, then raised on every rank
            error = e
            mine = _Failed(self.rank, type(e).__name__, str(e))
        gathered: list[Any] = [None] * self.world_size
        self.dist.all_gather_object(gathered, mine)
        failed = [g for g in gathered if isinstance(g, _Failed)]
        if error is not None:
            raise error
        if failed:
            f = failed[0]
            cls = _ERRORS.get(f.kind, DptuneError)
            raise cls(f"rank {f.rank} failed while planning ({f.kind}): {f.message}")
        return gathered


# ---- the plan ------------------------------------------------------------------------------

class _State:
    """What every rank knows: each rank's card and every probe so far."""

    def __init__(self, infos: Sequence[_RankInfo]):
        self.infos = list(infos)
        self.n = len(infos)
        self.budgets = [i.budget_bytes for i in infos]
        self.m = max(i.min_batch for i in infos)
        self.probes: list[RankProbe] = []
        self.rounds = 0

    def of(self, r: int) -> list[RankProbe]:
        return [p for p in self.probes if p.rank == r]

    def measured(self, r: int, b: int) -> Optional[RankProbe]:
        for p in self.of(r):
            if p.batch_size == b:
                return p
        return None

    def lo(self, r: int) -> int:
        return max([p.batch_size for p in self.of(r) if p.fits], default=0)

    def hi(self, r: int) -> Optional[int]:
        over = [p.batch_size for p in self.of(r) if not p.fits]
        return min(over) if over else None

    def caps(self) -> list[Optional[int]]:
        return [None if (h := self.hi(r)) is None else h - 1 for r in range(self.n)]

    def fit(self, r: int, near: int) -> Fit:
        """An affine fit of rank r's peak on the two probes nearest ``near`` (a known-over
        point with no peak stands for the budget there)."""
        pts = {p.batch_size: float(p.peak_bytes) for p in self.of(r) if p.peak_bytes is not None}
        for p in self.of(r):
            if p.peak_bytes is None and p.batch_size not in pts:
                pts[p.batch_size] = float(self.budgets[r])
        order = sorted(pts, key=lambda b: (abs(b - near), -b))
        # the nearest point and the nearest with another peak: at the reserved level peaks are
        # a staircase (segments, 2 MiB rounding), whose flat steps would make a flat line
        other = [b for b in order[1:] if pts[b] != pts[order[0]]]
        chosen = order[:1] + other[:1] if other else order[:2]
        if len(chosen) < 2:
            b = chosen[0]
            return Fit(intercept_bytes=pts[b] - MIN_SLOPE_BYTES * b, slope_bytes=MIN_SLOPE_BYTES, points=1)
        return fit_affine([(b, pts[b]) for b in chosen])

    def run(self, group: _Group, sizes: Sequence[Optional[int]],
            probe: Callable[[int, int], Optional[int]]) -> None:
        """One round: rank r probes ``sizes[r]`` (``None``: it sits this round out)."""
        self.rounds += 1
        rnd = self.rounds

        def one(r: int) -> Optional[RankProbe]:
            b = sizes[r]
            if b is None:
                return None
            peak = probe(r, b)
            return RankProbe(rank=r, batch_size=b, peak_bytes=peak,
                             fits=peak is not None and peak <= self.budgets[r], round=rnd)

        for p in group.each(one):
            if p is not None:
                self.probes.append(p)


def _cap_of(fit: Fit, budget: int) -> int:
    x = (budget - fit.intercept_bytes) / max(fit.slope_bytes, MIN_SLOPE_BYTES)
    return int(math.floor(x)) if x < 1 << 50 else 1 << 50


def _describe_rank(info: _RankInfo, r: int) -> str:
    where = f"{info.host}:" if info.host else ""
    return f"rank {r} ({where}{info.device.name}, budget {format_bytes(info.budget_bytes)})"


def _first_rounds(state: _State, group: _Group, probe: Callable[[int, int], Optional[int]],
                  second: Sequence[int]) -> None:
    m = state.m
    state.run(group, [m] * state.n, probe)
    bad = [r for r in range(state.n) if not state.measured(r, m).fits]  # type: ignore[union-attr]
    if bad:
        parts = []
        short = 0
        for r in bad:
            p = state.measured(r, m)
            assert p is not None
            if p.peak_bytes is None:
                parts.append(f"{_describe_rank(state.infos[r], r)} runs out of memory")
            else:
                over = p.peak_bytes - state.budgets[r]
                short = max(short, over)
                parts.append(f"{_describe_rank(state.infos[r], r)} needs "
                             f"{format_bytes(p.peak_bytes)}, {format_bytes(over)} over")
        raise NoFeasibleSplitError(
            f"no plan fits: with {m} sample{'s' if m > 1 else ''} per rank, " + "; ".join(parts)
            + ". Every rank runs every step; free memory on that card, lower the headroom, "
            + ("use gradient_as_bucket_view=True, " if any(i.ddp_bytes for i in state.infos) else "")
            + "or leave that card out of the job.",
            shortfall_bytes=short or None)
    state.run(group, [max(m + 1, b) for b in second], probe)


def _balance(state: _State, group: _Group, probe: Callable[[int, int], Optional[int]],
             global_batch: int, max_rounds: int, near: Sequence[int]) -> list[int]:
    n, m = state.n, state.m
    tried: set[tuple[int, ...]] = set()
    last = list(near)
    while True:
        fits = [state.fit(r, last[r]) for r in range(n)]
        caps = state.caps()
        try:
            split = solve_balance(fits, state.budgets, global_batch, min_chunk_nonzero=m,
                                  caps=caps, every_card=True, strict=True)
        except NoFeasibleSplitError:
            known = [c for c in caps if c is not None]
            if len(known) == n and sum(known) < global_batch:   # more than the ranks hold
                raise _beyond_the_ranks(state, group, probe, global_batch, max_rounds) from None
            raise
        done = [state.measured(r, b) for r, b in enumerate(split)]
        if all(p is not None and p.fits for p in done) or tuple(split) in tried \
                or state.rounds >= max_rounds:
            break
        tried.add(tuple(split))
        state.run(group, [None if d is not None else b for d, b in zip(done, split)], probe)
        last = split
    if all((p := state.measured(r, b)) is not None and p.fits for r, b in enumerate(split)):
        return split
    # fall back to the best split measured within budget on every rank
    best: Optional[tuple[float, list[int]]] = None
    for cand in tried:
        ps = [state.measured(r, b) for r, b in enumerate(cand)]
        if all(p is not None and p.fits and p.peak_bytes is not None for p in ps):
            worst = max(p.peak_bytes / state.budgets[r] for r, p in enumerate(ps))  # type: ignore[union-attr,operator]
            if best is None or worst < best[0]:
                best = (worst, list(cand))
    if best is None:
        raise NoFeasibleSplitError(
            f"no split of the global batch {global_batch} was measured within every rank's budget "
            f"in {state.rounds} rounds; try a smaller global_batch or a larger max_rounds",
            shortfall_bytes=None)
    return best[1]


def _beyond_the_ranks(state: _State, group: _Group, probe: Callable[[int, int], Optional[int]],
                      global_batch: int, max_rounds: int) -> NoFeasibleSplitError:
    """``global_batch`` is more than the ranks' measured caps add up to: bracket each rank's
    largest batch (as ``max_batch`` does) and say how many samples the ranks take together,
    a figure measured on the cards, not read off the probes that happened to be over."""
    closed = _max_batch(state, group, probe, max_rounds, None)
    n = state.n
    fit = [state.lo(r) for r in range(n)]
    over = [state.hi(r) for r in range(n)]
    most = sum(fit) if closed else sum(fit[r] if h is None else h - 1 for r, h in enumerate(over))
    bound = f"the ranks take at most {most} samples together"
    if not closed:
        bound += f" ({sum(fit)} measured to fit; not every rank bracketed in {state.rounds} rounds)"
    elif n <= 8:
        bound += f" ({', '.join(f'rank {r}: {b}' for r, b in enumerate(fit))})"
    return NoFeasibleSplitError(
        f"no split of the global batch {global_batch} is possible: {bound}, each rank probed up "
        f"to its budget. Try a global batch of at most {sum(fit)} (--batch-size), or more cards.",
        shortfall_bytes=None)


def _max_batch(state: _State, group: _Group, probe: Callable[[int, int], Optional[int]],
               max_rounds: int, limit: Optional[int], staircase: bool = False) -> bool:
    """Bracket each rank's largest batch; returns whether every bracket closed.

    ``staircase``: peaks rise in steps (the reserved level: whole segments), where a line
    through two probes says little near the edge of a step: a rank whose line says it is at
    its limit with no batch yet measured over probes ``lo + lo/256`` (not ``lo + 1``) to find
    one, and a bracket is closed by bisection alone."""
    n = state.n
    bisect_next = [False] * n
    while state.rounds < max_rounds:
        if limit is not None and sum(state.lo(r) for r in range(n)) >= limit:
            return False
        sizes: list[Optional[int]] = []
        for r in range(n):
            lo, hi = state.lo(r), state.hi(r)
            if hi is not None and hi <= lo + 1:
                sizes.append(None)
                continue
            if hi is not None and (bisect_next[r] or staircase):
                x = (lo + hi) // 2
            else:
                x = _cap_of(state.fit(r, lo), state.budgets[r])
                x = max(x, lo + 1)
                if hi is not None:
                    x = min(x, hi - 1)
                else:
                    if staircase and x == lo + 1:
                        x = lo + max(1, lo // 256)
                    x = min(x, max(64 * lo, lo + 1))    # at most 64x past what is known to fit
                    if limit is not None:
                        x = min(x, max(limit, lo + 1))
            bisect_next[r] = not bisect_next[r]
            sizes.append(x)
        if all(s is None for s in sizes):
            return True
        state.run(group, sizes, probe)
    return all((h := state.hi(r)) is not None and h <= state.lo(r) + 1 for r in range(n))


def plan(model: Any, sample: Callable[[int], Any], loss_fn: Optional[Callable[..., Any]] = None,
         optimizer: Optional[Callable[..., Any]] = None, *, global_batch: Optional[int] = None,
         objective: str = "balance", simulate: Optional[Union[str, Any]] = None,
         headroom: Union[int, str, None] = None, bucket_cap_mb: Optional[float] = None,
         gradient_as_bucket_view: bool = False, max_rounds: int = 16,
         device: Optional[int] = None, strategy: str = "ddp", shard: Optional[Callable] = None,
         reshard_after_forward: bool = True, mp_policy: Any = None,
         budget_level: str = DEFAULT_LEVEL.value, allocator: Union[str, AllocatorConfig, None] = None,
         nccl_bytes: Union[int, str, None] = None, **step_options: Any) -> DDPPlan:
    """Per-rank batch sizes for ``DistributedDataParallel`` on unequal cards.

    ``model``, ``sample``, ``loss_fn``, ``optimizer`` and ``step_options`` (``amp``,
    ``accumulate``, ``clip_grad_norm``, ``step``) describe one rank's training step as for
    :class:`dptune.Tuner`; ``sample(b)`` builds a local batch of ``b``.

    - ``objective="balance"``: split ``global_batch`` so every rank uses the same share of
      its budget. ``"max_batch"``: the largest global batch, each rank at its own limit
      (at most ``global_batch`` when given).
    - ``simulate``: a cluster spec such as ``"2x32GB,2x24GB"``, one rank per card. Without a
      process group the whole plan is made in this process; inside a ``torchrun`` job rank
      r simulates card r. Inside a job without ``simulate``, each rank probes its own CUDA
      card (``device``, default ``torch.cuda.current_device()``): call ``plan`` on every rank.
    - ``headroom``: kept free on every card (default 256 MiB at the reserved level, the
      default; 1 GiB at ``budget_level="allocated"``);
      ``bucket_cap_mb``, ``gradient_as_bucket_view``: the DDP arguments you will use.
    - ``budget_level``, ``allocator``, ``nccl_bytes``: as :class:`dptune.Tuner`'s; at
      ``"reserved"`` (the default) each rank's peak is the caching allocator's reserved peak plus NCCL's
      buffers (simulated ranks: the allocator model; real cards: ``max_memory_reserved``).
    - ``strategy="fsdp"``: the model is sharded with FSDP2 (``fully_shard``) instead, by
      ``shard(model, mesh)`` or by default each ``ModuleList`` block then the root with
      ``reshard_after_forward`` and ``mp_policy``; simulated cards only (see
      :mod:`dptune.ddp.fsdp`).

    Every rank returns the same :class:`DDPPlan`. Raises :class:`NoFeasibleSplitError` (on
    every rank) when some rank cannot fit its share.
    """
    from dptune.backends.cluster import parse_cluster
    from dptune.backends.simulated_ddp import make_workload

    t0 = time.perf_counter()
    if objective not in OBJECTIVES:
        raise UsageError(f"objective must be 'balance', 'max_batch' or 'throughput', got {objective!r}")
    if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                     or global_batch < 1):
        raise UsageError(f"global_batch must be an int >= 1, got {global_batch!r}")
    if objective in ("balance", "throughput") and global_batch is None:
        raise UsageError(f"objective={objective!r} splits a global batch: pass global_batch=N "
                         "(or objective='max_batch' for the largest that fits)")
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 3:
        raise UsageError(f"max_rounds must be an int >= 3, got {max_rounds!r}")
    level, headroom_bytes, reserved = level_settings(budget_level, headroom, allocator, nccl_bytes)
    options = DDPOptions(bucket_cap_mb, gradient_as_bucket_view)
    if strategy not in STRATEGIES:
        raise UsageError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
    fsdp: Any = None
    if strategy == "fsdp":
        from dptune.ddp.fsdp import FSDPOptions

        fsdp = FSDPOptions(shard, reshard_after_forward, mp_policy)
        if simulate is None:
            raise UsageError("strategy='fsdp' plans on simulated cards only: pass simulate='...' "
                             "(one card per rank; inside a torchrun job too)")
    elif shard is not None or mp_policy is not None or reshard_after_forward is not True:
        raise UsageError("shard, reshard_after_forward and mp_policy are FSDP's: pass strategy='fsdp'")
    workload = make_workload(model, sample, loss_fn, optimizer, step_options)
    cluster = parse_cluster(simulate) if simulate is not None else None
    given = [n for n, v in (("allocator", allocator), ("nccl_bytes", nccl_bytes)) if v is not None]
    if cluster is None and given:
        raise UsageError(real_cards_measured(given))

    import torch.distributed as dist

    in_job = dist.is_available() and dist.is_initialized()
    group: _Group
    if in_job:
        group = _TorchGroup()
        host: Optional[str] = socket.gethostname()
        if cluster is not None and len(cluster) != group.world_size:
            raise UsageError(f"simulate={cluster.describe()!r} has {len(cluster)} cards but the job "
                             f"has {group.world_size} ranks; give one card per rank")
        backend = "simulated" if cluster is not None else "cuda"
    else:
        if cluster is None:
            raise UsageError(
                "not inside a torch.distributed job: pass simulate='2x32GB,2x24GB' (one card per "
                "rank) to plan offline, or call dptune.ddp.plan(...) on every rank of your torchrun "
                "job after init_process_group to probe the real cards")
        group = _LocalGroup(len(cluster))
        host = None
        backend = "simulated"
    probers: dict[int, _Prober] = {}
    shared: dict = {}
    timer = None
    if objective == "throughput" and (in_job or cluster is None):
        raise UsageError("objective='throughput' plans offline on the simulated cluster for now "
                         "(simulate=... without a process group); inside a job use 'balance'")
    if strategy == "fsdp" and objective == "throughput":
        raise UsageError("objective='throughput' is not available with strategy='fsdp' (FSDP's "
                         "all-gathers and reduce-scatters are not timed); use 'balance' or 'max_batch'")
    if cluster is not None and not in_job and strategy == "ddp":   # offline: its estimated speed
        from dptune.ddp.throughput import RankTimer

        timer = RankTimer(probers, cluster)
    why: tuple[str, ...] = ()

    def start(r: int) -> _RankInfo:
        # built inside the first round, so that a rank failing here fails every rank
        if strategy == "fsdp":
            from dptune.ddp.fsdp import SimulatedFSDPProber

            probers[r] = SimulatedFSDPProber(workload, cluster, r, fsdp, headroom_bytes, host, shared,
                                             reserved)
        elif cluster is not None:
            probers[r] = _SimulatedProber(workload, cluster, r, options, headroom_bytes, host, shared,
                                          reserved)
        else:
            probers[r] = _local_cuda_prober(workload, device, options, headroom_bytes, host, level)
        return probers[r].info()

    try:
        infos = group.each(start)
        state = _State(infos)

        def probe(r: int, b: int) -> Optional[int]:
            return probers[r].probe(b) if timer is None else timer.probe(r, b)

        n = state.n
        certified = False
        if objective in ("balance", "throughput"):
            assert global_batch is not None
            if global_batch < state.m * n:
                raise UsageError(f"global_batch {global_batch} is too small for {n} ranks: every rank "
                                 f"needs at least {state.m} sample{'s' if state.m > 1 else ''}")
            total = sum(state.budgets)
            second = [max(state.m + 1, global_batch * b // total) for b in state.budgets]
            _first_rounds(state, group, probe, second)
            if objective == "balance":
                sizes = _balance(state, group, probe, global_batch, max_rounds, second)
            else:
                from dptune.ddp.throughput import plan_throughput

                assert timer is not None
                fast = plan_throughput(state, lambda sz: state.run(group, sz, probe), timer,
                                       global_batch, max_rounds, infos[0].ddp_bytes, _cap_of)
                sizes, why = fast.sizes, fast.reasons + fast.notes
        else:
            _first_rounds(state, group, probe, [8 * state.m] * n)
            certified = _max_batch(state, group, probe, max_rounds, global_batch,
                                   staircase=level is BudgetLevel.RESERVED)
            sizes = [state.lo(r) for r in range(n)]
            if global_batch is not None and sum(sizes) > global_batch:
                sizes = _balance(state, group, probe, global_batch, max_rounds + 4, sizes)
                certified = False
        if timer is not None and objective != "throughput":
            from dptune.ddp.throughput import speed_note

            why = speed_note(state, timer, sizes, infos[0].ddp_bytes)
    finally:
        for p in probers.values():
            p.close()

    scales = loss_scales(sizes)
    ranks = []
    for r, (b, s) in enumerate(zip(sizes, scales)):
        info, fit = infos[r], state.fit(r, b)
        meas = state.measured(r, b)
        ranks.append(RankPlan(
            rank=r, batch_size=b, loss_scale=s, device=info.device, host=info.host,
            budget_bytes=info.budget_bytes, predicted_peak_bytes=int(round(fit.predict(b, 0))),
            measured_peak_bytes=None if meas is None else meas.peak_bytes, ddp_bytes=info.ddp_bytes,
            fit=fit, max_batch_size=state.lo(r) if objective == "max_batch" else None))
    notes = list(why)
    if strategy == "fsdp":
        notes.insert(0, f"strategy fsdp: {fsdp.describe()} (the DDP bucket settings do not apply)")
    if backend == "cuda":
        notes.append("measured peaks are the single-card step's max_memory_allocated plus the "
                     "counted DDP buckets" + (" (an upper bound with gradient_as_bucket_view)"
                                              if options.gradient_as_bucket_view else ""))
    if level is BudgetLevel.RESERVED:
        notes.append("budgets checked against the reserved level: each rank's peak is the caching "
                     "allocator's reserved peak plus NCCL's buffers" + (
                         f" ({format_bytes(reserved.fixed.nccl_for(n))} per rank); a model of the "
                         "allocator, not yet checked on hardware" if reserved is not None else
                         "; DDP's buckets counted on top of the single-card step's "
                         "max_memory_reserved"))
    if state.m > 1:
        notes.append("the model has BatchNorm: every rank gets at least 2 samples (or use "
                     "SyncBatchNorm, whose statistics span the global batch)")
    even = n * min(state.lo(r) for r in range(n)) if objective == "max_batch" else None
    return DDPPlan(
        ranks=tuple(ranks), objective=objective, backend=backend,
        cluster=(cluster.describe() if cluster is not None else
                 " + ".join(i.device.name for i in infos)),
        model_name=infos[0].model_name, headroom_bytes=headroom_bytes, options=options,
        settings=infos[0].settings, probes=tuple(state.probes), rounds=state.rounds,
        certified=certified, even_batch_size=even, requested_global_batch=global_batch,
        seconds=time.perf_counter() - t0, notes=tuple(notes), min_batch=state.m)


def _local_cuda_prober(workload: Any, device: Optional[int], options: DDPOptions,
                       headroom_bytes: int, host: Optional[str],
                       level: BudgetLevel = BudgetLevel.ALLOCATED) -> _Prober:
    import os

    import torch

    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "plan() inside a torch.distributed job probes each rank's CUDA card, but this rank "
            "sees none; pass simulate='...' (one card per rank) to plan on virtual cards")
    if device is None:
        local = os.environ.get("LOCAL_RANK")
        device = int(local) if local is not None and torch.cuda.device_count() > int(local) \
            else torch.cuda.current_device()
    return _CudaProber(workload, device, options, headroom_bytes, host, level)
