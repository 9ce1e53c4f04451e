"""The settings of every entry point, as small frozen objects checked once.

- :class:`Budget`: what each card's peak is checked against (level, headroom, the allocator
  model's options); :meth:`Budget.at` builds one from the user's words.
- :class:`SearchSettings`: how hard the search looks (probes, tolerance, verbosity).
- :class:`~dptune.backends.simulated.ddp_memory.DDPOptions` and
  :class:`dptune.ddp.fsdp.FSDPOptions`: the strategy's own arguments (``strategy=``).
- :class:`Settings`: everything one tuner or plan was asked for (:meth:`Settings.for_tuner`,
  :meth:`Settings.for_plan`).

:class:`dptune.Tuner`, :func:`dptune.ddp.plan` and :func:`dptune.lengths.plan_lengths` take
these objects (``budget=``, ``search=``, ``strategy=``); the keywords of the step (``amp``,
``accumulate``, ``clip_grad_norm``, ``step``) and the budget's and the search's own keywords
(``headroom=``, ``max_probes=``, ...) are accepted as a shorthand and sorted into the objects
once (:func:`sort_keywords`). Every mistake is one :class:`dptune.errors.UsageError` (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.backends.simulated.reserved import ReservedModel, level_settings
from dptune.budget import DEFAULT_LEVEL, BudgetLevel, real_cards_measured
from dptune.errors import UsageError
from dptune.split import MAX_BATCH_SIZE
from dptune.types import Objective, Strategy

__all__ = ["Budget", "SearchSettings", "Settings", "Strategy", "Keywords",
           "sort_keywords", "check_int", "STEP_KEYWORDS"]


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
    def at(cls, level: Any = None, headroom: Any = None, allocator: Any = None,
           nccl_bytes: Any = None) -> "Budget":
        """The budget a user asks for: ``level`` ``"reserved"`` (the default) or
        ``"allocated"``; ``headroom`` kept free on every card (bytes or ``"1GiB"``; default
        per level); ``allocator`` (``PYTORCH_CUDA_ALLOC_CONF`` syntax) and ``nccl_bytes`` (NCCL's
        buffers per card) for the allocator model of simulated cards."""
        return cls.of(DEFAULT_LEVEL.value if level is None else level, headroom, allocator, nccl_bytes)

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
    The planner's: ``ddp`` (the DDP arguments), ``strategy``, ``fsdp_options`` (FSDP2's),
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
    fsdp_options: Any = None       # a dptune.ddp.fsdp.FSDPOptions with strategy FSDP
    device: Optional[int] = None
    micro_batches: Union[int, str] = 1

    @property
    def fsdp(self) -> bool:
        return self.strategy is Strategy.FSDP

    @classmethod
    def for_tuner(cls, *, batch_size: Any, objective: Any, budget: "Budget", search: "SearchSettings",
                  device_ids: Optional[Sequence[int]], simulate: Any, output_device: Any,
                  choice: Any = None) -> "Settings":
        """:class:`dptune.Tuner`'s settings (``choice``: cards already chosen)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size > MAX_BATCH_SIZE:
            raise UsageError(f"batch_size={batch_size} is beyond what any cluster holds (at most "
                             f"{MAX_BATCH_SIZE:,} samples); give the total batch over all cards")
        goal = Objective.parse(objective)
        if choice is not None and (device_ids is not None or simulate is not None):
            raise UsageError("give the cards once: choice= (already chosen) or device_ids= / "
                             "simulate=, not both")
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
        return cls(objective=goal, batch_size=batch_size, budget=budget, max_probes=search.max_probes,
                   simulate=simulate, tolerance=search.tolerance, device_ids=ids,
                   output_device=output_device, verbose=search.verbose)

    @classmethod
    def for_plan(cls, *, global_batch: Any, objective: Any, budget: "Budget", max_rounds: Any,
                 simulate: Any, strategy: Strategy, ddp: DDPOptions, fsdp: Any, device: Any,
                 micro_batches: Any = 1) -> "Settings":
        """:func:`dptune.ddp.plan`'s settings (``objective=None``: the default; ``fsdp``: the
        FSDP2 options, a :class:`dptune.ddp.fsdp.FSDPOptions`, with ``strategy=Strategy.FSDP``)."""
        goal = None if objective is None else Objective.parse(objective)
        if global_batch is not None:
            check_int("global_batch", global_batch, 1)
        if goal is not Objective.MAX_BATCH and global_batch is None:
            what = "the default objective (the fastest split that fits)" if goal is None \
                else f"objective={goal.value!r}"
            raise UsageError(f"{what} splits a global batch: pass global_batch=N "
                             "(or objective='max_batch' for the largest that fits)")
        check_int("max_rounds", max_rounds, 3)
        if strategy is Strategy.FSDP and goal is Objective.THROUGHPUT:
            raise UsageError("objective='throughput' is not available with strategy='fsdp' "
                             "(FSDP's all-gathers and reduce-scatters are not timed); use "
                             "'balance' or 'max_batch'")
        _check_micro_batches(micro_batches, global_batch, goal, strategy)
        return cls(objective=goal, batch_size=global_batch, budget=budget, max_probes=max_rounds,
                   simulate=simulate, ddp=ddp, strategy=strategy, fsdp_options=fsdp, device=device,
                   micro_batches=micro_batches)


@dataclass(frozen=True)
class SearchSettings:
    """How hard the search looks: ``max_probes`` (the most training steps run, each a probe;
    a length plan's per bucket), ``tolerance`` (the largest miss between a prediction and a
    probe for the fit to be trusted, as a fraction of the card's budget) and ``verbose`` (a
    progress bar and notices on stderr)."""

    max_probes: int = 12
    tolerance: float = 0.02
    verbose: bool = True

    def __post_init__(self) -> None:
        check_int("max_probes", self.max_probes, 3)
        t = self.tolerance
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and 0 < t < 1):
            raise UsageError(f"tolerance must be a fraction of the budget in (0, 1), got {t!r}")
        object.__setattr__(self, "tolerance", float(t))
        object.__setattr__(self, "verbose", bool(self.verbose))


#: the training step's keywords (:class:`dptune.step.workload.Workload`'s settings)
STEP_KEYWORDS = ("amp", "accumulate", "clip_grad_norm", "step")
_BUDGET_KEYWORDS = {"headroom": "headroom", "budget_level": "level", "allocator": "allocator",
                    "nccl_bytes": "nccl_bytes"}
_SEARCH_KEYWORDS = ("max_probes", "tolerance", "verbose")


@dataclass(frozen=True)
class Keywords:
    """An entry point's ``**keywords``, sorted: the step's settings, the budget, the search
    settings and the entry point's own remaining options."""

    step: Mapping[str, Any]
    budget: Budget
    search: SearchSettings
    rest: Mapping[str, Any]


def sort_keywords(entry: str, keywords: Mapping[str, Any], *, budget: Optional[Budget] = None,
                  search: Optional[SearchSettings] = None,
                  search_default: SearchSettings = SearchSettings(),
                  own: Sequence[str] = (), takes_search: bool = True) -> Keywords:
    """Sort ``keywords`` given to ``entry`` (e.g. ``"Tuner()"``) into the objects they shorten.

    The budget's keywords (``headroom``, ``budget_level``, ``allocator``, ``nccl_bytes``) may
    not be given beside ``budget=``, nor the search's (``max_probes``, ``tolerance``,
    ``verbose``) beside ``search=``; ``own`` names the entry point's other keywords
    (``takes_search=False``: an entry point without search settings). Anything else is a
    :class:`UsageError` that lists what ``entry`` takes.
    """
    known = set(STEP_KEYWORDS) | set(_BUDGET_KEYWORDS) | set(own)
    known |= set(_SEARCH_KEYWORDS) if takes_search else set()
    unknown = sorted(set(keywords) - known)
    if unknown:
        objects = "budget=, search=" if takes_search else "budget="
        raise UsageError(f"{entry} got unexpected keyword(s) {', '.join(unknown)}; it takes "
                         f"{', '.join(sorted(known))}, and the objects {objects}")
    # None is every budget keyword's default: not given
    asked = {_BUDGET_KEYWORDS[k]: v for k, v in keywords.items() if k in _BUDGET_KEYWORDS and v is not None}
    if budget is not None and asked:
        raise UsageError(f"{entry}: give the budget once, budget= or "
                         f"{', '.join(k for k in _BUDGET_KEYWORDS if keywords.get(k) is not None)}, "
                         "not both")
    looks = {k: v for k, v in keywords.items() if k in _SEARCH_KEYWORDS}
    if search is not None and looks:
        raise UsageError(f"{entry}: give the search settings once, search= or "
                         f"{', '.join(sorted(looks))}, not both")
    if budget is not None and not isinstance(budget, Budget):
        raise UsageError(f"{entry}: budget must be a dptune.Budget (Budget.at(level=..., "
                         f"headroom=...)), got {type(budget).__name__}")
    if search is not None and not isinstance(search, SearchSettings):
        raise UsageError(f"{entry}: search must be a dptune.SearchSettings, got {type(search).__name__}")
    if search is None:
        search = SearchSettings(**{**search_default.__dict__, **looks})
    return Keywords(step={k: v for k, v in keywords.items() if k in STEP_KEYWORDS},
                    budget=budget if budget is not None else Budget.at(**asked), search=search,
                    rest={k: v for k, v in keywords.items() if k in own})


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
