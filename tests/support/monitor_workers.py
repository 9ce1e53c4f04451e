"""A DDP job watched by dptune.MemoryMonitor, for the gloo tests: each rank one fake card
(tests/support/fake_cards.py) whose memory follows its own batch, a real DDP model trained on
the CPU, and no collective allowed while the monitor runs (each is replaced by one that
raises for the monitor's calls)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from fake_cards import GiB, FakeCards, probe_peak, train_step

BATCHES = (4, 6)            # rank 0, rank 1: an uneven per-rank plan
LENGTHS = (64, 128, 128)    # the planned length is 128 ...
GROWN = 200                 # ... and rank 1's third step is this long
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "gather", "gather_object", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "scatter", "send", "recv")


def plan():
    from dptune.ddp.result import DDPPlan, RankPlan

    budget = 24 * GiB - 500 * (1 << 20) - 256 * (1 << 20)
    ranks = tuple(RankPlan(rank=r, batch_size=b, loss_scale=2 * b / sum(BATCHES), budget_bytes=budget,
                           predicted_peak_bytes=probe_peak(b, 128)) for r, b in enumerate(BATCHES))
    return DDPPlan(ranks=ranks, objective="max_batch", backend="simulated")


class _NoCollective:
    def __enter__(self):
        self.saved = {n: getattr(dist, n) for n in COLLECTIVES}

        def boom(*a, **k):
            raise AssertionError("a collective on the monitor's hot path")

        for n in COLLECTIVES:
            setattr(dist, n, boom)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(dist, n, f)


def monitored(rank: int, world: int, run_dir: str) -> dict:
    from dptune.monitor import MemoryMonitor

    cards = FakeCards(n=1)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _NoCollective():
            mon = MemoryMonitor(plan(), runtime=cards, run_dir=run_dir)
        b = BATCHES[rank]
        for k, length in enumerate(LENGTHS):
            if rank == 1 and k == 2:
                length = GROWN
            x = torch.randn(b, 8)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            with _NoCollective():
                with mon.step(batch_size=b, length=length):
                    train_step(cards, 0, b, length, setup=k == 0)
        with _NoCollective():
            mon.close()
    return {"cards": [c.to_dict() for c in mon.cards],
            "warnings": [str(w.message) for w in caught if "dptune monitor" in str(w.message)]}


SCENARIOS = {"monitored": monitored}
