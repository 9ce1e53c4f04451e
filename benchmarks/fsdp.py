"""FSDP2 on unequal cards: the largest global batch with equal local batches vs dptune's plan.

``python -m benchmarks.fsdp [--level reserved|allocated] [--cases 2B 1B] [--out
reports/benchmarks]``: simulated, at dptune's default budget level (``reserved``: the allocator
model's reserved peak plus NCCL's buffers, headroom 256 MiB) or ``--level allocated`` (the
allocated peak, headroom 1 GiB), AdamW, decoders (``TinyGPT``, tied embeddings, vocab 32000)
too large for DDP on the smallest card, sharded by dptune's default (``fully_shard`` on each
block, then the root) with a bf16 ``MixedPrecisionPolicy`` (gradients reduced in fp32):

- **DDP at batch 1**: one DDP rank (fp32 weights, bf16 autocast) on the smallest card: its
  peak against the card's budget;
- **equal**: every rank runs the same batch, so the smallest card decides:
  ``world_size x min_r cap_r``, ``cap_r`` the largest local batch rank r fits, found by
  bisection on the simulated FSDP2 rank at the level (exact where the figure grows with the
  batch; ``--scan`` batches each side of every cap are run too, "caps scanned");
- **dptune**: ``dptune.ddp.plan(..., strategy="fsdp", objective="max_batch")``: its local
  batches, rounds, probes (simulations run: one per card type and local batch), wall time,
  which ranks' own probes certify their batch;
- **optimum**: ``sum_r cap_r`` (ranks are independent given their shards).

A probe of the 2B decoder takes about 6 s on a 2-core machine (the fake step's cost grows
with the number of ops, not with the batch). Writes ``fsdp.md`` and ``fsdp.csv``
(``fsdp-allocated.*`` at the allocated level) under ``--out`` and prints the Markdown table,
then the notes of every plan that is not certified.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from dptune import ddp
from dptune.hardware.cluster import parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
from dptune.backends.simulated.fsdp import FakeGroup, SimulatedFSDPRank
from dptune.ddp.fsdp import FSDPOptions, mixed_precision
from dptune.examples.models import TinyGPT, n_params
from dptune.budget import Collectives
from dptune.ddp.ranks import simulated_peak
from dptune.units import format_bytes
from dptune.step.workload import Workload

from benchmarks import config
from benchmarks.ddp import bisect_cap, open_brackets, rank_certified, rank_model, scan_agrees, uncertified_notes
from benchmarks.output import write_table

__all__ = ["CASES", "FSDPRow", "exact_caps", "run_case", "table", "main"]


@dataclass(frozen=True)
class Case:
    name: str
    cluster: str
    d_model: int
    n_layers: int
    seq_len: int

    def model(self) -> Callable[[], TinyGPT]:
        d, n, t = self.d_model, self.n_layers, self.seq_len
        return lambda: TinyGPT(vocab_size=32000, d_model=d, n_layers=n, n_heads=d // 128, seq_len=t)

    def sample(self) -> Callable[[int], Any]:
        t = self.seq_len

        def sample(b: int) -> tuple:
            idx = torch.randint(0, 32000, (b, t))
            return idx, torch.roll(idx, -1, dims=1)       # forward(idx, targets): the loss
        return sample


#: a ~2B decoder on two card sizes, a ~1B decoder on three cards, the last small
CASES = {
    "2B": Case("2B", "2x80GB,2x40GB", d_model=2560, n_layers=24, seq_len=2048),
    "1B": Case("1B", "24GB,24GB,12GB", d_model=2048, n_layers=18, seq_len=1024),
}


@dataclass
class FSDPRow:
    case: str
    params: int
    cluster: str
    ddp_peak_bytes: int        # one DDP rank at batch 1 on the smallest card
    ddp_budget_bytes: int
    caps: list[int]
    equal: int
    planned: list[int]
    optimum: int
    rounds: int
    probes: int                # the plan's per-rank probes
    simulations: int           # simulated steps the plan ran (per card type and batch)
    certified: bool
    seconds: float
    level: str = "allocated"
    rank_certified: list[bool] = field(default_factory=list)
    caps_scanned: Optional[bool] = None
    notes: list[str] = field(default_factory=list)

    @property
    def gain(self) -> float:
        return sum(self.planned) / self.equal - 1.0 if self.equal else float("inf")


def exact_caps(workload: Workload, cluster: str, headroom: int, options: FSDPOptions,
               reserved: Any = None, scan: int = 0) -> list[int]:
    """Per rank, the largest local batch within its budget (doubling, then bisection; one
    simulated rank per card type); ``reserved``: the allocator model (the reserved level),
    else the allocated peak. ``scan``: the batches each side of every cap run as well (see
    :func:`scan_caps`)."""
    return scan_caps(workload, cluster, headroom, options, reserved, scan)[0]


def scan_caps(workload: Workload, cluster: str, headroom: int, options: FSDPOptions,
              reserved: Any = None, scan: int = 0) -> tuple[list[int], bool]:
    """(:func:`exact_caps`, whether every batch within ``scan`` of each cap fits up to it and
    is over above it)."""
    c = parse_cluster(cluster)
    sims: dict[str, SimulatedFSDPRank] = {}
    memo: dict[tuple[str, int], int] = {}
    caps = []
    agree = True
    group = FakeGroup(len(c))
    model = rank_model(reserved, len(c), Collectives.FSDP)
    try:
        for r, dev in enumerate(c.devices):
            name = c.names[r]
            if name not in sims:
                sims[name] = SimulatedFSDPRank(workload, card_of(c, r), len(c), options.shard_fn(),
                                               group=group, reserved=model)
            budget = dev.budget_bytes(headroom)

            def fits(b: int, name: str = name, budget: int = budget, dev: Any = dev) -> bool:
                if (name, b) not in memo:
                    memo[(name, b)] = simulated_peak(sims[name], dev, b)
                return memo[(name, b)] <= budget

            if not fits(1):
                caps.append(0)
                continue
            lo = bisect_cap(fits)
            caps.append(lo)
            agree = agree and (not scan or scan_agrees(fits, lo, scan))
    finally:
        for s in sims.values():
            s.close()
        group.close()
    return caps, agree


def run_case(case: Case, level: str = config.LEVELS[0], headroom_given: Optional[str] = None,
             scan: int = 2) -> FSDPRow:
    model, sample = case.model(), case.sample()
    budget = config.level_budget(level, headroom_given)
    headroom = budget.headroom_bytes
    options = FSDPOptions(mp_policy=mixed_precision("bf16"))
    cluster = parse_cluster(case.cluster)
    small = min(range(len(cluster)), key=lambda r: cluster.devices[r].budget_bytes(headroom))
    ddp_rank = SimulatedDDPRank(Workload(model, sample, None, config.optimizer, amp="bf16"),
                                card_of(cluster, small),
                                reserved=rank_model(budget.reserved, len(cluster), Collectives.DDP))
    try:
        ddp_peak = simulated_peak(ddp_rank, cluster.devices[small], 1)
    finally:
        ddp_rank.close()
    caps, agree = scan_caps(Workload(model, sample, None, config.optimizer), case.cluster, headroom,
                            options, budget.reserved, scan)
    simulations = 0
    # every simulated step goes through _estimated (estimate at the allocated level, probe
    # with the allocator model at the reserved one)
    estimate = SimulatedFSDPRank._estimated

    def counted(self: SimulatedFSDPRank, sizes: Sequence[int], *a: Any) -> Any:
        nonlocal simulations
        simulations += 1
        return estimate(self, sizes, *a)

    SimulatedFSDPRank._estimated = counted  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        plan = ddp.plan(model, sample, optimizer=config.optimizer, objective="max_batch",
                        simulate=case.cluster, budget=budget, strategy="fsdp",
                        mp_policy=options.mp_policy)   # as the caps
        seconds = time.perf_counter() - t0
    finally:
        SimulatedFSDPRank._estimated = estimate  # type: ignore[method-assign]
    with torch.device("meta"):
        params = n_params(model())
    return FSDPRow(case=case.name, params=params, cluster=case.cluster, ddp_peak_bytes=ddp_peak,
                   ddp_budget_bytes=cluster.devices[small].budget_bytes(headroom), caps=caps,
                   equal=len(caps) * min(caps), planned=plan.batch_sizes, optimum=sum(caps),
                   rounds=plan.rounds, probes=len(plan.probes), simulations=simulations,
                   certified=plan.certified, seconds=seconds, level=level,
                   rank_certified=rank_certified(plan.probes, plan.batch_sizes),
                   caps_scanned=agree if scan else None,
                   notes=open_brackets(plan.probes, plan.batch_sizes) + list(plan.notes))


def table(rows: Sequence[FSDPRow]) -> str:
    head = ("| decoder | cluster | level | DDP at batch 1 (smallest card) | equal local batches "
            "| dptune plan (per rank) | optimum | gain | rounds (probes, simulations) | certified "
            "| ranks certified | caps scanned | plan time |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ddp_fit = "fits" if r.ddp_peak_bytes <= r.ddp_budget_bytes else "does not fit"
        lines.append(
            f"| {r.params / 1e9:.2f}B | {r.cluster} | {r.level} | {format_bytes(r.ddp_peak_bytes)} of "
            f"{format_bytes(r.ddp_budget_bytes)}: {ddp_fit} | {r.equal} ({r.equal // len(r.caps)} per "
            f"rank) | {sum(r.planned)} {r.planned} | {r.optimum} | {100 * r.gain:+.0f}% "
            f"| {r.rounds} ({r.probes}, {r.simulations}) | {'yes' if r.certified else 'no'} "
            f"| {sum(r.rank_certified)}/{len(r.rank_certified)} "
            f"| {'-' if r.caps_scanned is None else 'yes' if r.caps_scanned else 'NO'} "
            f"| {r.seconds:.0f} s |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=sorted(CASES))
    ap.add_argument("--out", default="reports/benchmarks")
    ap.add_argument("--scan", type=int, default=2,
                    help="batches run each side of every cap to check the bisection (0: none)")
    config.add_level_options(ap)
    args = ap.parse_args(argv)
    rows = [run_case(CASES[c], args.level, args.headroom, args.scan) for c in args.cases]
    text = table(rows)
    write_table(args.out, "fsdp" if args.level == config.LEVELS[0] else f"fsdp-{args.level}", text, rows)
    print(text)
    notes = uncertified_notes(rows, lambda r: f"{r.case} {r.cluster}")
    if notes:
        print("\n" + notes)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
