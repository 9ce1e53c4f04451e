"""One card's figures chunk by chunk on the simulator's allocator model: where the reserved
peak is set by fragmentation rather than by the work.

``python -m benchmarks.fragmentation [--model ResNet] [--cluster 2x24GB] [--card 1] [--chunks
3048:3058]`` (tens of seconds per chunk on 2 cores): card 0 at the model's smallest work, the
other cards at each chunk; per chunk card ``--card``'s allocated peak, its reserved peak with
the default allocator and with ``expandable_segments:True``, each from a replay of its
set-up, a warm-up step and the measured step without a capacity limit (the figure the
default budget level checks, less NCCL's buffers), and the least memory the default
allocator runs the step in when it may free its cache and retry a ``cudaMalloc`` (what a card
needs for it, at the cost of a cache flush in every step). Estimated, not measured on a card.
The BatchNorm CNN of ``make bench`` swings by 3.4 GB between neighbouring chunks with the default
allocator and not with expandable segments (see ``docs/guides/reserved-level-search.md``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from benchmarks import config

MiB = 2**20


def figures(model: str, cluster: str, card: int, chunks: Sequence[int]) -> list[tuple[int, int, int, int, int]]:
    """Per chunk: (chunk, allocated peak, reserved peak, reserved peak with expandable
    segments, the least memory the default allocator runs the step in when it may free its
    cache and retry), bytes, the peaks from the probes' ``memory_stats`` (torch's key
    names), the last from :func:`~dptune.backends.simulated.reserved.least_capacity`."""
    from dptune.backends.simulated import SimulatedBackend, parse_cluster
    from dptune.backends.simulated.allocator import AllocatorConfig
    from dptune.backends.simulated.reserved import ReservedModel, least_capacity
    from dptune.step.workload import Workload

    spec = config.MODELS[model]
    net, sample = spec.workload_args()
    workload = Workload(net, sample, None, config.optimizer)
    plain, grown = (SimulatedBackend(workload, parse_cluster(cluster), reserved=ReservedModel(cfg))
                    for cfg in (AllocatorConfig(), AllocatorConfig(expandable_segments=True)))
    n = len(plain.devices)
    out = []
    for c in chunks:
        split = [max(2, spec.hint_per_card)] + [c] * (n - 1)
        a = plain.probe(split).memory_stats[card]
        need = least_capacity(plain.allocator_traces(card))
        b = grown.probe(split).memory_stats[card]
        out.append((c, a["allocated_bytes.all.peak"], a["reserved_bytes.all.peak"],
                    b["reserved_bytes.all.peak"], need))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="ResNet", choices=sorted(config.MODELS))
    p.add_argument("--cluster", default="2x24GB")
    p.add_argument("--card", type=int, default=1)
    p.add_argument("--chunks", default="3048:3058", help="FIRST:LAST (inclusive)")
    args = p.parse_args(argv)
    lo, hi = (int(x) for x in args.chunks.split(":"))
    print(f"| samples on card {args.card} | allocated peak (MiB) | reserved peak (MiB) | "
          "with expandable_segments:True (MiB) | least reserved it runs in, retrying (MiB) |")
    print("|---|---|---|---|---|")
    for c, a, r, e, need in figures(args.model, args.cluster, args.card, range(lo, hi + 1)):
        print(f"| {c:,} | {a // MiB:,} | {r // MiB:,} | {e // MiB:,} | {need // MiB:,} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
