"""The budget policy: which figure each card's peak is checked at (:class:`BudgetLevel`, the
default :data:`DEFAULT_LEVEL`, :func:`at_level`), the headroom each level keeps by default
(:data:`DEFAULT_HEADROOM`), and what a card holds besides the caching allocator's segments
(:class:`FixedCosts`, NCCL's buffers per strategy: :class:`Collectives`), with sources.

A card's predicted use (what nvidia-smi shows for dptune's process) is

    reserved peak (the allocator model)  +  CUDA context  +  NCCL buffers

plus what other processes hold (``Device.used_bytes``, read from NVML on real cards). The
cuBLAS workspace is not a fixed cost here: torch 2.x takes it from the caching allocator, so
it is inside the allocated and reserved figures (the simulator allocates it on each busy card,
``Cluster.workspace_bytes``).

Figures (overridable; none of them was measured by dptune on hardware yet):

- CUDA context: ``Device.context_bytes`` (the cluster spec's ``context=``, default 384 MiB on
  the simulator; measured from NVML on real cards). Published figures it sits between:
  287 MB with lazy module loading (``CUDA_MODULE_LOADING=LAZY``, torch's default since 2.0)
  and 667 MB without, pytorch PR #86509; 300-400 MB reported in pytorch issues #107667 and
  #109888 (as cited in dptune issue 24). :data:`CONTEXT_BYTES` keeps them for reference.
- NCCL, per strategy (:class:`Collectives`), for runs of more than one card (a one-card run
  has none). NCCL's memory is its per-channel buffers (``NCCL_BUFFSIZE``, 4 MiB by default,
  per protocol, per connection); it grows linearly with the channels (more on faster links)
  and with the communicators, and depends on the algorithms connected (NVIDIA/nccl #986,
  maintainer's answer).

  - DataParallel: ``torch.cuda.comm.broadcast_coalesced`` and ``reduce_add_coalesced`` call
    ``torch.cuda.nccl`` (torch/csrc/cuda/comm.cpp), whose one single-process clique over the
    cards (``ncclCommInitAll``, torch/csrc/cuda/nccl.cpp) runs broadcast and reduce only
    (rings): no process group, none of DDP's communicators. Figure: NVIDIA/nccl #964, one
    communicator per device set with a 4 MB collective on A100s with NVLink: 544 MB per GPU
    on 2 devices, 688 MB on 3 or more (:data:`NCCL_CLIQUE_BYTES`).
  - DDP and FSDP2: the process group's communicator (DDP's all-reduce, which may connect
    trees as well as rings; FSDP2's all-gather and reduce-scatter on the same group): about
    1.6 GB per GPU for one communicator after an all-reduce, NVIDIA/nccl #864
    (:data:`NCCL_COMMUNICATOR_BYTES`), the larger published figure, kept for the strategies
    that run all-reduce in a process group.

  Set ``nccl_bytes`` (``--nccl-bytes``) to what ``NCCL_DEBUG=INFO`` or NVML shows on your
  system; none of these was measured by dptune.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Sequence

from dptune.errors import BackendUnavailableError, UsageError
from dptune.types import Device, ProbeResult

__all__ = ["CONTEXT_BYTES", "NCCL_COMMUNICATOR_BYTES", "NCCL_CLIQUE_BYTES", "Collectives",
           "FixedCosts",
           "BudgetLevel", "DEFAULT_LEVEL", "DEFAULT_HEADROOM", "parse_level", "real_cards_measured",
           "at_level"]

MB = 1000 * 1000
#: CUDA context figures from the sources above, by module loading mode (bytes).
CONTEXT_BYTES = {"lazy": 287 * MB, "eager": 667 * MB}
#: One NCCL communicator after an all-reduce, per GPU (NVIDIA/nccl #864: "about 1.6GB").
NCCL_COMMUNICATOR_BYTES = 1600 * MB
#: One communicator over 2 devices, and over 3 or more, per GPU (NVIDIA/nccl #964: 544 MB and
#: 688 MB on A100 with NVLink): DataParallel's single-process clique.
NCCL_CLIQUE_BYTES = {2: 544 * MB, 3: 688 * MB}


class Collectives(str, Enum):
    """Which NCCL communicators a strategy sets up (see the module docstring)."""

    DATA_PARALLEL = "data_parallel"   # torch.cuda.comm's clique: broadcast and reduce
    DDP = "ddp"                       # the process group's communicator: all-reduce
    FSDP = "fsdp"                     # the process group's communicator: all-gather, reduce-scatter


@dataclass(frozen=True)
class FixedCosts:
    """Per-card bytes outside the allocator that count against the card.

    ``nccl_bytes``: None takes the published figure for the strategy (:meth:`nccl_for`) on
    runs of more than one card (0 on one card). The CUDA context comes from
    ``Device.context_bytes``.
    """

    nccl_bytes: Optional[int] = None

    def nccl_for(self, n_cards: int, collectives: Collectives = Collectives.DATA_PARALLEL) -> int:
        """NCCL bytes on each card of a run over ``n_cards`` cards."""
        if self.nccl_bytes is not None:
            return self.nccl_bytes
        if n_cards <= 1:
            return 0
        if collectives is Collectives.DATA_PARALLEL:
            return NCCL_CLIQUE_BYTES[min(n_cards, 3)]
        return NCCL_COMMUNICATOR_BYTES


class BudgetLevel(str, Enum):
    """``reserved`` (the default, :data:`DEFAULT_LEVEL`): the caching allocator's reserved
    peak plus the fixed costs the budget does not already take out (NCCL on the simulator;
    the CUDA context is in ``Device.context_bytes``), i.e. what runs out on a card.
    ``allocated``: the allocator's allocated peak (``max_memory_allocated``) alone, the
    headroom covering the rest."""

    ALLOCATED = "allocated"
    RESERVED = "reserved"


#: What the simulated reserved level is, said wherever a simulated reserved figure is shown:
#: how far it was checked on hardware (the README's "How close is the simulator" and
#: ``benchmarks/measured/h200-2026-11-27-final`` hold the table; rerun by
#: ``benchmarks/gpu_session.sh``).
RESERVED_MODEL = ("a model of the caching allocator, checked on one card only (an H200, "
                  "2026-11-27: -14.6% to +6.9% of max_memory_reserved on 19 training steps), "
                  "not on several cards or NCCL's buffers")

#: What a certificate ("one more sample does not fit") rests on at the reserved level, said
#: wherever one is shown there: the figure not falling as the work grows, which fragmentation
#: can break (``docs/guides/reserved-level-search.md``).
RESERVED_CERTIFICATE = ("at the reserved level this holds if the figure does not fall as the "
                        "batch grows, which the probes checked only where they measured (the "
                        "caching allocator's fragmentation can break it: "
                        "expandable_segments:True makes it hold)")

#: The same, where the answer's over points were looked past on the simulator's allocator
#: model (``search.Known.look_past``) and the figure stayed over throughout.
RESERVED_CERTIFICATE_LOOKED = ("at the reserved level the figure can fall as the batch grows "
                               "(the caching allocator's fragmentation): on the allocator model "
                               "every card stays over past its over point, chunk by chunk up to "
                               "where its allocated peak alone is over (card 0 at the least it "
                               "can take of each larger batch), each step drawn from simulated "
                               "ones (exact where sizes grow linearly with the samples)")

#: The same for a balance solved on the simulator's map of every chunk each card could take
#: (``search.Known.balance_map``).
RESERVED_BALANCE_MAPPED = ("at the reserved level the figure can fall as the work grows (the "
                           "caching allocator's fragmentation): on the allocator model, each "
                           "step drawn from simulated ones (exact where sizes grow linearly "
                           "with the samples)")

#: The level :class:`dptune.Tuner`, ``dptune search``, ``dptune plan`` (DDP and FSDP), the
#: ``--lengths`` plans and the Hugging Face integration check by default: the one that runs
#: out. ``budget_level="allocated"`` (``--budget-level allocated``) still checks the
#: allocated peak.
DEFAULT_LEVEL = BudgetLevel.RESERVED

#: The headroom each level leaves by default. At ``allocated`` 1 GiB covers fragmentation
#: (the reserved-but-free memory), NCCL's buffers and what else is not modelled. At
#: ``reserved`` (the default) fragmentation and NCCL are predicted, so the default shrinks
#: by 768 MiB, to 256 MiB for what is still not modelled (cuDNN's per-algorithm workspaces,
#: DataParallel's 10 MiB coalesced broadcast/reduce buckets, blocks held back by
#: record_stream on the scatter's side stream, the driver's own rounding).
DEFAULT_HEADROOM = {BudgetLevel.ALLOCATED: 1024 * 1024 * 1024, BudgetLevel.RESERVED: 256 * 1024 * 1024}


def parse_level(level: "str | BudgetLevel") -> BudgetLevel:
    try:
        return BudgetLevel(level)
    except ValueError:
        raise UsageError(f"budget level must be 'allocated' or 'reserved', got {level!r}") from None


def real_cards_measured(options: Sequence[str]) -> str:
    """The one line for allocator-model options given where real cards are probed."""
    return (f"{' and '.join(options)} set the allocator model of simulated cards; real GPUs are "
            "measured: set PYTORCH_CUDA_ALLOC_CONF in the environment before dptune starts "
            "(NCCL's buffers are in NVML's figures there), or simulate the cards")


def at_level(r: ProbeResult, devices: Sequence[Device], level: BudgetLevel) -> ProbeResult:
    """``r`` with ``peak_bytes`` at ``level`` (the allocated peak kept in
    ``allocated_peak_bytes``): on the simulator the model's reserved peak + NCCL (total use
    less the context, which the budget already takes out); on real cards the measured
    ``max_memory_reserved`` (NCCL's buffers, once made, are in NVML's figures there)."""
    if level is BudgetLevel.ALLOCATED:
        return r
    if r.reserved_bytes is None:
        raise BackendUnavailableError(
            "budget level 'reserved' (the default) needs reserved figures, and this backend gave "
            "none: give budget_level='allocated' (--budget-level allocated), or build a simulated "
            "backend with reserved=ReservedModel()")
    if r.total_bytes is not None:
        peaks = tuple(t - d.context_bytes for t, d in zip(r.total_bytes, devices))
    else:
        peaks = tuple(r.reserved_bytes)
    return dataclasses.replace(r, peak_bytes=peaks, allocated_peak_bytes=r.peak_bytes)
