"""Scale figures: one simulated estimate of each full-size configuration.

Each configuration runs in a fresh subprocess (``python -m benchmarks.scale --one NAME``) so
that its peak resident memory (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is the
estimate's own footprint plus the imports, which are reported separately. Linux carries
``ru_maxrss`` over ``fork``/``exec`` from the parent, so :func:`benchmarks.run.main` runs these
before it builds any model, and ``VmHWM`` (which restarts at ``exec``) is reported beside it.
The model is a factory (built on the meta device), so a 7B model needs no memory of its size.
Wall time is
the median of ``repeats`` estimates for the configuration with a time target (GPT-2 small),
a single estimate for the others, each from scratch (building the fake model included).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

__all__ = ["measure_one", "measure_all", "scale_table"]

REPO = pathlib.Path(__file__).resolve().parent.parent
TIME_TARGET_S = {"gpt2_small": 10.0}     # GPT-2 small over 4 cards: one estimate under 10 s
RSS_TARGET_GIB = {"gpt_7b": 3.0}         # the 7B decoder: the process under 3 GiB


def _rss_bytes() -> int:
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB on Linux
    return int(kib) * (1 if sys.platform == "darwin" else 1024)


def _hwm_bytes() -> Optional[int]:
    """Peak RSS of this process image (``VmHWM``; unlike ``ru_maxrss`` it restarts at exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_one(name: str, repeats: int = 3) -> dict[str, Any]:
    """Estimate one configuration here (call it in a fresh process for a meaningful RSS)."""
    import torch

    from dptune.backends.simulated import estimate_memory
    from dptune.examples import models

    from benchmarks import config

    spec = next(s for s in config.FULL_SIZE if s.factory == name)
    factory = getattr(models, spec.factory)
    with torch.device("meta"):
        params = models.n_params(factory())
    rss_imports = _rss_bytes()
    times, est = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        est = estimate_memory(factory, spec.sample, spec.chunk_sizes, spec.cluster,
                              optimizer=config.optimizer)
        times.append(time.perf_counter() - t0)
        if len(times) == 1:
            rss_first = _rss_bytes()
    assert est is not None
    return {"config": spec.name, "factory": spec.factory, "params": params,
            "cluster": spec.cluster, "chunk_sizes": " ".join(map(str, spec.chunk_sizes)),
            "estimate_seconds_median": round(statistics.median(times), 3), "runs": repeats,
            "card0_peak_gib": round(est.peak_bytes[0] / 2**30, 2),
            "card1_peak_gib": round(est.peak_bytes[1] / 2**30, 2) if len(est.peak_bytes) > 1 else "",
            "oom_cards": " ".join(map(str, est.oom_devices)),
            "rss_after_imports_gib": round(rss_imports / 2**30, 3),
            "peak_rss_first_estimate_gib": round(rss_first / 2**30, 3),
            "peak_rss_gib": round(_rss_bytes() / 2**30, 3),
            "vm_hwm_gib": round(hwm / 2**30, 3) if (hwm := _hwm_bytes()) is not None else ""}


def measure_all(repeats: int = 3, log: Any = None, names: Optional[Sequence[str]] = None
                ) -> list[dict[str, Any]]:
    """Each configuration in its own subprocess; a failed one is reported, not raised."""
    from benchmarks import config

    rows = []
    for spec in config.FULL_SIZE:
        if names is not None and spec.factory not in names:
            continue
        runs = repeats if spec.factory in TIME_TARGET_S else 1   # the timed target gets a median
        cmd = [sys.executable, "-m", "benchmarks.scale", "--one", spec.factory,
               "--repeats", str(runs)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            row = {"config": spec.name, "factory": spec.factory,
                   "error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
        else:
            row = json.loads(proc.stdout.strip().splitlines()[-1])
        if log is not None:
            print(f"  [scale] {spec.name}: {row} ({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
        rows.append(row)
    return rows


def scale_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "Not run (`--quick` or `--no-scale`)."
    out = ["| configuration | params | cluster, split | one estimate (median) | peak RSS: ru_maxrss, VmHWM (ru_maxrss after imports) | card 0 / card 1 peak | target |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['config']} | | | failed: {r['error']} | | | |")
            continue
        target = []
        if r["factory"] in TIME_TARGET_S:
            t = TIME_TARGET_S[r["factory"]]
            target.append(f"< {t:.0f} s: {'met' if r['estimate_seconds_median'] < t else 'MISSED'}")
        if r["factory"] in RSS_TARGET_GIB:
            g = RSS_TARGET_GIB[r["factory"]]
            target.append(f"RSS < {g:.0f} GiB: {'met' if r['peak_rss_gib'] < g else 'MISSED'}")
        out.append(
            f"| {r['config']} | {r['params'] / 1e6:,.0f}M | {r['cluster']}, [{r['chunk_sizes']}] | "
            f"{r['estimate_seconds_median']:.2f} s ({r['runs']} run{'s' if r['runs'] > 1 else ''}) | "
            f"{r['peak_rss_gib']:.2f} GiB, VmHWM {r['vm_hwm_gib']} GiB ({r['rss_after_imports_gib']:.2f} GiB) | {r['card0_peak_gib']} / {r['card1_peak_gib']} GiB"
            f"{' (OOM on ' + r['oom_cards'] + ')' if r['oom_cards'] else ''} | {'; '.join(target)} |")
    return "\n".join(out)


def _main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale")
    p.add_argument("--one", help="factory name (in a fresh process: prints one JSON line)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure_one(args.one, args.repeats)))
    else:
        print(scale_table(measure_all(args.repeats, log=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
