"""Real multi-process DDP jobs whose ranks probe "real" cards of different speeds: each rank's
card is a CPU device with a memory model and a clock the test controls (spawned by
:func:`ddp_workers.launch`, gloo, 2 or 3 ranks).

The card's clock stands for CUDA events on its stream: it advances only by the work done for
the card, ``fixed + per_sample * b`` seconds for a forward or a backward of ``b`` samples
(no sleep), so every rank's time is exact whatever else loads the machine. Its memory: the
allocated peak is ``BASE`` plus ``PER_SAMPLE`` per sample of the last batch drawn.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from cpu_card import OneCpuCard
from ddp_workers import launch as ddp_launch

MiB = 1 << 20
BASE = 64 * MiB                  # what the card holds at every batch
PER_SAMPLE = 1 * MiB             # what one sample of the local batch adds to the peak
_SEEN: dict[str, Any] = {}       # the last batch drawn
_CLOCK: dict[str, Any] = {}      # this rank's clock (module state: the model may be copied)


class CardClock:
    """Events on this rank's card: a record is the card's time so far."""

    def __init__(self) -> None:
        self.now = 0.0

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def record(self, device: int) -> float:
        return self.now

    def elapsed(self, start: float, end: float) -> float:
        return end - start

    def current_device(self) -> Optional[int]:
        return None


class TimedCardRuntime(OneCpuCard):
    """This rank's "CUDA card": ``total`` bytes, the memory model above, the clock above
    (``event_clock``: ``None`` for a card whose steps cannot be timed)."""

    def __init__(self, total: int, timed: bool = True):
        self.total_ = total
        self.clock = CardClock()
        _CLOCK["clock"] = self.clock
        if not timed:
            self.event_clock = None    # type: ignore[assignment]

    def event_clock(self) -> CardClock:
        return self.clock

    def memory_allocated(self, d: int) -> int:
        return BASE

    memory_reserved = memory_allocated

    def max_memory_allocated(self, d: int) -> int:
        return BASE + PER_SAMPLE * _SEEN.get("batch", 0)

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, d: int) -> None:
        _SEEN["batch"] = 0


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:  # type: ignore[override]
        _CLOCK["clock"].advance(ctx.seconds)
        return grad, None


class TimedModel(nn.Module):
    """A linear layer whose forward and backward of ``b`` samples take ``fixed +
    per_sample * b`` seconds each on this rank's card (``SPEED``: the rank's figures)."""

    SPEED: dict[str, float] = {}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.SPEED
        seconds = s["fixed"] + s["per_sample"] * x.shape[0]
        _CLOCK["clock"].advance(seconds)
        return _Backward.apply(self.lin(x), seconds)


def card_sample(b: int) -> torch.Tensor:
    _SEEN["batch"] = b
    return torch.randn(b, 8)


def _sgd(params: Any) -> Any:
    return torch.optim.SGD(params, lr=0.1)


def timed_plan(rank: int, world: int, totals: list[int], fixed: list[float],
               per_sample: list[float], untimed: Optional[int] = None, **kw: Any) -> dict:
    """``ddp.plan`` inside the job, each rank probing its own card (``totals[rank]`` bytes,
    ``fixed[rank] + per_sample[rank] * b`` seconds per forward and per backward); rank
    ``untimed`` has no timing events."""
    from dptune import ddp
    from dptune.ddp.probers import CudaProber

    TimedModel.SPEED = {"fixed": fixed[rank], "per_sample": per_sample[rank]}
    CudaProber.runtime = TimedCardRuntime(totals[rank], timed=rank != untimed)
    try:
        p = ddp.plan(TimedModel(), card_sample, optimizer=_sgd, headroom=0, **kw)
    finally:
        CudaProber.runtime = None
    d = p.to_dict()
    d.pop("seconds")
    return {"plan": d, "rank": dist.get_rank()}


SCENARIOS: dict[str, Callable[..., dict]] = {"timed_plan": timed_plan}


def launch(world: int, jobs: list[tuple[str, dict]], timeout: float = 240.0) -> list[dict[str, dict]]:
    """Run ``jobs`` (label, keyword arguments) on ``world`` gloo ranks, as
    :func:`ddp_workers.launch` does, with this module's scenarios."""
    return ddp_launch(world, jobs, timeout, "gloo", SCENARIOS)
