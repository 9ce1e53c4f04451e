"""DDP on unequal cards: the largest global batch with equal local batches vs dptune's plan.

``python -m benchmarks.ddp [--level reserved|allocated] [--models MLP GPT] [--out
reports/benchmarks]``, simulated, AdamW, DDP's default buckets, at dptune's default budget level
(``reserved``: the allocator model's reserved peak plus NCCL's buffers, headroom 256 MiB) or
``--level allocated`` (the allocated peak, headroom 1 GiB). For each model x cluster:

- **equal**: plain DDP gives every rank the same batch, so the smallest card decides:
  ``world_size x min_r cap_r``, with ``cap_r`` the largest local batch rank r fits, found by
  bisection on the simulator at the level (exact where the figure grows with the batch; at
  ``reserved`` it need not, so every batch within ``--scan`` samples of each cap is run too:
  "caps scanned" says whether they agree, fitting up to the cap and over above it);
- **dptune**: ``dptune.ddp.plan(..., objective="max_batch")`` at the same level and headroom
  (its rounds and probes, whether it is certified and which ranks' own probes certify their
  batch, fitting at it and over at one more, its notes, its wall time);
- **optimum**: ranks are independent under DDP, so the exact optimum is ``sum_r cap_r``.

Writes ``ddp.md`` and ``ddp.csv`` (``ddp-allocated.*`` at the allocated level) under ``--out``
and prints the Markdown table, then the notes of every plan that is not certified.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dptune import ddp
from dptune.backends.simulated import parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
from dptune.budget import Collectives, FixedCosts
from dptune.ddp.ranks import simulated_peak
from dptune.step.workload import Workload

from benchmarks import config
from benchmarks.output import write_table

__all__ = ["CLUSTERS", "DDPRow", "exact_caps", "scan_caps", "scan_agrees", "bisect_cap", "rank_certified", "rank_model",
           "open_brackets", "uncertified_notes", "run_case", "table",
           "main"]

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
    level: str = "allocated"
    rank_certified: list[bool] = field(default_factory=list)  # rank's own probes: fits, one more over
    caps_scanned: Optional[bool] = None   # the scan around each cap agreed with the bisection
    notes: list[str] = field(default_factory=list)

    @property
    def gain(self) -> float:
        return sum(self.planned) / self.equal - 1.0 if self.equal else float("inf")


def rank_model(reserved: Any, n_ranks: int, collectives: Collectives) -> Any:
    """The allocator model of one rank of ``n_ranks`` (NCCL's buffers for the strategy's
    communicator), as the planner's simulated probers build it; ``None`` stays ``None``."""
    if reserved is None:
        return None
    return dataclasses.replace(reserved, fixed=FixedCosts(reserved.fixed.nccl_for(n_ranks, collectives)))


class _Ranks:
    """Each card type's simulated DDP rank, its peaks at the level memoized."""

    def __init__(self, workload: Workload, cluster: str, headroom: int, reserved: Any = None):
        self.c = parse_cluster(cluster)
        self.workload, self.headroom = workload, headroom
        self.model = rank_model(reserved, len(self.c), Collectives.DDP)
        self.sims: dict[str, SimulatedDDPRank] = {}
        self.memo: dict[tuple[str, int], int] = {}

    def fits(self, r: int, b: int) -> bool:
        name = self.c.names[r]
        if name not in self.sims:
            self.sims[name] = SimulatedDDPRank(self.workload, card_of(self.c, r), reserved=self.model)
        if (name, b) not in self.memo:
            self.memo[(name, b)] = simulated_peak(self.sims[name], self.c.devices[r], b)
        return self.memo[(name, b)] <= self.c.devices[r].budget_bytes(self.headroom)

    def close(self) -> None:
        for s in self.sims.values():
            s.close()


def bisect_cap(fits: Any) -> int:
    """The largest batch with ``fits`` (true then false; 0 when 1 does not fit), by doubling
    then bisection."""
    hi = 1
    while fits(hi):
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def scan_agrees(fits: Any, cap: int, width: int) -> bool:
    """Every batch from ``cap - width`` to ``cap`` fits and every one up to ``cap + width`` is
    over (the bisection's answer holds there: no fit above a failure near the cap)."""
    return all(fits(b) == (b <= cap) for b in range(max(1, cap - width), cap + width + 1))


def exact_caps(workload: Workload, cluster: str, headroom: int, reserved: Any = None) -> list[int]:
    """Per rank, the largest local batch within its budget (bisection; ranks on one card
    type share the simulator); ``reserved``: the allocator model (the reserved level), else
    the allocated peak."""
    caps, _ = scan_caps(workload, cluster, headroom, reserved, width=0)
    return caps


def scan_caps(workload: Workload, cluster: str, headroom: int, reserved: Any = None,
              width: int = 4) -> tuple[list[int], bool]:
    """(:func:`exact_caps`, whether a scan of ``width`` batches each side of every cap agrees)."""
    ranks = _Ranks(workload, cluster, headroom, reserved)
    try:
        caps = [bisect_cap(lambda b, r=r: ranks.fits(r, b)) for r in range(len(ranks.c))]
        agree = all(scan_agrees(lambda b, r=r: ranks.fits(r, b), cap, width)
                    for r, cap in enumerate(caps)) if width else True
    finally:
        ranks.close()
    return caps, agree


def rank_certified(probes: Sequence[Any], planned: Sequence[int]) -> list[bool]:
    """Per rank, whether its own probes certify its planned batch ``b``: measured within
    budget at ``b`` and over at ``b + 1``."""
    def seen(r: int, b: int, fits: bool) -> bool:
        return any(p.rank == r and p.batch_size == b and p.fits == fits for p in probes)
    return [seen(r, b, True) and seen(r, b + 1, False) for r, b in enumerate(planned)]


def open_brackets(probes: Sequence[Any], planned: Sequence[int]) -> list[str]:
    """Each rank whose own probes do not certify its batch: the largest batch it was measured
    to fit and the smallest measured over (the bracket the search left open)."""
    out = []
    for r, ok in enumerate(rank_certified(probes, planned)):
        if ok:
            continue
        fit = max((p.batch_size for p in probes if p.rank == r and p.fits), default=None)
        over = min((p.batch_size for p in probes if p.rank == r and not p.fits), default=None)
        out.append(f"rank {r}: planned {planned[r]}, fits at {fit}, over at {over}")
    return out


def run_case(model_name: str, cluster: str, level: str = config.LEVELS[0],
             headroom: Optional[str] = None, scan: int = 4) -> DDPRow:
    spec = config.MODELS[model_name]
    model, sample = spec.workload_args()
    budget = config.level_budget(level, headroom)
    caps, agree = scan_caps(Workload(model, sample, None, config.optimizer), cluster,
                            budget.headroom_bytes, budget.reserved, scan)
    t0 = time.perf_counter()
    plan = ddp.plan(model, sample, optimizer=config.optimizer, objective="max_batch",
                    simulate=cluster, budget=budget)   # as the caps
    seconds = time.perf_counter() - t0
    return DDPRow(model=model_name, cluster=cluster, caps=caps, equal=len(caps) * min(caps),
                  planned=plan.batch_sizes, optimum=sum(caps), rounds=plan.rounds,
                  probes=len(plan.probes), certified=plan.certified, seconds=seconds,
                  level=level, rank_certified=rank_certified(plan.probes, plan.batch_sizes),
                  caps_scanned=agree if scan else None,
                  notes=open_brackets(plan.probes, plan.batch_sizes) + list(plan.notes))


def _yes(x: Optional[bool]) -> str:
    return "-" if x is None else "yes" if x else "NO"


def table(rows: Sequence[DDPRow]) -> str:
    head = ("| model | cluster | level | equal local batches | dptune plan (per rank) | optimum | gain "
            "| rounds (probes) | certified | ranks certified | caps scanned |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        ranks = f"{sum(r.rank_certified)}/{len(r.rank_certified)}" if r.rank_certified else "-"
        lines.append(f"| {r.model} | {r.cluster} | {r.level} | {r.equal} ({r.equal // len(r.caps)} per rank) "
                     f"| {sum(r.planned)} {r.planned} | {r.optimum} | {100 * r.gain:+.0f}% "
                     f"| {r.rounds} ({r.probes}) | {'yes' if r.certified else 'no'} | {ranks} "
                     f"| {_yes(r.caps_scanned)} |")
    return "\n".join(lines)


def uncertified_notes(rows: Sequence[Any], name: Any) -> str:
    """The notes of every row not certified (why the search stopped), one block per row."""
    out = []
    for r in rows:
        if not r.certified:
            out.append(f"{name(r)} at {r.level}: not certified")
            out += [f"  note: {n}" for n in r.notes]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["MLP", "GPT"], choices=sorted(config.MODELS))
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    ap.add_argument("--out", default="reports/benchmarks")
    ap.add_argument("--scan", type=int, default=4,
                    help="batches run each side of every cap to check the bisection (0: none)")
    config.add_level_options(ap)
    args = ap.parse_args(argv)
    rows = [run_case(m, c, args.level, args.headroom, args.scan)
            for m in args.models for c in args.clusters]
    text = table(rows)
    write_table(args.out, "ddp" if args.level == config.LEVELS[0] else f"ddp-{args.level}", text, rows)
    print(text)
    notes = uncertified_notes(rows, lambda r: f"{r.model} {r.cluster}")
    if notes:
        print("\n" + notes)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
