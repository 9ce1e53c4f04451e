"""Check the allocator model against a real card: ``python benchmarks/validate_reserved.py``.

For :mod:`benchmarks.validate_gpu`'s models, steps and batch sizes, a plain training loop on
``cuda:0`` (the same step, two warm-up steps then the measured one, the cache kept between
steps as in training: no ``empty_cache``) gives the three levels of the card's memory:

- ``allocated``: ``torch.cuda.max_memory_allocated`` over the measured step;
- ``reserved``: ``torch.cuda.max_memory_reserved`` over it, with ``num_alloc_retries``;
- ``total``: the card's use at the reserved peak: the reserved peak plus what the card held
  before the first allocation (``mem_get_info`` right after CUDA started: this process's
  context and other processes).

against the simulator with the allocator model (:mod:`dptune.backends.simulated.reserved`, the options
of ``PYTORCH_CUDA_ALLOC_CONF`` in this environment) on a one-card cluster like this one
(context = what was measured before the first allocation, no NCCL on one card). It prints
the relative error per level and writes ``reports/benchmarks/validate_reserved.csv``. Without
a GPU it says so and exits 0. On one H200 (2026-11-27, ``benchmarks/measured/``) the reserved
peak was within -14.6% to +6.9% on 19 training steps; several cards and NCCL are not checked.

``--batches LO:HI`` measures every batch size from LO to HI instead of the cases' own (with
``--only``): a sweep that says where the card's reserved peak falls as the batch grows, and
where the simulator says it falls. A certificate at the reserved level ("c fits, c+1 over")
is a proof only where the figure does not fall; the sweep is the real card's answer.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSV_PATH = os.path.join(ROOT, "reports", "benchmarks", "validate_reserved.csv")
LEVELS = ("allocated", "reserved", "total")


def measure_real(case: Any, batch: int, before_bytes: int) -> dict[str, int]:
    """The three levels of the measured step of a plain loop on cuda:0 (see the docstring)."""
    import torch

    from benchmarks.validate_gpu import _free, plain_step

    torch.manual_seed(0)
    model = case.factory().cuda(0)
    opt = case.optimizer(model.parameters())
    accumulate = int(case.step.get("accumulate", 1))
    try:
        for i in range(3):                      # two warm-up steps, then the measured one
            model.zero_grad(set_to_none=True)
            hosts = [case.sample(model, batch) for _ in range(accumulate)]
            if i == 2:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(0)
                retries0 = torch.cuda.memory_stats(0).get("num_alloc_retries", 0)
            plain_step(model, opt, hosts, case.step.get("amp"), "cuda:0")
            del hosts
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(0)
        reserved = int(stats["reserved_bytes.all.peak"])
        return {"allocated": int(stats["allocated_bytes.all.peak"]), "reserved": reserved,
                "total": reserved + before_bytes,
                "retries": int(stats.get("num_alloc_retries", 0)) - retries0}
    finally:
        del model, opt
        _free()


def _row(case: Any, index: int, batch: int, before: int, estimates: Any) -> Any:
    """Measure one row on the card, take its estimate, print it (None: not measured)."""
    import torch

    from dptune.units import format_bytes

    try:
        real = measure_real(case, batch, before)
        est = estimates.get(index, batch)
    except torch.OutOfMemoryError:
        print(f"{case.label:<16}{batch:>6}  out of memory on this card, skipped")
        return None
    except RuntimeError as e:   # a construct the simulator cannot run: say which
        print(f"{case.label:<16}{batch:>6}  not simulated: {e}")
        return None
    row: dict[str, Any] = {"model": case.label, "step": case.step_label, "batch_size": batch}
    for level in LEVELS:
        row[f"real_{level}"], row[f"est_{level}"] = real[level], est[level]
        row[f"err_{level}"] = round((est[level] - real[level]) / real[level], 5)
    row["real_retries"], row["est_retries"] = real["retries"], est["retries"]
    print(f"{case.label:<16}{case.step_label:<20}{batch:>6}  " + "  ".join(
        f"{level} {format_bytes(real[level])}/{format_bytes(est[level])} "
        f"({row[f'err_{level}']:+.1%})" for level in LEVELS), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--csv", default=CSV_PATH, help="where to write the table")
    parser.add_argument("--quick", action="store_true", help="only the first batch size of each model")
    parser.add_argument("--only", action="append", metavar="MODEL",
                        help="only the rows of this model (repeatable)")
    parser.add_argument("--batches", metavar="LO:HI", default=None,
                        help="every batch size from LO to HI (inclusive) instead of the cases' own")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that compute the estimates while the card measures")
    args = parser.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        print("validate_reserved: no CUDA GPU here (torch.cuda.is_available() is False); "
              "nothing to validate, skipping.")
        return 0
    from benchmarks.validate_gpu import Estimates, RowWriter, _cases, selected_rows
    from dptune.units import format_bytes

    torch.cuda.init()
    torch.empty(1, device="cuda:0")                 # the context, before the models
    free, total = torch.cuda.mem_get_info(0)
    before = int(total - free - torch.cuda.memory_reserved(0))
    cluster_kw = {"total_bytes": int(total), "name": torch.cuda.get_device_name(0), "context_bytes": before,
                  "capability": tuple(torch.cuda.get_device_capability(0))}
    torch.backends.cudnn.benchmark = False
    print(f"validate_reserved: {torch.cuda.get_device_name(0)}, held before the models "
          f"{format_bytes(before)}, PYTORCH_CUDA_ALLOC_CONF="
          f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    rows = []
    cases = _cases()
    wanted = selected_rows(cases, args.quick, args.only)
    if args.batches:
        lo, hi = (int(x) for x in args.batches.split(":"))
        wanted = [(i, b) for i in sorted({i for i, _ in wanted}) for b in range(lo, hi + 1)]
    estimates = Estimates(wanted, cluster_kw, "levels", args.jobs)
    out = RowWriter(args.csv)
    try:
        for index, batch in wanted:
            row = _row(cases[index], index, batch, before, estimates)
            if row is not None:
                rows.append(row)
                out.add(row)
    finally:
        estimates.close()
        out.close()
    print(f"table written to {os.path.relpath(args.csv)}")
    if args.batches:
        print(falls_summary(rows))
    return 0


def falls(rows: list[dict[str, Any]], key: str) -> list[tuple[str, str, int, int]]:
    """(model, step, batch, bytes it fell by) wherever ``key`` is lower at a batch than at the
    batch before it, in the same model and step."""
    out = []
    for prev, row in zip(rows, rows[1:]):
        same = (prev["model"], prev["step"]) == (row["model"], row["step"])
        if same and row["batch_size"] == prev["batch_size"] + 1 and row[key] < prev[key]:
            out.append((row["model"], row["step"], row["batch_size"], prev[key] - row[key]))
    return out


def falls_summary(rows: list[dict[str, Any]]) -> str:
    """Where the measured and the simulated reserved peaks fall as the batch grows by one."""
    from dptune.units import format_bytes

    lines = []
    for who in ("real", "est"):
        found = falls(rows, f"{who}_reserved")
        name = "measured" if who == "real" else "simulated"
        lines.append(f"{name} reserved peak falls at {len(found)} of {max(0, len(rows) - 1)} steps"
                     + "".join(f"\n  {m} {s} batch {b}: -{format_bytes(d)}" for m, s, b, d in found))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
