"""What a card holds besides the caching allocator's segments, per card, with sources.

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
- NCCL: one communicator with an all-reduce took about 1.6 GB per GPU, three or more about
  6 GB (NVIDIA/nccl issue #864); the amount grows linearly with NCCL's channels and with the
  number of communicators (nccl #986, maintainer's answer). dptune takes the one-communicator
  figure for every card of a multi-card run: a DDP rank has its process group's communicator,
  and DataParallel's broadcast (``comm.broadcast_coalesced``) and gradient reduction
  (``comm.reduce_add``, ``torch.cuda.nccl.reduce``) build a communicator clique over its
  cards too. A one-card run has none. Set ``nccl_bytes`` to what ``NCCL_DEBUG=INFO`` or NVML
  shows on your system.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["CONTEXT_BYTES", "NCCL_COMMUNICATOR_BYTES", "FixedCosts"]

MB = 1000 * 1000
#: CUDA context figures from the sources above, by module loading mode (bytes).
CONTEXT_BYTES = {"lazy": 287 * MB, "eager": 667 * MB}
#: One NCCL communicator after an all-reduce, per GPU (NVIDIA/nccl #864: "about 1.6GB").
NCCL_COMMUNICATOR_BYTES = 1600 * MB


@dataclass(frozen=True)
class FixedCosts:
    """Per-card bytes outside the allocator that count against the card.

    ``nccl_bytes``: None takes :data:`NCCL_COMMUNICATOR_BYTES` on runs of more than one card
    (0 on one card). The CUDA context comes from ``Device.context_bytes``.
    """

    nccl_bytes: Optional[int] = None

    def nccl_for(self, n_cards: int) -> int:
        """NCCL bytes on each card of a run over ``n_cards`` cards."""
        if self.nccl_bytes is not None:
            return self.nccl_bytes
        return NCCL_COMMUNICATOR_BYTES if n_cards > 1 else 0
