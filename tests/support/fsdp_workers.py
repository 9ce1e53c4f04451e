"""Real multi-process FSDP2 jobs for the tests: gloo on the CPU, 2 or 3 ranks (spawned as
:mod:`ddp_workers` spawns them, env rendezvous on 127.0.0.1).

:func:`launch` starts ``world_size`` ranks that run every scenario named, in order, and
returns each rank's results by label; a scenario that raises is recorded as ``{"error":
class name, "message": ...}`` and the rank goes on with the next one.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from cpu_card import OneCpuCard
from ddp_workers import launch as ddp_launch

IN, HID, OUT = 6, 7, 3         # 7 and 3 rows: shards of unequal length, padded by FSDP2


class TinyStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(IN, HID), nn.Tanh()),
                                     nn.Sequential(nn.Linear(HID, HID), nn.Tanh())])
        self.head = nn.Linear(HID, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyStack()


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def full_batch_grads(n: int) -> dict[str, list[float]]:
    """The single-process gradient of the mean loss over all n samples, by parameter name."""
    model = tiny_model()
    x, y = data(n)
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.flatten().tolist() for name, p in model.named_parameters()}


def _sharded(world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    from dptune.ddp.fsdp import default_shard

    model = tiny_model()
    default_shard(model, init_device_mesh("cpu", (world,)))
    return model


# ---- scenarios (run on every rank) -----------------------------------------------------------

def grad_step(rank: int, world: int, sizes: list[int], scale: bool = True, accumulate: int = 1) -> dict:
    """One FSDP2 step on this rank's slice of the global batch (the whole dataset), in
    ``accumulate`` micro-batches (the same count on every rank); every parameter's full
    gradient gathered from its shards."""
    from dptune.ddp import DDPPlan, UnevenBatchSampler

    plan = DDPPlan.from_batch_sizes(sizes)
    x, y = data(plan.global_batch)
    (idx,) = list(UnevenBatchSampler(plan.global_batch, plan, shuffle=True, seed=3))
    model = _sharded(world)
    for part in torch.tensor_split(torch.tensor(idx), accumulate):
        # each micro-batch's mean, weighted by its share of this rank's batch
        loss = nn.functional.mse_loss(model(x[part]), y[part]) * (len(part) / len(idx))
        (plan.scale_loss(loss) if scale else loss).backward()
    grads = {name: p.grad.full_tensor().flatten().tolist() for name, p in model.named_parameters()}
    return {"n": len(idx), "grads": grads}


def epoch(rank: int, world: int, sizes: list[int], n: int) -> dict:
    """One epoch of FSDP2 steps with the uneven sampler (its tail step included)."""
    from dptune.ddp import DDPPlan, UnevenBatchSampler

    plan = DDPPlan.from_batch_sizes(sizes)
    sampler = UnevenBatchSampler(n, plan, seed=5)
    x, y = data(n)
    model = _sharded(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for idx in sampler:
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        plan.scale_loss(loss, batch_size=len(idx)).backward()   # the tail step's own sizes
        opt.step()
        opt.zero_grad()
        seen.append(list(idx))
    return {"batches": seen}


def _plan_stack() -> nn.Module:
    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
            self.head = nn.Linear(64, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.head(x)

    return Stack()


def _plan_sample(b: int) -> torch.Tensor:
    return torch.randn(b, 64)


def _adamw(p: Any) -> Any:
    return torch.optim.AdamW(p)


def make_plan(rank: int, world: int, spec: str, **kw: Any) -> dict:
    from dptune import ddp

    t0 = time.perf_counter()
    p = ddp.plan(_plan_stack, _plan_sample, optimizer=_adamw, simulate=spec, headroom=0,
                 strategy="fsdp", **kw)
    d = p.to_dict()
    d.pop("seconds")
    return {"plan": d, "seconds": time.perf_counter() - t0}


def _failing_shard(model: nn.Module, mesh: Any) -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("broken sharding on this rank")
    from dptune.ddp.fsdp import default_shard

    default_shard(model, mesh)


def user_error(rank: int, world: int, spec: str) -> dict:
    from dptune import ddp

    ddp.plan(_plan_stack, _plan_sample, optimizer=_adamw, simulate=spec, headroom=0,
             global_batch=64, strategy="fsdp", shard=_failing_shard)
    return {}


# ---- planning on "real" cards: each rank's card is a CPU with a memory model ---------------

MiB = 1 << 20
PER_SAMPLE = 1 * MiB                 # what one sample of the local batch costs on the card
_SEEN: dict[str, Any] = {}           # what the rank's probe step saw: its parameters, its batch


def _local_bytes(params: list) -> int:
    return sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in params)


class CardRuntime(OneCpuCard):
    """This rank's "CUDA card": a CPU device whose allocated peak is the bytes of the
    parameters the probe's optimizer was given (the rank's shards) plus PER_SAMPLE per sample
    of the last batch drawn; ``total`` bytes in all, nothing else on it."""

    def __init__(self, total: int):
        self.total_ = total

    def memory_allocated(self, d: int) -> int:
        return _local_bytes(_SEEN.get("params", []))

    memory_reserved = memory_allocated

    def max_memory_allocated(self, d: int) -> int:
        return self.memory_allocated(d) + PER_SAMPLE * _SEEN.get("batch", 0)

    max_memory_reserved = max_memory_allocated

    def reset_peak_memory_stats(self, d: int) -> None:
        _SEEN["batch"] = 0


def _card_sample(b: int) -> torch.Tensor:
    _SEEN["batch"] = b
    return torch.randn(b, 64)


def _card_sgd(params: Any) -> Any:
    _SEEN["params"] = list(params)
    _SEEN["fsdp"] = type(_SEEN["params"][0]).__name__
    return torch.optim.SGD(_SEEN["params"], lr=0.1)


def card_plan(rank: int, world: int, totals: list[int]) -> dict:
    """``plan(strategy="fsdp")`` without ``simulate`` inside the job: each rank probes its own
    card (CardRuntime); the user's model must come back unsharded and unchanged."""
    from dptune import ddp
    from dptune.ddp.fsdp import CudaFSDPProber

    torch.manual_seed(0)
    model = _plan_stack()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    CudaFSDPProber.runtime = CardRuntime(totals[rank])
    try:
        p = ddp.plan(model, _card_sample, optimizer=_card_sgd, headroom=0, objective="max_batch",
                     strategy="fsdp")
    finally:
        CudaFSDPProber.runtime = None
    after = model.state_dict()
    d = p.to_dict()
    d.pop("seconds")
    return {"plan": d, "shard_bytes": _local_bytes(_SEEN["params"]), "param_type": _SEEN["fsdp"],
            "model_type": type(model).__name__,
            "unchanged": all(type(v) is torch.Tensor and torch.equal(v, before[k]) for k, v in after.items())}


SCENARIOS: dict[str, Callable[..., dict]] = {
    "grad": grad_step, "epoch": epoch, "plan": make_plan, "user_error": user_error,
    "card_plan": card_plan,
}


# ---- the launcher ---------------------------------------------------------------------------

def launch(world: int, jobs: list[tuple[str, dict]], timeout: float = 300.0) -> list[dict[str, dict]]:
    """Run ``jobs`` (label, keyword arguments) on ``world`` gloo ranks, as
    :func:`ddp_workers.launch` does, with this module's scenarios."""
    return ddp_launch(world, jobs, timeout, "gloo", SCENARIOS)
