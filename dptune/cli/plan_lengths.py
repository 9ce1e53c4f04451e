"""``dptune plan ... --lengths FILE --buckets 8|E1,E2,...``: per length bucket, each DDP
rank's batch on the simulated cluster.

The plan per bucket is :func:`dptune.lengths.plan_lengths` with ``ddp=True`` (what
``dptune search --lengths FILE --ddp --simulate SPEC`` plans), with ``plan``'s objectives:
``throughput`` (the default) gives each bucket the per-rank batches with the most tokens per
second, each within its rank's memory (:func:`dptune.lengths.ddp_speed.fastest_ranks`);
``max-batch`` each rank's largest batch. The report is the length plan's (``lengths.json``,
read by :class:`dptune.lengths.BucketBatchSampler` in every rank).
"""

from __future__ import annotations

import argparse
from typing import Any

from dptune.errors import UsageError

__all__ = ["plan_length_arguments", "run"]


def plan_length_arguments(p: argparse.ArgumentParser) -> None:
    from dptune.cli.lengths_command import bucket_arguments

    g = p.add_argument_group("variable lengths (each rank's batch per length bucket)")
    g.add_argument("--lengths", metavar="FILE[:COLUMN]", default=None,
                   help="the training samples' lengths: one integer per line, or a column of a "
                        "CSV/Parquet file; plans each rank's batch for every length bucket "
                        "(--batch-size: where the shortest bucket's search starts)")
    bucket_arguments(g)


def _refuse(args: argparse.Namespace) -> None:
    """The ``plan`` flags a length plan does not take, one message."""
    given = [flag for flag, on in (
        ("--global-batch", args.global_batch is not None),
        ("--strategy fsdp", args.strategy == "fsdp"),
        ("--bucket-cap-mb", args.bucket_cap_mb is not None),
        ("--gradient-as-bucket-view", args.gradient_as_bucket_view),
        ("--no-reshard-after-forward", args.no_reshard_after_forward),
        ("--mp-param-dtype", args.mp_param_dtype is not None)) if on]
    if given:
        raise UsageError(f"--lengths plans DDP ranks with torch's default DDP settings, one batch "
                         f"per rank and bucket; drop {', '.join(given)}")
    if args.objective == "balance":
        raise UsageError("--lengths takes --objective throughput (the default: each bucket's "
                         "fastest per-rank batches) or max-batch (each rank's largest)")
    if args.out and args.out.endswith(".json"):
        raise UsageError("--lengths writes a report folder (lengths.json, summary): give --out "
                         "a folder")


def run(args: argparse.Namespace, simulate: str) -> int:
    """``dptune plan --lengths``: plan, print one line per bucket, write the report."""
    from dptune.cli import lengths_command
    from dptune.cli.arguments import workload_spec
    from dptune.cli.checks import REPORT_TEMP_ROOM, check_out

    _refuse(args)
    if args.out:   # before minutes of planning
        check_out(args.out, "--out", room=REPORT_TEMP_ROOM, report=True)
    ns: dict[str, Any] = dict(vars(args), objective=args.objective or "throughput",
                              simulate=simulate, ddp=True, output_device=0, hf_trainer=None,
                              devices=None, max_probes=16, no_plots=True,
                              objective_of="plan")
    return lengths_command.run(argparse.Namespace(**ns), workload_spec(args))
