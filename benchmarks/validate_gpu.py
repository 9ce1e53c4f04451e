"""Check the simulated estimate against a real card: ``python benchmarks/validate_gpu.py``.

For several models and batch sizes, one training step on ``cuda:0`` (forward, default loss,
backward, ``optimizer.step()``; steady state: after one warm-up step, gradients set to
``None`` before the step, cuDNN benchmark mode off) is measured three ways:

- ``real``: a plain training loop and ``torch.cuda.max_memory_allocated`` (the ground truth);
- ``probe``: dptune's real-GPU backend (:class:`dptune.backends.cuda.CudaBackend`);
- ``estimate``: :func:`dptune.estimate_memory` on a simulated cluster of one card like this
  one (same total memory and name, so the same cuBLAS workspace).

It prints a table with the relative error of the estimate and of the probe against
``real`` (target: within 5%) and writes ``reports/benchmarks/validate_gpu.csv``. Without a
GPU it says so and exits 0. ``--strict`` exits 1 when an estimate is off by more than 5%.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import time
from typing import Any, Callable

TARGET = 0.05
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSV_PATH = os.path.join(ROOT, "reports", "benchmarks", "validate_gpu.csv")


def _cases() -> list[tuple[str, Callable[[], Any], Callable[[Any, int], Any], list[int], Callable]]:
    """(label, model factory, sample(model, batch), batch sizes, optimizer factory)."""
    import torch

    try:
        from dptune.examples import models as ex
    except ImportError:  # pragma: no cover - the examples ship with dptune
        ex = None
    if ex is None:
        raise SystemExit("dptune.examples.models is missing")

    def adam(p: Any) -> Any:
        return torch.optim.Adam(p, lr=1e-4)

    def adamw(p: Any) -> Any:
        return torch.optim.AdamW(p, lr=1e-4)

    def sgd(p: Any) -> Any:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    return [
        ("MLP", lambda: ex.MLP(), lambda m, b: m.sample(b), [64, 512], adam),
        ("MLP-wide", lambda: ex.MLP(in_features=4096, hidden=8192, depth=3), lambda m, b: m.sample(b),
         [32, 256], sgd),
        ("SmallResNet(BN)", lambda: ex.SmallResNet(), lambda m, b: m.sample(b), [16, 64], sgd),
        ("TinyGPT", lambda: ex.TinyGPT(), lambda m, b: m.sample(b), [4, 16], adamw),
        ("TinyGPT-768", lambda: ex.TinyGPT(d_model=768, n_layers=6, n_heads=12, seq_len=512),
         lambda m, b: m.sample(b), [2, 8], adamw),
        ("BertClassifier", lambda: ex.BertClassifier(), lambda m, b: m.sample(b), [16, 64], adamw),
        ("SegNet", lambda: ex.SegNet(), lambda m, b: m.sample(b), [4, 16], sgd),
    ]


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_real(factory: Callable[[], Any], sample: Callable[[int], Any], batch: int,
                 opt_factory: Callable) -> int:
    """``max_memory_allocated`` of a steady-state step in a plain training loop on cuda:0."""
    import torch

    from dptune.workload import batch_to_args, default_loss

    def to_card(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.cuda(0)
        if isinstance(obj, dict):
            return {k: to_card(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_card(v) for v in obj)
        return obj

    torch.manual_seed(0)
    model = factory().cuda(0)
    opt = opt_factory(model.parameters())
    peak = 0
    try:
        for _ in range(2):                      # warm-up, then the measured step
            model.zero_grad(set_to_none=True)
            host = sample(batch)
            _free()
            torch.cuda.reset_peak_memory_stats(0)
            batch_dev = to_card(host)
            args, kwargs = batch_to_args(batch_dev)
            out = model(*args, **kwargs)
            loss = default_loss(out, batch_dev)
            del out, args, kwargs
            loss.backward()
            del loss, batch_dev
            opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(0)
    finally:
        del model, opt
        _free()
    return int(peak)


def measure_probe(factory: Callable[[], Any], sample: Callable[[Any, int], Any], batch: int,
                  opt_factory: Callable) -> int:
    """dptune's real-GPU probe of the same step."""
    import torch

    from dptune.backends.cuda import CudaBackend
    from dptune.workload import Workload

    torch.manual_seed(0)
    model = factory()
    wl = Workload(model=model, sample=lambda b, m=model: sample(m, b), optimizer=opt_factory)
    with CudaBackend(wl, [0], repeats=2) as backend:
        result = backend.probe([batch])
    del model, wl
    _free()
    if not result.feasible:
        raise RuntimeError(f"probe ran out of memory: {result.note}")
    return int(result.peak_bytes[0])


def estimate(factory: Callable[[], Any], sample: Callable[[Any, int], Any], batch: int,
             opt_factory: Callable, cluster: Any) -> int:
    import torch

    from dptune import estimate_memory

    with torch.device("meta"):
        shape_model = factory()             # for sample(); the estimate builds its own model
    est = estimate_memory(factory, lambda b: sample(shape_model, b), [batch], cluster,
                          optimizer=opt_factory)
    return int(est.peak_bytes[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strict", action="store_true",
                        help=f"exit 1 when an estimate is off by more than {TARGET:.0%}")
    parser.add_argument("--csv", default=CSV_PATH, help="where to write the table")
    parser.add_argument("--quick", action="store_true", help="only the first batch size of each model")
    args = parser.parse_args(argv)

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        print("validate_gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "nothing to validate, skipping.")
        return 0
    from dptune.backends.simulated import Cluster
    from dptune.units import format_bytes

    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    cluster = Cluster.uniform(1, int(props.total_memory), name=name)
    torch.backends.cudnn.benchmark = False
    print(f"validate_gpu: {name}, {format_bytes(props.total_memory)}, torch {torch.__version__}")

    rows = []
    header = f"{'model':<18}{'batch':>6}{'real':>12}{'probe':>12}{'estimate':>12}{'est err':>9}{'probe err':>10}  ok"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for label, factory, sample, batches, opt_factory in _cases():
        for batch in batches[:1] if args.quick else batches:
            t0 = time.perf_counter()
            try:
                with torch.device("meta"):
                    shape_model = factory()
                real = measure_real(factory, lambda b, m=shape_model, s=sample: s(m, b), batch, opt_factory)
                probe = measure_probe(factory, sample, batch, opt_factory)
                est = estimate(factory, sample, batch, opt_factory, cluster)
            except torch.OutOfMemoryError:
                _free()
                print(f"{label:<18}{batch:>6}  out of memory on this card, skipped")
                continue
            est_err = (est - real) / real
            probe_err = (probe - real) / real
            ok = abs(est_err) <= TARGET
            worst = max(worst, abs(est_err))
            print(f"{label:<18}{batch:>6}{format_bytes(real):>12}{format_bytes(probe):>12}"
                  f"{format_bytes(est):>12}{est_err:>+9.1%}{probe_err:>+10.1%}  {'yes' if ok else 'NO'}")
            rows.append({"device": name, "model": label, "batch_size": batch, "real_bytes": real,
                         "probe_bytes": probe, "estimate_bytes": est,
                         "estimate_rel_error": round(est_err, 5), "probe_rel_error": round(probe_err, 5),
                         "within_target": ok, "seconds": round(time.perf_counter() - t0, 2)})
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    n_ok = sum(r["within_target"] for r in rows)
    print(f"\n{n_ok}/{len(rows)} estimates within {TARGET:.0%} of the real peak "
          f"(worst {worst:.1%}); table written to {os.path.relpath(args.csv)}")
    return 1 if args.strict and n_ok < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
