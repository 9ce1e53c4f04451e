"""Real multi-process DDP jobs for the tests: ``torch.multiprocessing`` spawn, the gloo
backend on the CPU, env rendezvous on 127.0.0.1 and a free port.

:func:`launch` starts ``world_size`` ranks that each run every scenario named, in order,
and returns each rank's results, by label (``"grad:scaled"`` runs scenario ``grad``). A scenario that raises is recorded as
``{"error": class name, "message": ..., "seconds": ...}`` and the rank goes on with the
next one (every rank raises at the same collective, so the group stays usable).
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

IN, HID, OUT = 6, 5, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)


def full_batch_grads(n: int) -> list[list[float]]:
    """The single-process gradient of the mean loss over all n samples."""
    model = tiny_model()
    x, y = data(n)
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.flatten().tolist() for p in model.parameters()]


# ---- scenarios (run on every rank) -----------------------------------------------------------

def grad_step(rank: int, world: int, sizes: list[int], scale: bool = True, device: str = "cpu") -> dict:
    """One DDP step on this rank's slice of the global batch (the whole dataset)."""
    from dptune.ddp import DDPPlan, UnevenBatchSampler

    plan = DDPPlan.from_batch_sizes(sizes)
    n = plan.global_batch
    x, y = data(n)
    (idx,) = list(UnevenBatchSampler(n, plan, shuffle=True, seed=3))  # rank from torch.distributed
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    model = nn.parallel.DistributedDataParallel(tiny_model().to(dev),
                                                device_ids=[rank] if device == "cuda" else None)
    loss = nn.functional.mse_loss(model(x[idx].to(dev)), y[idx].to(dev))
    (plan.scale_loss(loss) if scale else loss).backward()
    return {"n": len(idx), "grads": [p.grad.flatten().cpu().tolist() for p in model.parameters()]}


def sampler_epochs(rank: int, world: int, sizes: list[int], n: int, epochs: int = 2,
                   drop_last: bool = False) -> dict:
    from dptune.ddp import DDPPlan, UnevenBatchSampler

    sampler = UnevenBatchSampler(list(range(n)), DDPPlan.from_batch_sizes(sizes), seed=7,
                                 drop_last=drop_last)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([list(b) for b in sampler])
    return {"epochs": out, "len": len(sampler)}


def grads_of(indices: list[int], n: int) -> list[list[float]]:
    """The single-process gradient of the mean loss over ``indices`` of the dataset of n."""
    model = tiny_model()
    x, y = data(n)
    nn.functional.mse_loss(model(x[indices]), y[indices]).backward()
    return [p.grad.flatten().tolist() for p in model.parameters()]


def readme_loop(rank: int, world: int, sizes: list[int], n: int, epochs: int = 1,
                how: str = "batch_size", drop_last: bool = False) -> dict:
    """The README's loop (``DataLoader`` + ``UnevenBatchSampler`` + ``plan.scale_loss``) over
    whole epochs; per step, this rank's indices and the gradient after the backward."""
    from torch.utils.data import DataLoader, Dataset

    from dptune.ddp import DDPPlan, UnevenBatchSampler

    x, y = data(n)

    class Indexed(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> tuple:
            return x[i], y[i], i

    plan = DDPPlan.from_batch_sizes(sizes)
    sampler = UnevenBatchSampler(Indexed(), plan, shuffle=True, seed=5, drop_last=drop_last)
    loader = DataLoader(Indexed(), batch_sampler=sampler)
    model = nn.parallel.DistributedDataParallel(tiny_model())
    steps = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for step, (xb, yb, idx) in enumerate(loader):
            loss = nn.functional.mse_loss(model(xb), yb)
            if how == "batch_size":
                scaled = plan.scale_loss(loss, batch_size=len(yb))
            elif how == "sizes":
                scaled = plan.scale_loss(loss, sizes=sampler.sizes_at(step))
            else:
                scaled = plan.scale_loss(loss)
            scaled.backward()
            steps.append({"epoch": epoch, "indices": idx.tolist(),
                          "grads": [p.grad.flatten().tolist() for p in model.parameters()]})
            model.zero_grad()
    return {"steps": steps}


def bn_loop(rank: int, world: int, sizes: list[int], n: int) -> dict:
    """The README's loop for a model with BatchNorm (a plan with ``min_batch=2``): per step,
    this rank's batch size; a batch of one would raise in BatchNorm's training mode."""
    from torch.utils.data import DataLoader, TensorDataset

    from dptune.ddp import DDPPlan, UnevenBatchSampler

    x, y = data(n)
    ds = TensorDataset(x, y)
    plan = DDPPlan.from_batch_sizes(sizes, min_batch=2)
    sampler = UnevenBatchSampler(ds, plan, seed=1)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(IN, HID), nn.BatchNorm1d(HID), nn.Linear(HID, OUT)))
    got = []
    for xb, yb in DataLoader(ds, batch_sampler=sampler):
        plan.scale_loss(nn.functional.mse_loss(model(xb), yb), batch_size=len(yb)).backward()
        got.append(len(yb))
    return {"sizes": got}


def wrong_world(rank: int, world: int, plan_world: int, n: int, what: str) -> dict:
    """A plan for ``plan_world`` ranks used with an explicit ``rank=`` in this job."""
    from dptune.ddp import DDPPlan, UnevenBatchSampler

    plan = DDPPlan.from_batch_sizes([3] * plan_world)
    if what == "sampler":
        UnevenBatchSampler(n, plan, rank=rank)
    else:
        plan.scale_loss(torch.tensor(1.0, requires_grad=True), rank=rank,
                        **({"batch_size": 3} if what == "scale_loss:batch" else {}))
    return {}


def small_dataset(rank: int, world: int, sizes: list[int], n: int) -> dict:
    from dptune.ddp import UnevenBatchSampler

    UnevenBatchSampler(n, sizes)
    return {}


def _plan_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _plan_sample(b: int) -> torch.Tensor:
    return torch.randn(b, 64)


def _adamw(p: Any) -> Any:
    return torch.optim.AdamW(p)


def make_plan(rank: int, world: int, spec: str, **kw: Any) -> dict:
    from dptune import ddp

    t0 = time.perf_counter()
    p = ddp.plan(_plan_model, _plan_sample, optimizer=_adamw, simulate=spec, headroom=0, **kw)
    d = p.to_dict()
    d.pop("seconds")
    return {"plan": d, "seconds": time.perf_counter() - t0}


def _failing_sample(b: int) -> torch.Tensor:
    if dist.get_rank() == world_of_failure():
        raise RuntimeError("broken batch on this rank")
    return torch.randn(b, 64)


def world_of_failure() -> int:
    return int(os.environ.get("DPTUNE_TEST_FAILING_RANK", "1"))


def user_error(rank: int, world: int, spec: str) -> dict:
    from dptune import ddp

    ddp.plan(_plan_model, _failing_sample, optimizer=_adamw, simulate=spec, headroom=0,
             global_batch=64)
    return {}


SCENARIOS: dict[str, Callable[..., dict]] = {
    "grad": grad_step, "sampler": sampler_epochs, "plan": make_plan, "user_error": user_error,
    "loop": readme_loop, "wrong_world": wrong_world, "small": small_dataset, "bn": bn_loop,
}


# ---- the launcher ---------------------------------------------------------------------------

def _entry(rank: int, world: int, port: int, jobs: list, results: Any, backend: str,
           scenarios: Optional[dict] = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for name, kwargs in jobs:
            t0 = time.perf_counter()
            try:
                out = (scenarios or SCENARIOS)[name.split(":")[0]](rank, world, **kwargs)
            except Exception as e:  # recorded, the test decides
                out = {"error": type(e).__name__, "message": str(e),
                       "traceback": traceback.format_exc()}
            out["seconds"] = time.perf_counter() - t0
            results.put((rank, name, out))
    finally:
        dist.destroy_process_group()


def launch(world: int, jobs: list[tuple[str, dict]], timeout: float = 240.0,
           backend: str = "gloo", scenarios: Optional[dict] = None) -> list[dict[str, dict]]:
    """Run ``jobs`` (label, keyword arguments) on ``world`` ranks; per rank, the results by
    label. Fails (never hangs) when a rank does not answer within ``timeout``. ``scenarios``:
    label -> function of another workers module (default: this one's)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, jobs, results, backend, scenarios),
                         daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: list[dict[str, dict]] = [{} for _ in range(world)]
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world * len(jobs)):
            left = deadline - time.monotonic()
            try:
                rank, name, value = results.get(timeout=max(left, 0.1))
            except queue.Empty:
                raise TimeoutError(f"the {world}-rank job did not finish within {timeout:.0f} s; "
                                   f"got {[sorted(o) for o in out]}") from None
            out[rank][name] = value
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return out
