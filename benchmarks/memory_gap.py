"""Where the simulator's peak differs from a real card's: ``python -m benchmarks.memory_gap``.

Reads the caching allocator's history of validate_gpu's smaller cases on an H200
(``benchmarks/measured/h200-2026-11-27/memory.json.gz``, written by :mod:`benchmarks.gpu_facts`:
a warm-up step and a measured step, each started by a marker allocation of 7,777,280 bytes,
+512 for the second), rebuilds the allocations live at the measured step's peak and sorts
them into categories by the frames that made them and when they were freed:

- ``weights``: made by ``module.to`` before the first step (parameters and buffers);
- ``optimizer``: made in the optimizer's code (its state, and its step's temporaries);
- ``grads``: made in the backward (no Python frame: the autograd engine's thread) and still
  live at the end (``zero_grad`` frees them before the next step);
- ``inputs``: the batch moved to the card;
- ``workspaces``: made in the warm-up step and never freed, outside the optimizer (cuBLAS
  and cuBLASLt workspaces), and what was allocated before the history started (earlier
  cases' workspaces: the MLP case, which runs first, shows them being made);
- ``scratch``: freed before the next allocation (a kernel's workspace or copy, e.g. cuDNN's);
- ``activations``: the rest of the measured step (forward, loss, backward temporaries).

The trace's sizes are the requested ones; the allocator rounds each block up to 512 bytes
(and keeps a large block whole when what would be left is small), so the rebuilt peak is
within a few MB of ``max_memory_allocated`` (column ``rebuilt``). The simulator's estimate
(:func:`dptune.estimate_memory` on one simulated H200, as :func:`benchmarks.validate_gpu.estimate`
runs it) is printed with its breakdown (its ``other``: the workspaces it keeps, the rest is
an op's scratch at the peak). Runs on the CPU in a few seconds.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FACTS = os.path.join(HERE, "measured", "h200-2026-11-27", "memory.json.gz")
H200_BYTES = 150_110_011_392          # torch.cuda.get_device_properties(0).total_memory
MARK_BYTES = 7_777_280
CATEGORIES = ("weights", "optimizer", "grads", "inputs", "workspaces", "scratch", "activations")
_OPTIMIZER_FILES = ("adam.py", "adamw.py", "sgd.py", "optimizer.py")


def _rounded(n: int) -> int:
    return max(512, -(-n // 512) * 512)


@dataclass
class RealPeak:
    """The measured step's peak rebuilt from the allocator's history."""

    label: str
    batch: int
    measured: int                   # max_memory_allocated of the measured step
    rebuilt: int                    # the peak rebuilt from the history (rounded to 512 bytes)
    before: int                     # allocated before the history started
    by_category: dict[str, int] = field(default_factory=dict)


def _category(e: dict, made: int, freed: Optional[int], freed_frames: list, marks: list[int],
              transient: bool) -> str:
    frames = e["frames"]
    files = [f.split(":")[0] for f in frames]
    if made < marks[0]:
        return "weights" if any("convert" in f or "_apply" in f for f in frames) else "workspaces"
    if any(f in _OPTIMIZER_FILES for f in files):
        return "optimizer"
    if made < marks[1]:
        return "workspaces" if freed is None else "activations"
    if any("to_card" in f for f in frames):
        return "inputs"
    if transient:
        return "scratch"
    if not frames and freed is None:
        return "grads"
    return "activations"


def real_peak(label: str, facts: dict) -> RealPeak:
    """Replay one case's history (see the module docstring)."""
    tr = facts["trace"]
    events = [(i, e) for i, e in enumerate(tr) if e["action"] in ("alloc", "free_requested")]
    net = sum(_rounded(e["size"]) * (1 if e["action"] == "alloc" else -1) for _, e in events)
    before = int(facts["allocated_now"]) - net
    marks = [i for i, e in events if e["action"] == "alloc" and e["size"] in (MARK_BYTES, MARK_BYTES + 512)]
    made: dict[int, int] = {}
    freed: dict[int, tuple[int, list]] = {}
    transient: set[int] = set()
    last_alloc = -1
    for i, e in events:
        if e["action"] == "alloc":
            made[e["addr"]] = last_alloc = i
        elif e["addr"] in made:
            j = made.pop(e["addr"])
            freed[j] = (i, e["frames"])
            if j == last_alloc:
                transient.add(j)
    live: dict[int, int] = {}
    cur, peak, at_peak = before, 0, {}
    for i, e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = i
            cur += _rounded(e["size"])
        else:
            live.pop(e["addr"], None)
            cur -= _rounded(e["size"])
        if i > marks[1] + 1 and cur > peak:   # after the measured step's marker is freed
            peak, at_peak = cur, dict(live)
    cats = dict.fromkeys(CATEGORIES, 0)
    cats["workspaces"] = before
    for i in at_peak.values():
        f = freed.get(i)
        cat = _category(tr[i], i, None if f is None else f[0], [] if f is None else f[1], marks,
                         i in transient)
        cats[cat] += _rounded(tr[i]["size"])
    return RealPeak(label, int(facts["batch"]), int(facts["peaks"][1]), peak, before, cats)


def load_facts(path: str = FACTS) -> dict[str, Any]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["memory"]


def real_peaks(path: str = FACTS) -> list[RealPeak]:
    return [real_peak(label, facts) for label, facts in load_facts(path).items()]


def simulated(label: str, batch: int) -> Any:
    """The simulator's estimate of a case (a :class:`dptune.MemoryEstimate`)."""
    import torch

    from benchmarks.validate_gpu import _cases
    from dptune import estimate_memory
    from dptune.backends.simulated import Cluster

    case = next(c for c in _cases() if c.label == label and not c.step)
    cluster = Cluster.uniform(1, H200_BYTES, name="NVIDIA H200", capability=(9, 0))
    with torch.device("meta"):
        shape_model = case.factory()
    return estimate_memory(case.factory, lambda b: case.sample(shape_model, b), [batch], cluster,
                           optimizer=case.optimizer)


def _mb(n: int) -> str:
    return f"{n / 2**20:9.1f}"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--facts", default=FACTS)
    ap.add_argument("--only", action="append", metavar="MODEL")
    args = ap.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    print("MiB at the measured step's peak; real: rebuilt from the H200's allocator history; "
          "sim: dptune's estimate")
    print(f"{'case':<22}{'':5}" + "".join(f"{c[:10]:>11}" for c in CATEGORIES)
          + f"{'peak':>11}{'measured':>11}{'error':>8}")
    for real in real_peaks(args.facts):
        if args.only and real.label not in args.only:
            continue
        est = simulated(real.label, real.batch)
        b = est.breakdown[0]
        kept = sum(est.cluster.workspaces_bytes(0))
        sim = {"weights": b["weights"], "optimizer": b["optimizer"], "grads": b["gradients"],
               "inputs": b["inputs"], "workspaces": min(kept, b["other"]),
               "scratch": max(0, b["other"] - kept),
               "activations": b["activations"] + b["outputs"]}
        name = f"{real.label} b{real.batch}"
        print(f"{name:<22}{'real':<5}" + "".join(f"{_mb(real.by_category[c]):>11}" for c in CATEGORIES)
              + f"{_mb(real.rebuilt):>11}{_mb(real.measured):>11}")
        err = (est.peak_bytes[0] - real.measured) / real.measured
        print(f"{'':<22}{'sim':<5}" + "".join(f"{_mb(sim[c]):>11}" for c in CATEGORIES)
              + f"{_mb(est.peak_bytes[0]):>11}{'':>11}{err:>+8.1%}")
    print("real's workspaces: also what was allocated before the history began (earlier cases' "
          "workspaces); sim's scratch: its 'other' beyond its workspaces")
    return 0


if __name__ == "__main__":
    sys.exit(main())
