"""The allocator model's cost and figures on the simulated cluster.

For each benchmark model, one even split on a simulated cluster: the probe's simulated step
time, the time the allocator model's replay adds (set-up + warm-up step + measured step per
card, :mod:`dptune.backends.simulated.reserved`; like cards with like traces share one replay, the
``replays`` column), and per card the allocated peak (the ledger's, as
``max_memory_allocated``), the predicted reserved peak, the predicted total use (reserved +
CUDA context + NCCL) and, where reserved exceeds allocated widely, the reserved peak predicted
with ``expandable_segments:True``. Times are medians over ``repeats`` probes.

    python -m benchmarks.reserved [--models MLP,GPT] [--cluster 4x24GB] [--repeats 3]
    python -m benchmarks.reserved --models GPT --varied 34,28,36,30,35,32   # changing batch

The reserved figures are a model of the allocator, checked on one H200 (2026-11-27: -14.6% to
+6.9% of max_memory_reserved on 19 single-card steps; not on several cards or NCCL).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Optional, Sequence

__all__ = ["measure", "table", "varied", "main"]


def measure(names: Sequence[str], cluster: str = "4x24GB", repeats: int = 3,
            per_card: Optional[int] = None) -> list[dict[str, Any]]:
    """One row per model: times (seconds) and per-card figures (bytes)."""
    from benchmarks.config import MODELS, optimizer
    from dptune.backends.simulated.reserved import ReservedModel
    from dptune.backends.simulated import SimulatedBackend, parse_cluster
    from dptune.step.workload import Workload

    n = len(parse_cluster(cluster))
    rows = []
    for name in names:
        spec = MODELS[name]
        model, sample = spec.workload_args()
        split = [per_card or spec.hint_per_card] * n
        b = SimulatedBackend(Workload(model, sample, optimizer=optimizer, amp=spec.amp), cluster,
                             reserved=ReservedModel())
        b.probe(split)                                   # set-up, not timed
        steps, replays, r = [], [], None
        for _ in range(repeats):
            est = b.estimate(split)
            assert b._recorder is not None
            fig = b.reserved.predict(b._recorder.events, b._step_trace, b.devices)  # type: ignore[union-attr]
            steps.append(est.seconds)
            replays.append(fig.seconds)
            r = (est, fig)
        assert r is not None
        est, fig = r
        rows.append({
            "model": name, "split": split, "step_s": statistics.median(steps),
            "replay_s": statistics.median(replays),
            "events": sum(len(e) for e in b._step_trace), "replays": fig.replays,
            "modes": 1 if fig.expandable is None else 2,
            "allocated": list(est.peak_bytes),
            "reserved": [s.reserved_peak for s in fig.stats],
            "total": list(fig.total_bytes),
            "retries": [s.num_alloc_retries for s in fig.stats],
            "expandable": None if fig.expandable is None else [s.reserved_peak for s in fig.expandable],
        })
        b.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: the overhead per model, then the figures per card."""
    from dptune.units import format_bytes

    out = ["| model | split | simulated step | replay | events (step) | replays | replay / step |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['split']} | {r['step_s']:.2f} s | {r['replay_s'] * 1000:.1f} ms"
                   f" | {r['events']} | {r['replays']} for {len(r['split'])} cards"
                   + (f" x {r['modes']} modes" if r.get("modes", 1) > 1 else "")
                   + f" | {r['replay_s'] / r['step_s']:.1%} |")
    out += ["", "| model | card | allocated peak | reserved peak | total use | retries "
            "| reserved with expandable_segments |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for i, (a, res, t, k) in enumerate(zip(r["allocated"], r["reserved"], r["total"], r["retries"])):
            es = "-" if r["expandable"] is None else format_bytes(r["expandable"][i])
            out.append(f"| {r['model']} | {i} | {format_bytes(a)} | {format_bytes(res)} | "
                       f"{format_bytes(t)} | {k} | {es} |")
    return "\n".join(out)


def varied(name: str, batches: Sequence[int], cluster: str = "1x24GB") -> str:
    """The allocator note's scenario on one card: steps whose batch changes slightly, the last
    measured after the others; reserved peak in the default mode and with expandable
    segments, against the same last step run after itself (markdown)."""
    from benchmarks.config import MODELS, optimizer
    from dptune.backends.simulated.allocator import AllocatorConfig
    from dptune.backends.simulated.reserved import ReservedModel, predict_steps
    from dptune.backends.simulated import SimulatedBackend
    from dptune.units import format_bytes
    from dptune.step.workload import Workload

    spec = MODELS[name]
    model, sample = spec.workload_args()
    b = SimulatedBackend(Workload(model, sample, optimizer=optimizer, amp=spec.amp), cluster,
                         reserved=ReservedModel())
    runs = {"same batch twice": predict_steps(b, [[batches[-1]]] * 2),
            "changing batch": predict_steps(b, [[x] for x in batches]),
            "changing batch, expandable_segments:True": predict_steps(
                b, [[x] for x in batches], ReservedModel(AllocatorConfig(expandable_segments=True)))}
    b.close()
    out = [f"{name}, batches {list(batches)} on {cluster}", "",
           "| run | allocated peak | reserved peak |", "|---|---|---|"]
    for label, fig in runs.items():
        s = fig.stats[0]
        out.append(f"| {label} | {format_bytes(s.allocated_peak)} | {format_bytes(s.reserved_peak)} |")
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from benchmarks.config import MODELS

    p = argparse.ArgumentParser(prog="python -m benchmarks.reserved", description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--cluster", default="4x24GB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-card", type=int, default=None)
    p.add_argument("--varied", default=None, metavar="B1,B2,...",
                   help="instead: steps of these batch sizes on one card of the first model")
    a = p.parse_args(argv)
    if a.varied:
        print(varied(a.models.split(",")[0], [int(x) for x in a.varied.split(",")]))
        return 0
    print(table(measure(a.models.split(","), a.cluster, a.repeats, a.per_card)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
