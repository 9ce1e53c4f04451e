"""Check the simulated time estimate against a real card: ``python -m benchmarks.validate_time``.

For a few models and batch sizes (AdamW, the default loss), a training step on ``cuda:0`` is
measured as :mod:`benchmarks.gpu_facts` does it (the step's wall time between
``torch.cuda.synchronize`` calls, the host's time to issue it without one, the profiler's
summed kernel time; the median of ``--steps`` steps after two warm-up steps), and
:class:`dptune.backends.simulated.timing.TimedBackend`'s model estimates the same step on a simulated
card of this card's type (``--card`` names it when the GPU's name is not recognised). Three
errors per row: the device part (against the summed kernel time), the host part (against
the host's issue time) and the step (against its wall time), with the median per model; the
rows go to ``reports/benchmarks/validate_time.csv`` (``validate_time_cpu.csv`` with ``--cpu``).
Without a GPU it says so and exits 0.

``--cpu`` (no GPU needed) re-scores measurements made before (``--facts``: a ``time.json.gz``
of :mod:`benchmarks.gpu_facts`, by default the H200's of 2026-11-27) with the current
estimate and with the first one (:data:`dptune.hardware.speeds.ROOFLINE`: datasheet peaks, 5 us per
kernel, no host), and the steps of the validate_time runs beside it (``validate_time.csv`` in
its folder and in the folders named like it with a suffix: the same steps measured again,
not fitted on) as a check. ``--fit`` fits the constants (:class:`dptune.hardware.speeds.Calibration`) on
those facts and gives each model's errors with the constants fitted on the other models
(leave one model out; the tensor cores' efficiency is left at the peak when no model left in
runs them).
"""

from __future__ import annotations

import argparse
import csv
from glob import glob as _glob
import gzip
import json
import math
import os
import re
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dptune.hardware.speeds import CALIBRATION, CARD_SPEEDS, ROOFLINE, Calibration, CardSpeed

from benchmarks.gpu_facts import cases  # the models and batches (one home)

HERE = os.path.dirname(os.path.abspath(__file__))
CSV_PATH = os.path.join(os.path.dirname(HERE), "reports", "benchmarks", "validate_time.csv")
CPU_CSV_PATH = os.path.join(os.path.dirname(HERE), "reports", "benchmarks", "validate_time_cpu.csv")
MEASURED = os.path.join(HERE, "measured", "h200-2026-11-27")

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


@dataclass(frozen=True)
class Simulated:
    """One step as the simulator sees it: the ops the host dispatches, each kernel's cost,
    the batch's copy from the host (seconds)."""

    ops: int
    costs: tuple[Any, ...]        # dptune.backends.simulated.timing.OpCost
    copy_seconds: float

    def device(self, speed: CardSpeed, cal: Calibration = CALIBRATION) -> float:
        return sum(c.seconds(speed, cal) for c in self.costs) + self.copy_seconds

    def host(self, cal: Calibration = CALIBRATION) -> float:
        return self.ops * cal.host_seconds_per_op

    def step(self, speed: CardSpeed, cal: Calibration = CALIBRATION) -> float:
        return max(self.host(cal), self.device(speed, cal))


def simulate(model: Any, sample: Callable[[int], Any], batch: int, card: str) -> Simulated:
    """The simulator's step of ``model`` at ``batch`` on one ``card`` (AdamW)."""
    import torch

    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.simulated.timing import OpCounter, TimedBackend
    from dptune.step.workload import Workload

    wl = Workload(model=model, sample=sample, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    backend = TimedBackend(SimulatedBackend(wl, card))
    sim = backend.backend
    counter = OpCounter(lambda: sim._ledger, backend.speed, keep=True)
    sim.op_observer = counter
    try:
        sim.probe([batch])
    finally:
        sim.op_observer = None
        backend.close()
    return Simulated(counter.ops[0] + counter.serial_ops, tuple(c for _, c in counter.costs),
                     counter.host_in[0] / backend.speed.link.host_bandwidth)


def estimate(model: Any, sample: Callable[[int], Any], batch: int, card: str) -> float:
    """The estimated step time (seconds) of ``model`` at ``batch`` on one ``card``."""
    import torch

    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.simulated.timing import TimedBackend
    from dptune.step.workload import Workload

    wl = Workload(model=model, sample=sample, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    backend = TimedBackend(SimulatedBackend(wl, card))
    r = backend.probe([batch])
    assert r.time is not None
    return r.time.step_seconds


def simulate_rows(rows: Sequence[dict], card: str) -> list[Simulated]:
    builds = {label: build for label, build, _ in cases()}
    out = []
    for row in rows:
        model = builds[row["model"]]()
        out.append(simulate(model, model.sample, int(row["batch"]), card))
    return out


def _rel(estimate: float, real: float) -> float:
    return estimate / real - 1 if real > 0 else math.nan


def score(rows: Sequence[dict], sims: Sequence[Simulated], speed: CardSpeed,
          cal: Calibration) -> list[dict]:
    """Each measured row against its estimate: the device, host and step errors."""
    out = []
    for row, sim in zip(rows, sims):
        dev, host, step = sim.device(speed, cal), sim.host(cal), sim.step(speed, cal)
        out.append(dict(model=row["model"], batch=int(row["batch"]), real_s=row["step_seconds"],
                        estimate_s=step, error=_rel(step, row["step_seconds"]),
                        kernel_s=row["kernel_seconds"], device_estimate_s=dev,
                        device_error=_rel(dev, row["kernel_seconds"]), host_s=row["host_seconds"],
                        host_estimate_s=host, host_error=_rel(host, row["host_seconds"]),
                        ops=sim.ops, kernels=len(sim.costs), real_kernels=row.get("kernels", 0)))
    return out


def _log_loss(pred: Sequence[float], real: Sequence[float]) -> float:
    return sum(math.log(p / r) ** 2 for p, r in zip(pred, real))


def fit(rows: Sequence[dict], sims: Sequence[Simulated], speed: CardSpeed) -> Calibration:
    """The constants that fit ``rows`` best (least squares of the log errors): the host's
    cost per op on the host times, the efficiencies and the kernel's fixed time on the
    summed kernel times. A dtype class no kernel of ``rows`` computes in keeps the peak."""
    from scipy.optimize import minimize

    host = math.exp(statistics.fmean(math.log(r["host_seconds"] / s.ops) for r, s in zip(rows, sims)))
    kinds = sorted({c.kind for s in sims for c in s.costs if c.flops})
    tensor = [k for k in kinds if k != "fp32"]
    real = [r["kernel_seconds"] for r in rows]

    def cal_of(x: Sequence[float]) -> Calibration:
        e = [math.exp(v) for v in x]
        compute = {"fp32": e[0], "tf32": 1.0, "fp16": 1.0, "bf16": 1.0}
        if tensor:
            compute.update({k: e[3] for k in ("tf32", "fp16", "bf16")})
        return Calibration(compute, e[1], e[2], host, "fitted")

    def loss(x: Sequence[float]) -> float:
        return _log_loss([s.device(speed, cal_of(x)) for s in sims], real)

    start = [math.log(0.7), math.log(0.3), math.log(1e-5), math.log(0.2)][:4 if tensor else 3]
    best = minimize(loss, start, method="Nelder-Mead", options=dict(xatol=1e-3, fatol=1e-6, maxiter=4000))
    return cal_of(best.x)


def _median(rows: Sequence[dict], label: str, key: str) -> float:
    return statistics.median(r[key] for r in rows if r["model"] == label)


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def print_rows(title: str, rows: Sequence[dict]) -> None:
    print(f"{title}\n  model    batch |   step: real   est  error | device: kernels  est  error | "
          "host: real   est  error")
    for r in rows:
        print(f"  {r['model']:6s} {r['batch']:6d} | {r['real_s'] * 1e3:10.2f} {r['estimate_s'] * 1e3:6.2f} "
              f"{_pct(r['error']):>6s} | {r['kernel_s'] * 1e3:15.2f} {r['device_estimate_s'] * 1e3:5.2f} "
              f"{_pct(r['device_error']):>6s} | {r['host_s'] * 1e3:10.2f} {r['host_estimate_s'] * 1e3:5.2f} "
              f"{_pct(r['host_error']):>6s}")
    for label in dict.fromkeys(r["model"] for r in rows):
        print(f"  {label}: median error: step {_pct(_median(rows, label, 'error'))}, device "
              f"{_pct(_median(rows, label, 'device_error'))}, host {_pct(_median(rows, label, 'host_error'))}")


def _second_run(path: str, speed: CardSpeed, card: str) -> None:
    """The steps of a validate_time run (its wall times only)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        runs = list(csv.DictReader(f))
    sims = simulate_rows(runs, card)
    print(f"the same steps measured again ({os.path.relpath(path, HERE)}, wall time only):")
    for label, cal in (("before", ROOFLINE), ("now", CALIBRATION)):
        errs = [s.step(speed, cal) / float(r["real_s"]) - 1 for r, s in zip(runs, sims)]
        per = {m: statistics.median(e for e, r in zip(errs, runs) if r["model"] == m)
               for m in dict.fromkeys(r["model"] for r in runs)}
        print(f"  {label:6s}: " + ", ".join(f"{m} {_pct(e)}" for m, e in per.items())
              + f"; rows {', '.join(_pct(e) for e in errs)}")


def rescore(facts_path: str, card: str, do_fit: bool) -> list[dict]:
    """``--cpu``: the committed measurements against the first and the current estimate."""
    with gzip.open(facts_path, "rt", encoding="utf-8") as f:
        facts = json.load(f)
    rows = facts["time"]
    speed = CARD_SPEEDS[card]
    sims = simulate_rows(rows, card)
    print(f"facts: {os.path.relpath(facts_path, os.path.dirname(HERE))} ({facts.get('card', '?')}, torch {facts.get('torch', '?')}, "
          f"{facts.get('date', '?')}); estimated as {card}")
    print_rows("before (datasheet peaks, 5 us per kernel, no host):", score(rows, sims, speed, ROOFLINE))
    now = score(rows, sims, speed, CALIBRATION)
    print_rows("now (step = max(host, device), dptune.hardware.speeds.CALIBRATION):", now)
    here = os.path.dirname(facts_path)
    for path in [os.path.join(here, "validate_time.csv")] + sorted(
            os.path.join(d, "validate_time.csv") for d in _glob(here + "-*")):
        _second_run(path, speed, card)
    if do_fit:
        _fit_report(rows, sims, speed)
    return now


def _fit_report(rows: Sequence[dict], sims: Sequence[Simulated], speed: CardSpeed) -> None:
    cal = fit(rows, sims, speed)
    print(f"fitted on every row: {_describe(cal)}")
    for label in dict.fromkeys(r["model"] for r in rows):
        keep = [i for i, r in enumerate(rows) if r["model"] != label]
        out = [i for i, r in enumerate(rows) if r["model"] == label]
        c = fit([rows[i] for i in keep], [sims[i] for i in keep], speed)
        scored = score([rows[i] for i in out], [sims[i] for i in out], speed, c)
        print_rows(f"leave {label} out: {_describe(c)}; {label}'s rows:", scored)


def _describe(cal: Calibration) -> str:
    return (f"fp32 {cal.compute['fp32']:.2f}, tensor cores {cal.compute['tf32']:.2f} of the peak, "
            f"memory {cal.memory:.2f} of the bandwidth, {cal.kernel_seconds * 1e6:.1f} us per kernel, "
            f"host {cal.host_seconds_per_op * 1e6:.1f} us per op")


def _write(rows: Sequence[dict], path: str = CSV_PATH) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.validate_time", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--card", help="the card table's name of cuda:0 (default: from its name)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cpu", action="store_true", help="re-score measurements made before (no GPU)")
    ap.add_argument("--facts", default=os.path.join(MEASURED, "time.json.gz"))
    ap.add_argument("--fit", action="store_true", help="with --cpu: fit the constants, leave one model out")
    args = ap.parse_args(argv)
    if args.cpu:
        _write(rescore(args.facts, args.card or "H200", args.fit), CPU_CSV_PATH)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the time estimate stays unvalidated (run this on a GPU, or "
              "--cpu to re-score the committed measurements)")
        return 0
    gpu = torch.cuda.get_device_name(0)
    card = args.card or card_name(gpu)
    if card is None:
        print(f"{gpu!r} is not in the card table: give --card NAME (dptune.hardware.speeds.CARD_SPEEDS)")
        return 2
    from benchmarks.gpu_facts import time_facts

    rows = time_facts("cuda:0", args.steps)
    scored = score(rows, simulate_rows(rows, card), CARD_SPEEDS[card], CALIBRATION)
    print_rows(f"{gpu} (as {card}):", scored)
    _write(scored)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
