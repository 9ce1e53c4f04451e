"""Samples per second on cards that differ in speed: even, memory-balanced and fastest splits.

``python -m benchmarks.throughput [--models GPT ResNet] [--clusters ...] [--out reports/benchmarks]``,
simulated, headroom :data:`benchmarks.config.HEADROOM`, AdamW. For each model x cluster,
``Tuner(objective="throughput")`` at the batch ``hint_per_card x cards`` gives, from its
probes (every figure the simulator's estimate: FLOPs and bytes against the cards' datasheet
peaks, DataParallel's copies over PCIe; see :mod:`dptune.backends.simulated.timing`):

- **even**: ``torch.chunk``'s split (plain DataParallel);
- **memory-balanced**: ``objective="balance"`` (the same share of memory on every card);
- **fastest**: ``objective="throughput"``, measured within every budget, with the cards it
  leaves out (a card worth dropping: the step is faster without it).

Models: ``GPT`` (returns its logits, which DataParallel gathers onto card 0: 32 x 256 x 32000
floats per step), ``GPT-loss`` (the same model given its targets, returning the loss) and
``ResNet`` (a CNN with BatchNorm).

``--global-batch`` runs :data:`GLOBAL_CASES` instead: a fixed global batch trained with
gradient accumulation, ``Tuner(objective="throughput", global_batch=N)`` (the number of
micro-batches and the micro-batch's split that finish N samples fastest) against the usual
setup, the even split of the per-card hint's batch repeated ``N / batch`` times; writes
``throughput_global.md`` and ``.csv``.

Writes ``throughput.md`` and ``throughput.csv`` under ``--out`` and prints the Markdown table.
The estimate is unvalidated on GPUs unless ``benchmarks/validate_gpu.py`` says otherwise.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dptune import Tuner
from dptune.hardware.cluster import parse_cluster

from benchmarks import config
from benchmarks.output import write_table

__all__ = ["CLUSTERS", "ThroughputRow", "run_case", "table", "GLOBAL_CASES", "GlobalRow",
           "run_global", "global_table", "main"]

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


#: (model, cluster, global batch): mixed speeds with room to spare, and small cards where the
#: global batch needs several micro-batches.
GLOBAL_CASES = (("GPT-loss", "RTX4090,RTX3090", 512), ("ResNet", "RTX4090,RTX3090", 2048),
                ("GPT-loss", "2x8GB,tflops=1:40", 512), ("ResNet", "RTX4090,T4", 1024))


@dataclass
class GlobalRow:
    model: str
    cluster: str
    global_batch: int
    batch: int                  # the usual micro-batch: the per-card hint x cards
    even_split: list[int]
    even_seconds: float         # the global batch as N / batch even steps
    micro_batches: int
    split: list[int]            # the plan's micro-batch split
    seconds: float              # the plan's time for the global batch
    probes: int

    @property
    def gain(self) -> float:
        return self.even_seconds / self.seconds - 1.0 if self.seconds else float("inf")


def run_global(model_name: str, cluster: str, global_batch: int) -> GlobalRow:
    spec, model, sample = _workload(model_name)
    batch = spec.hint_per_card * len(parse_cluster(cluster))
    tuner = Tuner(model, sample, batch_size=batch, optimizer=config.optimizer, simulate=cluster,
                  objective="throughput", headroom=config.HEADROOM, verbose=False, amp=spec.amp,
                  global_batch=global_batch)
    result = tuner.fit()
    even = tuner.speed[0]
    chosen = next(p for p in result.probes if list(p.chunk_sizes) == result.chunk_sizes)
    k = global_batch // result.batch_size
    assert chosen.time is not None and even.step_seconds is not None
    return GlobalRow(model=model_name, cluster=cluster, global_batch=global_batch, batch=batch,
                     even_split=list(even.chunk_sizes),
                     even_seconds=-(-global_batch // batch) * even.step_seconds,
                     micro_batches=k, split=list(result.chunk_sizes),
                     seconds=k * chosen.time.step_seconds, probes=len(result.probes))


def global_table(rows: Sequence[GlobalRow]) -> str:
    head = ("| model | cluster | global batch | even, accumulated | fastest plan | "
            "plan vs even | probes |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        even = (f"{r.global_batch // r.batch if r.global_batch % r.batch == 0 else -(-r.global_batch // r.batch)}"
                f" x [{'/'.join(map(str, r.even_split))}]: {r.even_seconds * 1e3:,.1f} ms")
        plan = f"{r.micro_batches} x [{'/'.join(map(str, r.split))}]: {r.seconds * 1e3:,.1f} ms"
        lines.append(f"| {r.model} | {r.cluster} | {r.global_batch} | {even} | {plan} "
                     f"| {100 * r.gain:+.0f}% | {r.probes} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["GPT", GPT_LOSS, "ResNet"],
                    choices=sorted(config.MODELS) + [GPT_LOSS])
    ap.add_argument("--clusters", nargs="+", default=list(CLUSTERS))
    ap.add_argument("--out", default="reports/benchmarks")
    ap.add_argument("--global-batch", action="store_true",
                    help="the fixed-global-batch cases (GLOBAL_CASES) instead")
    args = ap.parse_args(argv)
    if args.global_batch:
        grows = [run_global(m, c, g) for m, c, g in GLOBAL_CASES]
        text = global_table(grows) + ("\n\nAll figures estimated on the simulated cluster: the "
                                      "time of one global batch (every micro-batch a whole step).")
        write_table(args.out, "throughput_global", text, grows)
        print(text)
        return 0
    rows = [run_case(m, c) for m in args.models for c in args.clusters]
    text = table(rows) + ("\n\nAll figures estimated on the simulated cluster (dptune.backends."
                          "timing), samples per second of one DataParallel training step.")
    write_table(args.out, "throughput", text, rows)
    print(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
