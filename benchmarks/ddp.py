"""DDP on unequal cards: the largest global batch with equal local batches vs dptune's plan.

``python -m benchmarks.ddp [--models MLP GPT] [--out reports/benchmarks]``, simulated, headroom
:data:`benchmarks.config.HEADROOM`, AdamW, DDP's default buckets. For each model x cluster:

- **equal**: plain DDP gives every rank the same batch, so the smallest card decides:
  ``world_size x min_r cap_r``, with ``cap_r`` the largest local batch rank r fits, found by
  bisection on the simulator (exact);
- **dptune**: ``dptune.ddp.plan(..., objective="max_batch")`` (its rounds and probes,
  whether it is certified, its wall time);
- **optimum**: ranks are independent under DDP, so the exact optimum is ``sum_r cap_r``.

Writes ``ddp.md`` and ``ddp.csv`` under ``--out`` and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from dptune import ddp
from dptune.backends.simulated import parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
from dptune.units import parse_bytes
from dptune.step.workload import Workload

from benchmarks import config
from benchmarks.output import write_table

__all__ = ["CLUSTERS", "DDPRow", "run_case", "table", "main"]

#: Unequal clusters: two card sizes; four equal cards with 10 GB of one taken by another job.
CLUSTERS = ("2x32GB,2x24GB", "4x24GB,used=3:10GB")


@dataclass
class DDPRow:
    model: str
    cluster: str
    caps: list[int]            # exact largest local batch per rank
    equal: int                 # largest global batch with equal local batches
    planned: list[int]         # dptune's local batches
    optimum: int
    rounds: int
    probes: int
    certified: bool
    seconds: float

    @property
    def gain(self) -> float:
        return sum(self.planned) / self.equal - 1.0 if self.equal else float("inf")


def exact_caps(workload: Workload, cluster: str, headroom: int) -> list[int]:
    """Per rank, the largest local batch within its budget (bisection; ranks on one card
    type share the simulator)."""
    c = parse_cluster(cluster)
    sims: dict[str, SimulatedDDPRank] = {}
    memo: dict[tuple[str, int], int] = {}
    caps = []
    for r, dev in enumerate(c.devices):
        name = c.names[r]
        if name not in sims:
            sims[name] = SimulatedDDPRank(workload, card_of(c, r))
        budget = dev.budget_bytes(headroom)

        def fits(b: int, name: str = name, budget: int = budget) -> bool:
            if (name, b) not in memo:
                memo[(name, b)] = sims[name].estimate([b]).peak_bytes[0]
            return memo[(name, b)] <= budget

        hi = 1
        while fits(hi):
            hi *= 2
        lo = hi // 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        caps.append(lo)
    for s in sims.values():
        s.close()
    return caps


def run_case(model_name: str, cluster: str) -> DDPRow:
    spec = config.MODELS[model_name]
    model, sample = spec.workload_args()
    headroom = parse_bytes(config.HEADROOM)
    caps = exact_caps(Workload(model, sample, None, config.optimizer), cluster, headroom)
    t0 = time.perf_counter()
    plan = ddp.plan(model, sample, optimizer=config.optimizer, objective="max_batch",
                    simulate=cluster, headroom=headroom, budget_level="allocated")  # as the caps
    seconds = time.perf_counter() - t0
    return DDPRow(model=model_name, cluster=cluster, caps=caps, equal=len(caps) * min(caps),
                  planned=plan.batch_sizes, optimum=sum(caps), rounds=plan.rounds,
                  probes=len(plan.probes), certified=plan.certified, seconds=seconds)


def table(rows: Sequence[DDPRow]) -> str:
    head = ("| model | cluster | equal local batches | dptune plan (per rank) | optimum | gain "
            "| rounds (probes) | certified |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r.model} | {r.cluster} | {r.equal} ({r.equal // len(r.caps)} per rank) "
                     f"| {sum(r.planned)} {r.planned} | {r.optimum} | {100 * r.gain:+.0f}% "
                     f"| {r.rounds} ({r.probes}) | {'yes' if r.certified else 'no'} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["MLP", "GPT"], choices=sorted(config.MODELS))
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    ap.add_argument("--out", default="reports/benchmarks")
    args = ap.parse_args(argv)
    rows = [run_case(m, c) for m in args.models for c in args.clusters]
    text = table(rows)
    write_table(args.out, "ddp", text, rows)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
