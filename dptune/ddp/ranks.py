"""One rank's facts for the DDP and FSDP planners (their one home, below both)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dptune.backends.base import Device
from dptune.types import CardWindow

__all__ = ["RankInfo", "min_batch", "step_settings", "local_card", "simulated_peak",
           "simulated_look", "SimulatedRank"]


@dataclass(frozen=True)
class RankInfo:
    """What the planner knows of one rank before its first probe."""

    device: Device
    host: Optional[str]
    budget_bytes: int
    ddp_bytes: int
    min_batch: int            # 2 when the model has BatchNorm (not SyncBatchNorm), else 1
    model_name: str
    settings: Optional[dict]


def min_batch(model: Any) -> int:
    """The smallest local batch a rank may get: 2 with BatchNorm (not SyncBatchNorm), else 1
    (:func:`dptune.step.workload.smallest_chunk` across the ranks)."""
    from dptune.step.workload import smallest_chunk

    return smallest_chunk(model, across_ranks=True)


def step_settings(workload: Any) -> Optional[dict]:
    """The workload's step settings as the plan records them."""
    settings = getattr(workload, "settings", None)
    return settings.to_dict() if settings is not None and hasattr(settings, "to_dict") else None


def local_card(device: Optional[int], runtime: Any) -> int:
    """The CUDA card this rank probes: ``device`` when given, else the job's ``LOCAL_RANK``
    when this process sees that many cards, the only card when it sees one, else the current
    device."""
    import os

    if device is not None:
        return device
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and runtime.device_count() > int(local):
        return int(local)
    if runtime.device_count() == 1:
        return 0
    import torch

    return torch.cuda.current_device()


def simulated_look(backend: Any, device: Any, headroom_bytes: int, memo: dict,
                   batch_size: int) -> Optional[CardWindow]:
    """Past a simulated rank's cap (``batch_size`` fits, one more is over) on the allocator
    model: one more sample at a time until the rank's allocated peak alone passes its budget
    (:meth:`dptune.backends.simulated.SimulatedBackend.look_past`); ``None`` without an
    allocator model (the allocated level). Ranks of one card type share ``memo``."""
    if backend.reserved is None:
        return None
    budget = device.budget_bytes(headroom_bytes)
    key = ("look", batch_size, budget)       # ranks of one card type may hold different memory
    if key not in memo:
        w = backend.look_past([batch_size], [batch_size + 1], [budget])
        memo[key] = w.cards[0] if w.cards else None
    return memo[key]


def simulated_peak(backend: Any, device: Any, batch_size: int) -> int:
    """A simulated rank's peak at its budget level: the ledger's allocated peak, or, with the
    allocator model (``backend.reserved``), the reserved peak plus the fixed costs."""
    if backend.reserved is None:
        return int(backend.estimate([batch_size]).peak_bytes[0])
    from dptune.budget import BudgetLevel, at_level

    return int(at_level(backend.probe([batch_size]), [device], BudgetLevel.RESERVED).peak_bytes[0])


class SimulatedRank:
    """What a simulated rank's prober (DDP's and FSDP2's) measures the same way: its peak at
    a batch (memoised per card type in ``_memo``) and the look past its cap. The prober sets
    ``backend``, ``device``, ``headroom`` and ``_memo``."""

    backend: Any
    device: Any
    headroom: int
    _memo: dict

    def probe(self, batch_size: int) -> Optional[int]:
        if batch_size not in self._memo:
            self._memo[batch_size] = simulated_peak(self.backend, self.device, batch_size)
        return self._memo[batch_size]

    def look_past(self, batch_size: int) -> Optional[CardWindow]:
        """Past this rank's cap on the allocator model (:func:`simulated_look`)."""
        return simulated_look(self.backend, self.device, self.headroom, self._memo, batch_size)
