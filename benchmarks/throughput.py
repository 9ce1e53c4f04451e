"""Samples per second on cards that differ in speed: even, memory-balanced and fastest splits.

``python -m benchmarks.throughput [--models GPT ResNet] [--clusters ...] [--out reports/benchmarks]``,
simulated, headroom :data:`benchmarks.config.HEADROOM`, AdamW. For each model x cluster,
``Tuner(objective="throughput")`` at the batch ``hint_per_card x cards`` gives, from its
probes (every figure the simulator's estimate: FLOPs and bytes against the cards' datasheet
peaks, DataParallel's copies over PCIe; see :mod:`dptune.backends.timing`):

- **even**: ``torch.chunk``'s split (plain DataParallel);
- **memory-balanced**: ``objective="balance"`` (the same share of memory on every card);
- **fastest**: ``objective="throughput"``, measured within every budget, with the cards it
  leaves out (a card worth dropping: the step is faster without it).

Models: ``GPT`` (returns its logits, which DataParallel gathers onto card 0: 32 x 256 x 32000
floats per step), ``GPT-loss`` (the same model given its targets, returning the loss) and
``ResNet`` (a CNN with BatchNorm).

Writes ``throughput.md`` and ``throughput.csv`` under ``--out`` and prints the Markdown table.
The estimate is unvalidated on GPUs unless ``benchmarks/validate_gpu.py`` says otherwise.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dptune import Tuner
from dptune.backends.cluster import parse_cluster

from benchmarks import config
from benchmarks.output import write_table

__all__ = ["CLUSTERS", "ThroughputRow", "run_case", "table", "main"]

#: Mixed speeds, four equal cards, and a slow card beside a fast one (worth dropping).
CLUSTERS = ("A100-80GB,A6000", "RTX4090,RTX3090", "4xA100-80GB", "RTX4090,T4")


@dataclass
class ThroughputRow:
    model: str
    cluster: str
    batch: int
    even_split: list[int]
    even_sps: float             # samples per second (estimated)
    balanced_split: list[int]
    balanced_sps: float
    fastest_split: list[int]
    fastest_sps: float
    dropped: list[int]          # cards the fastest split leaves out
    probes: int
    seconds: float

    @property
    def gain(self) -> float:
        return self.fastest_sps / self.even_sps - 1.0 if self.even_sps else float("inf")


#: The benchmark's GPT returning its loss (DataParallel gathers one number per card), beside
#: ``GPT`` of :mod:`benchmarks.config`, which returns its logits (gathered onto card 0).
GPT_LOSS = "GPT-loss"


def _workload(model_name: str) -> tuple[Any, Any, Any]:
    if model_name == GPT_LOSS:
        from dptune.examples.models import TinyGPT

        spec = config.MODELS["GPT"]
        model = TinyGPT(n_layers=2)
        return spec, model, model.sample_with_targets
    spec = config.MODELS[model_name]
    model, sample = spec.workload_args()
    return spec, model, sample


def run_case(model_name: str, cluster: str) -> ThroughputRow:
    spec, model, sample = _workload(model_name)
    batch = spec.hint_per_card * len(parse_cluster(cluster))
    t0 = time.perf_counter()
    tuner = Tuner(model, sample, batch_size=batch, optimizer=config.optimizer, simulate=cluster,
                  objective="throughput", headroom=config.HEADROOM, verbose=False, amp=spec.amp,
                  budget_level="allocated")
    result = tuner.fit()
    seconds = time.perf_counter() - t0
    even, balanced, fastest = tuner.speed
    return ThroughputRow(
        model=model_name, cluster=cluster, batch=batch,
        even_split=list(even.chunk_sizes), even_sps=even.samples_per_second or 0.0,
        balanced_split=list(balanced.chunk_sizes), balanced_sps=balanced.samples_per_second or 0.0,
        fastest_split=list(fastest.chunk_sizes), fastest_sps=fastest.samples_per_second or 0.0,
        dropped=[i for i, c in enumerate(fastest.chunk_sizes) if c == 0],
        probes=len(result.probes), seconds=seconds)


def table(rows: Sequence[ThroughputRow]) -> str:
    head = ("| model | cluster | batch | even (samples/s) | memory-balanced | fastest | "
            "fastest vs even | cards left out | probes |\n|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        def cell(split: list[int], sps: float) -> str:
            return f"{sps:,.0f} [{'/'.join(map(str, split))}]"
        lines.append(f"| {r.model} | {r.cluster} | {r.batch} | {cell(r.even_split, r.even_sps)} "
                     f"| {cell(r.balanced_split, r.balanced_sps)} "
                     f"| {cell(r.fastest_split, r.fastest_sps)} | {100 * r.gain:+.0f}% "
                     f"| {', '.join(map(str, r.dropped)) or '-'} | {r.probes} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["GPT", GPT_LOSS, "ResNet"],
                    choices=sorted(config.MODELS) + [GPT_LOSS])
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    ap.add_argument("--out", default="reports/benchmarks")
    args = ap.parse_args(argv)
    rows = [run_case(m, c) for m in args.models for c in args.clusters]
    text = table(rows) + ("\n\nAll figures estimated on the simulated cluster (dptune.backends."
                          "timing), samples per second of one DataParallel training step.")
    write_table(args.out, "throughput", text, rows)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
