"""Check the simulated time estimate against a real card: ``python -m benchmarks.validate_time``.

For a few models and batch sizes, one training step on ``cuda:0`` (AdamW, the default loss;
one warm-up step, then the median of ``--steps`` steps, each between ``torch.cuda.synchronize``
calls) is timed, and :class:`dptune.backends.timing.TimedBackend` estimates the same step on a
simulated card of this card's type (from the card table; ``--card`` names it when the GPU's
name is not recognised). It prints each row's relative error and the median error per model,
and writes ``reports/benchmarks/validate_time.csv``. Without a GPU it says so and exits 0.

The estimate is a roofline (peak FLOPs and memory bandwidth, a fixed cost per kernel): real
kernels reach part of the peak, so expect the estimate to be low; what the throughput
objective needs is that it ranks splits and cards right.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import statistics
import time
from typing import Any, Callable, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
CSV_PATH = os.path.join(os.path.dirname(HERE), "reports", "benchmarks", "validate_time.csv")

#: GPU names as torch reports them -> the card table's names
_NAMES = ((r"H200", "H200"), (r"H100", "H100-80GB"), (r"A100.*80", "A100-80GB"),
          (r"A100", "A100-40GB"), (r"RTX A6000|A6000", "A6000"), (r"4090", "RTX4090"),
          (r"3090", "RTX3090"), (r"2080 ?Ti", "RTX2080Ti"), (r"L40S", "L40S"), (r"\bL4\b", "L4"),
          (r"A10\b", "A10"), (r"A30", "A30"), (r"T4", "T4"), (r"V100.*32", "V100-32GB"),
          (r"V100", "V100-16GB"))


def card_name(gpu_name: str) -> Optional[str]:
    """The card table's name of a GPU as ``torch.cuda.get_device_name`` gives it."""
    for pattern, name in _NAMES:
        if re.search(pattern, gpu_name, re.IGNORECASE):
            return name
    return None


def cases() -> list[tuple[str, Callable[[], Any], Sequence[int]]]:
    from dptune.examples import models as M

    return [("MLP", lambda: M.MLP(in_features=1024, hidden=4096, depth=4), (64, 256, 1024)),
            ("ResNet", lambda: M.SmallResNet(blocks=1), (16, 64, 128)),
            ("GPT", lambda: M.TinyGPT(n_layers=2), (4, 8, 16))]


def measure(model: Any, sample: Callable[[int], Any], batch: int, steps: int) -> float:
    import torch

    from dptune.workload import batch_to_args

    dev = torch.device("cuda", 0)
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for k in range(steps + 1):
        args, kwargs = batch_to_args(sample(batch))
        args = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = model(*args, **kwargs)
        loss = out.float().sum() if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        if k:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def estimate(model: Any, sample: Callable[[int], Any], batch: int, card: str) -> float:
    import torch

    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.timing import TimedBackend
    from dptune.workload import Workload

    wl = Workload(model=model, sample=sample, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    backend = TimedBackend(SimulatedBackend(wl, card))
    r = backend.probe([batch])
    assert r.time is not None
    return r.time.step_seconds


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.validate_time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--card", help="the card table's name of cuda:0 (default: from its name)")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the time estimate stays unvalidated (run this on a GPU)")
        return 0
    gpu = torch.cuda.get_device_name(0)
    card = args.card or card_name(gpu)
    if card is None:
        print(f"{gpu!r} is not in the card table: give --card NAME (dptune.timing.CARD_SPEEDS)")
        return 2
    rows = []
    for label, build, batches in cases():
        for b in batches:
            model = build()
            real = measure(model, model.sample, b, args.steps)
            est = estimate(build(), model.sample, b, card)
            rows.append(dict(model=label, batch=b, real_s=real, estimate_s=est,
                             error=(est - real) / real))
            print(f"{label:8s} batch {b:5d}: real {real * 1e3:8.2f} ms, estimate {est * 1e3:8.2f} ms, "
                  f"error {100 * (est - real) / real:+.0f}%")
    for label in dict.fromkeys(r["model"] for r in rows):
        errs = [r["error"] for r in rows if r["model"] == label]
        print(f"{label}: median error {100 * statistics.median(errs):+.0f}% on {gpu} (as {card})")
    os.makedirs(os.path.dirname(CSV_PATH), exist_ok=True)
    with open(CSV_PATH, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
