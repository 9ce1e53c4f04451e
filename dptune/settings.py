"""One frozen settings object for the tuner and the DDP planner, checked once.

:class:`dptune.Tuner` and :func:`dptune.ddp.plan` take their settings as keyword arguments
(their public signatures); each builds one :class:`Settings` from them
(:meth:`Settings.for_tuner`, :meth:`Settings.for_plan`), which checks every value once, with
one message per mistake (:class:`dptune.errors.UsageError`, exit code 2). What both share (the
objective, the batch, the memory budget, the probe limit, the cards) has one check; what only
one of them takes is kept beside it, with its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.backends.simulated.reserved import BudgetLevel, ReservedModel, level_settings, real_cards_measured
from dptune.errors import UsageError
from dptune.split import MAX_BATCH_SIZE
from dptune.types import Objective, Strategy

__all__ = ["Budget", "Settings", "Strategy", "check_int"]


def check_int(name: str, value: Any, least: int) -> int:
    """``value`` as an int ``>= least`` (not a bool), else a :class:`UsageError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise UsageError(f"{name} must be an int >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class Budget:
    """What each card's peak is checked against: the level (allocated or reserved), the
    headroom kept free (bytes), the allocator model of simulated cards at the reserved level,
    and which of its options were given (they apply to simulated cards only)."""

    level: BudgetLevel = BudgetLevel.ALLOCATED
    headroom_bytes: int = 0
    reserved: Optional[ReservedModel] = None
    model_options: tuple[str, ...] = ()

    @classmethod
    def of(cls, budget_level: Any, headroom: Any, allocator: Any, nccl_bytes: Any) -> "Budget":
        # the allocator model only at the reserved level (the environment is read only then)
        level, room, reserved = level_settings(budget_level, headroom, allocator, nccl_bytes)
        given = tuple(n for n, v in (("allocator", allocator), ("nccl_bytes", nccl_bytes))
                      if v is not None)
        return cls(level, room, reserved, given)

    def check_cards(self, simulated: bool) -> None:
        """The allocator model's options describe simulated cards: refused on real ones."""
        if not simulated and self.model_options:
            raise UsageError(real_cards_measured(list(self.model_options)))


@dataclass(frozen=True)
class Settings:
    """Everything a tuner or a DDP plan is asked for, checked.

    Shared: ``objective`` (``None``: the DDP plan's default, the fastest split that fits, see
    :mod:`dptune.ddp.planner`), ``batch_size`` (the tuner's total batch, the plan's
    ``global_batch``), ``budget``, ``max_probes`` (the tuner's probes, the plan's rounds) and
    ``simulate``. The tuner's: ``tolerance``, ``device_ids``, ``output_device``, ``verbose``.
    The planner's: ``ddp`` (the DDP arguments), ``strategy``, the FSDP2 arguments,
    ``device`` and ``micro_batches`` (the global batch trained as that many micro-batches with
    gradient accumulation; ``"auto"``: the planner chooses).
    """

    objective: Optional[Objective]
    batch_size: Optional[int]
    budget: Budget
    max_probes: int
    simulate: Any = None
    tolerance: float = 0.02
    device_ids: Optional[tuple[int, ...]] = None
    output_device: Union[int, str] = 0
    verbose: bool = True
    ddp: DDPOptions = DDPOptions()
    strategy: Strategy = Strategy.DDP
    shard: Optional[Callable[..., Any]] = None
    reshard_after_forward: bool = True
    mp_policy: Any = None
    device: Optional[int] = None
    micro_batches: Union[int, str] = 1

    @property
    def fsdp(self) -> bool:
        return self.strategy is Strategy.FSDP

    @classmethod
    def for_tuner(cls, *, batch_size: Any, objective: Any, headroom: Any, budget_level: Any,
                  allocator: Any, nccl_bytes: Any, max_probes: Any, tolerance: Any,
                  device_ids: Optional[Sequence[int]], simulate: Any, output_device: Any,
                  verbose: Any, choice: Any = None) -> "Settings":
        """:class:`dptune.Tuner`'s arguments (``choice``: cards already chosen)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size > MAX_BATCH_SIZE:
            raise UsageError(f"batch_size={batch_size} is beyond what any cluster holds (at most "
                             f"{MAX_BATCH_SIZE:,} samples); give the total batch over all cards")
        goal = Objective.parse(objective)
        if choice is not None and (device_ids is not None or simulate is not None):
            raise UsageError("give the cards once: choice= (already chosen) or device_ids= / "
                             "simulate=, not both")
        budget = Budget.of(budget_level, headroom, allocator, nccl_bytes)
        check_int("max_probes", max_probes, 3)
        if not (isinstance(tolerance, (int, float)) and 0 < tolerance < 1):
            raise UsageError(f"tolerance must be a fraction of the budget in (0, 1), got {tolerance!r}")
        ids = None if device_ids is None else tuple(device_ids)
        if ids is not None and (not ids or any(isinstance(d, bool) or not isinstance(d, int)
                                               or d < 0 for d in ids)):
            raise UsageError(f"device_ids must be a non-empty list of GPU indices, got {list(ids)!r}")
        if not (output_device == "auto" or (isinstance(output_device, int)
                                            and not isinstance(output_device, bool)
                                            and output_device >= 0)):
            raise UsageError(f"output_device must be a card index >= 0 or 'auto', got {output_device!r}")
        if goal is Objective.THROUGHPUT and output_device != 0:
            raise UsageError("objective='throughput' gathers the outputs on card 0; "
                             "output_device is not supported with it yet")
        return cls(objective=goal, batch_size=batch_size, budget=budget, max_probes=max_probes,
                   simulate=simulate, tolerance=float(tolerance), device_ids=ids,
                   output_device=output_device, verbose=bool(verbose))

    @classmethod
    def for_plan(cls, *, global_batch: Any, objective: Any, headroom: Any, budget_level: Any,
                 allocator: Any, nccl_bytes: Any, max_rounds: Any, simulate: Any,
                 bucket_cap_mb: Any, gradient_as_bucket_view: Any, strategy: Any, shard: Any,
                 reshard_after_forward: Any, mp_policy: Any, device: Any,
                 micro_batches: Any = 1) -> "Settings":
        """:func:`dptune.ddp.plan`'s arguments (``objective=None``: the default)."""
        goal = None if objective is None else Objective.parse(objective)
        if global_batch is not None:
            check_int("global_batch", global_batch, 1)
        if goal is not Objective.MAX_BATCH and global_batch is None:
            what = "the default objective (the fastest split that fits)" if goal is None \
                else f"objective={goal.value!r}"
            raise UsageError(f"{what} splits a global batch: pass global_batch=N "
                             "(or objective='max_batch' for the largest that fits)")
        check_int("max_rounds", max_rounds, 3)
        budget = Budget.of(budget_level, headroom, allocator, nccl_bytes)
        options = DDPOptions(bucket_cap_mb, gradient_as_bucket_view)
        if strategy not in tuple(Strategy):
            raise UsageError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")
        how = Strategy(strategy)
        if how is Strategy.FSDP:
            if goal is Objective.THROUGHPUT:
                raise UsageError("objective='throughput' is not available with strategy='fsdp' "
                                 "(FSDP's all-gathers and reduce-scatters are not timed); use "
                                 "'balance' or 'max_batch'")
        elif shard is not None or mp_policy is not None or reshard_after_forward is not True:
            raise UsageError("shard, reshard_after_forward and mp_policy are FSDP's: pass strategy='fsdp'")
        _check_micro_batches(micro_batches, global_batch, goal, how)
        return cls(objective=goal, batch_size=global_batch, budget=budget, max_probes=max_rounds,
                   simulate=simulate, ddp=options, strategy=how, shard=shard,
                   reshard_after_forward=reshard_after_forward, mp_policy=mp_policy, device=device,
                   micro_batches=micro_batches)


def _check_micro_batches(micro: Any, global_batch: Optional[int], goal: Optional[Objective],
                         how: Strategy) -> None:
    """``plan(micro_batches=...)``: 1, a divisor of ``global_batch``, or ``"auto"`` (the
    fastest number of micro-batches, DDP's default or throughput objective)."""
    if micro == 1 and not isinstance(micro, bool):
        return
    if micro == "auto":
        if goal not in (None, Objective.THROUGHPUT) or how is not Strategy.DDP:
            raise UsageError("micro_batches='auto' chooses the fastest number of micro-batches: "
                             "it needs the DDP strategy and objective 'throughput' (the default)")
        return
    if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
        raise UsageError(f"micro_batches must be an int >= 1 or 'auto', got {micro!r}")
    if goal is Objective.MAX_BATCH or global_batch is None or global_batch % micro:
        raise UsageError(f"micro_batches={micro} trains global_batch as {micro} equal "
                         f"micro-batches: give a global_batch it divides, and objective "
                         f"'throughput' or 'balance' (got {global_batch!r})")
