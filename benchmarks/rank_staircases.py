"""The ranks' search (DDP, FSDP) on the reserved level's staircases: rounds to a certified cap.

``python -m benchmarks.rank_staircases [--seeds 300] [--rounds 16]``: synthetic, no torch
model. Each case is one to four ranks whose figure is a random network's reserved peak as the
caching allocator rounds it: one to four activations of ``s`` bytes per sample (feature
widths with and without large powers of two), each live ``k`` times, every block rounded up
to 2 MiB, over a fixed 1-6 GiB; budgets of 24-80 GiB. Every rank starts with one probe at
one sample (``ddp.plan`` probes the smallest batch, then eight times it). For the staircase search (what ``ddp.plan`` runs
at the reserved level) and, beside it, the allocated level's search (secant and bisection
alternating) on the same surfaces, prints

- how many cases are certified within ``--rounds`` rounds (``ddp.plan``'s default: 16),
- the rounds to certify every case with a cap of 60, summed and at the 90th percentile,
- how many answers differ from the exact cap (bisection of the rising surface): must be 0.

Counts, not times; one run is the whole measurement.
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Callable, Optional, Sequence

GiB = 2**30
_TWO_MIB = 2 * 2**20

Peak = Callable[[int, int], int]


def layered_staircase(seed: int) -> tuple[Peak, list[int]]:
    """A random rank surface ``peak(rank, batch)`` (bytes) and the ranks' budgets."""
    rnd = random.Random(seed)
    layers = [(rnd.choice([4096, 8192, 16384, 32768, 3072, 6144, 12288, 49152, 2304])
               * rnd.choice([1, 1, 2, 4]), rnd.randint(1, 8)) for _ in range(rnd.randint(1, 4))]
    base = int(rnd.uniform(1, 6) * GiB)
    budgets = [rnd.choice([24, 32, 40, 80]) * GiB for _ in range(rnd.randint(1, 4))]

    def peak(r: int, b: int) -> int:
        return base + sum(k * (-(-b * s // _TWO_MIB) * _TWO_MIB) for s, k in layers)
    return peak, budgets


def exact_cap(peak: Peak, r: int, budget: int) -> int:
    """Rank ``r``'s largest batch within ``budget`` (the surface rises with the batch)."""
    lo, hi = 0, 1 << 26
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(r, mid) <= budget else (lo, mid)
    return lo


def search(peak: Peak, budgets: Sequence[int], rounds: int, staircase: bool) -> tuple[bool, int, bool]:
    """(certified, rounds run, every answer exact or open below the cap) for one case."""
    from dptune.search.ranks import RankObservations, bracket_ranks

    obs = RankObservations(budgets, 1)

    def run(sizes: Sequence[Optional[int]]) -> None:
        obs.run(lambda fn: [fn(r) for r in range(obs.n)], sizes, peak)

    run([1] * len(budgets))
    certified = bracket_ranks(obs, run, rounds, None, staircase=staircase)
    caps = [exact_cap(peak, r, b) for r, b in enumerate(budgets)]
    sound = all(obs.lo(r) <= c and (not certified or obs.lo(r) == c) for r, c in enumerate(caps))
    return certified, obs.rounds, sound


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args(argv)
    cases = [layered_staircase(s) for s in range(args.seeds)]
    print(f"| search | certified within {args.rounds} rounds | rounds to certify (cap 60): sum | "
          "90th percentile | not exact |")
    print("|---|---|---|---|---|")
    for name, staircase in (("staircase (reserved level)", True), ("secant and bisection (allocated level)", False)):
        capped = [search(p, b, args.rounds, staircase) for p, b in cases]
        full = [search(p, b, 60, staircase) for p, b in cases]
        used = sorted(r for _, r, _ in full)
        bad = sum(not s for _, _, s in capped + full) + sum(not c for c, _, _ in full)
        print(f"| {name} | {sum(c for c, _, _ in capped)} of {len(cases)} | {sum(used)} | "
              f"{used[int(0.9 * (len(used) - 1))]} | {bad} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
