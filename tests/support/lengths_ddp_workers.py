"""Real multi-process DDP jobs for the length tests (gloo on the CPU), as
``tests/support/ddp_workers.py`` runs them: each rank runs every scenario and reports by label."""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

V, D, OUT = 20, 4, 3
LENGTHS = [1 + (i * 7) % 23 for i in range(41)]      # 1..23, 41 samples


def plan_for(world: int) -> Any:
    """A DDP plan by hand: per bucket each rank's batch (uneven, shrinking with the length)."""
    from dptune.lengths import BucketPlan, LengthPlan

    chunks = {2: [(4, 3), (2, 3), (1, 2)], 3: [(3, 1, 4), (2, 1, 2), (1, 1, 1)]}[world]
    edges = [(0, 8), (8, 16), (16, 23)]
    buckets = tuple(BucketPlan(lo, hi, 0, c, (0,) * world, 0, True) for (lo, hi), c in
                    zip(edges, chunks))
    return LengthPlan(buckets=buckets, devices=("card",) * world, budget_bytes=(1,) * world,
                      ddp=True)


def model() -> nn.Module:
    torch.manual_seed(0)
    return Pool()


class Pool(nn.Module):
    """Mean of the tokens' embeddings (padding masked), then a linear head: a sample's output
    does not depend on how far its batch is padded."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.head = nn.Linear(D, OUT)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = (self.emb(ids) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return self.head(h)


def batch(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids padded to the batch's longest, the mask, and each sample's target."""
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, V, (len(LENGTHS), max(LENGTHS)), generator=g)
    targets = torch.randn(len(LENGTHS), OUT, generator=g)
    longest = max((LENGTHS[i] for i in indices), default=1)
    ids = torch.zeros(len(indices), longest, dtype=torch.long)
    mask = torch.zeros(len(indices), longest)
    for row, i in enumerate(indices):
        ids[row, :LENGTHS[i]] = tokens[i, :LENGTHS[i]]
        mask[row, :LENGTHS[i]] = 1
    return ids, mask, targets[indices]


def full_batch_grads(indices: list[int]) -> list[list[float]]:
    m = model()
    ids, mask, y = batch(indices)
    nn.functional.mse_loss(m(ids, mask), y).backward()
    return [p.grad.flatten().tolist() for p in m.parameters()]


def epoch(rank: int, world: int, seed: int = 3, epochs: int = 2) -> dict:
    """Each epoch's batches on this rank, and after every step the DDP gradient of the
    scaled loss (an empty batch still runs its step)."""
    from dptune.lengths import BucketBatchSampler

    sampler = BucketBatchSampler(LENGTHS, plan_for(world), seed=seed)   # rank from the group
    ddp = nn.parallel.DistributedDataParallel(model())
    out: dict[str, Any] = {"epochs": [], "grads": []}
    for e in range(epochs):
        sampler.set_epoch(e)
        batches = [list(b) for b in sampler]
        out["epochs"].append(batches)
        if e:
            continue
        for step, idx in enumerate(batches):
            ddp.zero_grad()
            ids, mask, y = batch(idx)
            pred = ddp(ids, mask)
            if idx:
                loss = nn.functional.mse_loss(pred, y) * sampler.loss_scale(step)
            else:
                loss = pred.sum() * 0
            loss.backward()
            out["grads"].append([p.grad.flatten().tolist() for p in ddp.parameters()])
    return out


def _entry(rank: int, world: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        try:
            out = epoch(rank, world)
        except Exception as e:
            out = {"error": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
        results.put((rank, out))
    finally:
        dist.destroy_process_group()


def launch(world: int, timeout: float = 180.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_entry, args=(r, world, port, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: list[dict] = [{} for _ in range(world)]
    deadline = time.monotonic() + timeout
    try:
        for _ in range(world):
            try:
                rank, value = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise TimeoutError(f"the {world}-rank job did not finish in {timeout:.0f} s") from None
            out[rank] = value
        for p in procs:
            p.join(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return out
