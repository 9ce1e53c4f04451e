"""Record what a real card does in a training step, to study here without one:
``python -m benchmarks.gpu_facts --out FILE.json.gz [--part memory|time|all]``.

- ``memory``: for validate_gpu's smaller cases (where the estimate was furthest off on an H200,
  2026-11-27), the caching allocator's history over a warm-up and a measured step
  (``torch.cuda.memory._record_memory_history``): every allocation and free with its size,
  stream and the frames that made it (Python frames, and the C++ frames that name a
  workspace or handle), plus the blocks still live at the end. What the simulator leaves out
  can then be read allocation by allocation.
- ``time``: for validate_time's cases at several batch sizes: the step's wall time (median of
  timed steps between ``torch.cuda.synchronize``), the host's time to issue it (no
  synchronize), and from ``torch.profiler`` the number of kernels and their summed device
  time: whether a step is bound by the host's launches or by the card's work.

``--device cpu`` runs the time part's code paths on the CPU (a check that it runs).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MEMORY_CASES = (("MLP", 64), ("SmallResNet(BN)", 16), ("TinyGPT", 4), ("BertClassifier", 16),
                ("SegNet", 4), ("HF-GPT2+cache", 4))
MARK_BYTES = 7_777_280   # an allocation that marks the start of a step in the trace
_CXX_WORDS = ("orkspace", "ublas", "udnn", "andle", "Lt")


def _frames(frames: list[dict]) -> list[str]:
    out = []
    for f in frames:
        name, file = str(f.get("name", "")), str(f.get("filename", ""))
        if file.endswith(".py") or any(w in name for w in _CXX_WORDS):
            out.append(f"{os.path.basename(file)}:{f.get('line', '')}:{name[:120]}")
        if len(out) >= 14:
            break
    return out


def memory_facts(device: str) -> dict:
    import torch

    from benchmarks.validate_gpu import _cases, _free, plain_step

    wanted = dict(MEMORY_CASES)
    facts: dict[str, Any] = {}
    for case in _cases():
        if case.label not in wanted or case.step or case.label in facts:
            continue
        batch = wanted[case.label]
        torch.manual_seed(0)
        _free()
        torch.cuda.memory._record_memory_history(max_entries=400000, stacks="python")
        model = case.factory().to(device)
        opt = case.optimizer(model.parameters())
        peaks = []
        for k in range(2):
            model.zero_grad(set_to_none=True)
            hosts = [case.sample(model, batch)]
            torch.cuda.synchronize()
            torch.empty(MARK_BYTES + 512 * k, dtype=torch.uint8, device=device)  # marks a step
            torch.cuda.reset_peak_memory_stats(0)
            plain_step(model, opt, hosts, None, device)
            del hosts
            torch.cuda.synchronize()
            peaks.append(int(torch.cuda.max_memory_allocated(0)))
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = [{"action": e["action"], "addr": int(e.get("addr", 0)), "size": int(e.get("size", 0)),
                  "stream": int(e.get("stream", 0)), "frames": _frames(e.get("frames", []))}
                 for e in snap["device_traces"][0]]
        live = [{"size": int(b["size"]), "requested": int(b.get("requested_size", b["size"])),
                 "state": b["state"], "frames": _frames(b.get("frames", []))}
                for seg in snap["segments"] for b in seg["blocks"] if b["state"] != "inactive"]
        facts[case.label] = {"batch": batch, "mark_bytes": MARK_BYTES, "peaks": peaks, "trace": trace,
                             "live_at_end": live, "allocated_now": int(torch.cuda.memory_allocated(0))}
        print(f"memory {case.label} b{batch}: peaks {peaks}, {len(trace)} events", flush=True)
        del model, opt, snap
        _free()
    return facts


def _profile(step: Any) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    kernels, device_us, cpu_ops = 0, 0.0, 0
    for e in prof.events():
        kind = getattr(getattr(e, "device_type", None), "name", "")
        if kind == "CUDA":
            kernels += 1
            device_us += float(e.time_range.elapsed_us())
        elif str(getattr(e, "name", "")).startswith("aten::"):
            cpu_ops += 1
    return {"kernels": kernels, "kernel_seconds": device_us * 1e-6, "aten_ops": cpu_ops}


def cases() -> list[tuple[str, Callable[[], Any], Sequence[int]]]:
    """validate_time's models and batch sizes (the time facts add 1 and twice the largest)."""
    from dptune.examples import models as M

    return [("MLP", lambda: M.MLP(in_features=1024, hidden=4096, depth=4), (64, 256, 1024)),
            ("ResNet", lambda: M.SmallResNet(blocks=1), (16, 64, 128)),
            ("GPT", lambda: M.TinyGPT(n_layers=2), (4, 8, 16))]


def time_facts(device: str, steps: int) -> list[dict]:
    import torch

    from dptune.step.workload import batch_to_args

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    rows = []
    for label, build, batches in cases():
        for b in sorted({1, *batches, 2 * max(batches)}):
            torch.manual_seed(0)
            model = build().to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            args, kwargs = batch_to_args(model.sample(b))
            args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]

            def step(model: Any = model, opt: Any = opt, args: Any = args, kwargs: Any = kwargs) -> None:
                out = model(*args, **kwargs)
                loss = out.float().sum() if isinstance(out, torch.Tensor) else out.loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            walls, hosts = [], []
            try:
                for k in range(steps + 2):
                    sync()
                    t0 = time.perf_counter()
                    step()
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    if k >= 2:
                        walls.append(t2 - t0)
                        hosts.append(t1 - t0)
                prof = _profile(step)
            except torch.OutOfMemoryError:
                print(f"time {label} b{b}: out of memory", flush=True)
                continue
            row = {"model": label, "batch": b, "step_seconds": statistics.median(walls),
                   "host_seconds": statistics.median(hosts), **prof}
            rows.append(row)
            print(f"time {label} b{b}: step {row['step_seconds'] * 1e3:.2f} ms, host "
                  f"{row['host_seconds'] * 1e3:.2f} ms, {prof['kernels']} kernels "
                  f"{prof['kernel_seconds'] * 1e3:.2f} ms, {prof['aten_ops']} aten ops", flush=True)
            del model, opt, args, kwargs
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", choices=("memory", "time", "all"), default="all")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--steps", type=int, default=7)
    args = ap.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    facts: dict[str, Any] = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                             "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    if torch.cuda.is_available():
        facts["card"] = torch.cuda.get_device_name(0)
    if args.part in ("memory", "all") and args.device.startswith("cuda"):
        facts["memory"] = memory_facts(args.device)
    if args.part in ("time", "all"):
        facts["time"] = time_facts(args.device, args.steps)
    with gzip.open(args.out, "wt", encoding="utf-8") as f:
        json.dump(facts, f)
    print(f"facts written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
