"""One rank's card for the DDP planner: a simulated card of the cluster, or this process's
CUDA card. A prober gives the rank's facts (:class:`dptune.ddp.ranks.RankInfo`) and the peak
of one step at a batch (``None``: out of memory)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

from dptune.backends.simulated.ddp_memory import DDPOptions, bucket_bytes, params_of
from dptune.budget import Collectives, FixedCosts
from dptune.backends.simulated.reserved import ReservedModel
from dptune.budget import BudgetLevel, at_level
from dptune.ddp.ranks import RankInfo, SimulatedRank, local_card, min_batch, step_settings
from dptune.errors import BackendUnavailableError

__all__ = ["Prober", "SimulatedProber", "CudaProber", "local_cuda_prober"]


class Prober(Protocol):
    def info(self) -> RankInfo: ...
    def probe(self, batch_size: int) -> Optional[int]:
        """Peak bytes of one step, or ``None`` when it ran out of memory."""
        ...
    def close(self) -> None: ...


class SimulatedProber(SimulatedRank):
    """Rank ``rank`` on card ``rank`` of a simulated cluster."""

    def __init__(self, workload: Any, cluster: Any, rank: int, options: DDPOptions,
                 headroom_bytes: int, host: Optional[str], shared: Optional[dict] = None,
                 reserved: Optional[ReservedModel] = None):
        from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
        from dptune.step.workload import model_name

        self.device = cluster.devices[rank]
        # a rank's peak depends only on its card type: ranks simulated in one process share
        # one simulator and its results per card type
        shared = {} if shared is None else shared
        card = cluster.names[rank]
        if card not in shared:
            # at the reserved level each rank's trace is replayed through the allocator model,
            # NCCL's buffers as for a world of all the ranks (as SimulatedDDP(reserved=...))
            model = None if reserved is None else dataclasses.replace(
                reserved, fixed=FixedCosts(reserved.fixed.nccl_for(len(cluster), Collectives.DDP)))
            shared[card] = (SimulatedDDPRank(workload, card_of(cluster, rank), options, model), {})
        self.backend, self._memo = shared[card]
        self.workload, self.headroom, self.host = workload, headroom_bytes, host
        self.name = model_name(workload.model)

    def info(self) -> RankInfo:
        ddp = self.backend.ddp_bytes()
        return RankInfo(device=self.device, host=self.host,
                         budget_bytes=self.device.budget_bytes(self.headroom), ddp_bytes=ddp,
                         min_batch=min_batch(self.workload.model), model_name=self.name,
                         settings=step_settings(self.workload))

    def close(self) -> None:
        self.backend.close()


class CudaProber:
    """This process's CUDA card: the single-card step measured, DDP's buckets counted, and the
    card's forward and backward timed by CUDA events on its stream
    (:class:`dptune.backends.cuda.card_timer.CardTimer`: the median of the measured steps,
    after a warm-up). ``runtime``: the CUDA runtime (``None``: the real one; tests set a
    fake one with a clock they control)."""

    runtime: Any = None
    #: measured steps per probe: the time is their median
    REPEATS = 3

    def __init__(self, workload: Any, device_index: int, options: DDPOptions, headroom_bytes: int,
                 host: Optional[str], level: BudgetLevel = BudgetLevel.ALLOCATED,
                 runtime: Any = None):
        from dptune.backends.cuda import CudaBackend
        from dptune.step.workload import model_name

        self.backend = CudaBackend(workload, device_ids=[device_index], repeats=self.REPEATS,
                                   runtime=runtime)
        self.workload, self.options, self.headroom, self.host = workload, options, headroom_bytes, host
        self.name = model_name(workload.model)
        self._ddp: Optional[int] = None
        self.level = level
        self._seconds: dict[int, Optional[float]] = {}

    def _ddp_bytes(self) -> int:
        if self._ddp is None:
            import torch

            model = self.workload.model
            if not isinstance(model, torch.nn.Module):
                with torch.device("meta"):
                    model = model()
            self._ddp = bucket_bytes(params_of(model), self.options)
        return self._ddp

    def info(self) -> RankInfo:
        device = self.backend.devices[0]
        return RankInfo(device=device, host=self.host, budget_bytes=device.budget_bytes(self.headroom),
                         ddp_bytes=self._ddp_bytes(), min_batch=min_batch(self.workload.model),
                         model_name=self.name, settings=step_settings(self.workload))

    def probe(self, batch_size: int) -> Optional[int]:
        res = at_level(self.backend.probe([batch_size]), self.backend.devices, self.level)
        t = res.time
        # the card's own forward and backward (CUDA events); None: the events did not time it
        self._seconds[batch_size] = t.card_seconds[0] if t is not None and t.card_seconds else None
        if not res.feasible:
            return None
        return res.peak_bytes[0] + self._ddp_bytes()

    def seconds(self, batch_size: int) -> Optional[float]:
        """The card's forward and backward time (seconds, measured) in the probe at
        ``batch_size``: ``None`` when it ran out of memory or the events did not time it (no
        event clock, or a step that never calls the model)."""
        return self._seconds.get(batch_size)

    def close(self) -> None:
        self.backend.close()


def local_cuda_prober(workload: Any, device: Optional[int], options: DDPOptions,
                      headroom_bytes: int, host: Optional[str],
                      level: BudgetLevel = BudgetLevel.ALLOCATED) -> Prober:
    """This rank's CUDA card: ``device``, else ``LOCAL_RANK``'s, else the current device
    (on :attr:`CudaProber.runtime`, the real CUDA runtime unless a test set another)."""
    from dptune.hardware.runtime import CudaRuntime

    runtime = CudaProber.runtime if CudaProber.runtime is not None else CudaRuntime()
    if not runtime.is_available():
        raise BackendUnavailableError(
            "plan() inside a torch.distributed job probes each rank's CUDA card, but this rank "
            "sees none; pass simulate='...' (one card per rank) to plan on virtual cards")
    return CudaProber(workload, local_card(device, runtime), options, headroom_bytes, host, level,
                      runtime=CudaProber.runtime)
