"""``dptune plan``: per-rank batch sizes for DistributedDataParallel (or FSDP2) on a
simulated cluster; :func:`ddp_plan` is the work without the printing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any, Optional

from dptune.cli.arguments import (EPILOG, headroom_argument, objective_argument, step_arguments,
                                  workload_arguments, workload_spec)
from dptune.cli.objectives import objective_line
from dptune.cli.checks import (budget_of, check_cards, check_level_flags, check_nccl_bytes, check_plan_out,
                               global_batch_arg, level_arguments, out_path, positive_float)
from dptune.errors import EXIT_OK, UsageError
from dptune.step.spec import WorkloadSpec

if TYPE_CHECKING:  # pragma: no cover
    from dptune.settings import Budget

__all__ = ["ddp_plan", "plan_parser"]


def ddp_plan(spec: WorkloadSpec, *, global_batch: Optional[int] = None,
             simulate: str = "4x24GB", objective: Optional[str] = None,
             budget: Optional["Budget"] = None, bucket_cap_mb: Optional[float] = None,
             gradient_as_bucket_view: bool = False, strategy: str = "ddp",
             reshard_after_forward: bool = True, mp_param_dtype: Optional[str] = None,
             micro_batches: Any = 1) -> Any:
    """``dptune plan`` without the printing: per-rank DDP batch sizes on a simulated cluster
    (one rank per card) for the step ``spec`` describes; returns the :class:`dptune.ddp.DDPPlan`.
    ``budget``: a :class:`dptune.Budget` (``None``: the default). ``strategy="fsdp"``: FSDP2 with
    the default sharding, ``mp_param_dtype`` ("bf16", "fp16") the ``MixedPrecisionPolicy``'s
    parameter dtype (gradients reduced in fp32). ``micro_batches``: as :func:`dptune.ddp.plan`'s
    (``"auto"``: ``global_batch`` per optimizer step, with gradient accumulation)."""
    from dptune.hardware.cluster import parse_cluster
    from dptune.ddp import plan

    cluster = parse_cluster(simulate)   # a bad spec is a usage error before the user's code runs
    fsdp: dict[str, Any] = {}
    if strategy == "fsdp":
        from dptune.ddp.fsdp import mixed_precision

        if bucket_cap_mb is not None or gradient_as_bucket_view:
            raise UsageError("--bucket-cap-mb and --gradient-as-bucket-view are DDP's; leave them "
                             "out with --strategy fsdp")
        fsdp = dict(strategy="fsdp", reshard_after_forward=reshard_after_forward,
                    mp_policy=mixed_precision(mp_param_dtype))
    elif not reshard_after_forward or mp_param_dtype is not None:
        raise UsageError("--no-reshard-after-forward and --mp-param-dtype are FSDP's: add "
                         "--strategy fsdp")
    wl = spec.build()
    ddp: dict[str, Any] = {} if fsdp else dict(bucket_cap_mb=bucket_cap_mb,
                                               gradient_as_bucket_view=gradient_as_bucket_view)
    return plan(wl.model, wl.sample, wl.loss_fn, wl.optimizer, global_batch=global_batch,
                objective=objective, simulate=cluster, budget=budget, amp=wl.amp,
                accumulate=wl.accumulate, clip_grad_norm=wl.clip_grad_norm, step=wl.step,
                micro_batches=micro_batches, **ddp, **fsdp)


def plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="per-rank batch sizes for DistributedDataParallel on unequal cards",
        description="Plan one local batch per DDP rank (one rank per card of a simulated\n"
                    "cluster): the fastest batches that fit (or the same share of memory on\n"
                    "every card, or the largest global batch); print the plan and plan.json.\n"
                    "Inside a torchrun job, call dptune.ddp.plan(...) on every rank instead.\n"
                    "With --lengths FILE: each rank's batch per length bucket (lengths.json).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p, batch_default=None,
                       batch_help="the global batch (the sum of the ranks' batches) to split; "
                                  "needed except with --objective max-batch, where it is an upper limit")
    step_arguments(p)
    c = p.add_argument_group("cards and DDP")
    c.add_argument("--simulate", metavar="SPEC", default=None,
                   help="virtual cards, one rank each, e.g. 2x32GB,2x24GB or "
                        "4x24GB,used=3:10GB (default 4x24GB)")
    headroom_argument(c)
    c.add_argument("--bucket-cap-mb", type=positive_float, default=None, metavar="MIB",
                   help="DDP's bucket_cap_mb (default: torch's, 25)")
    c.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view=True (no second copy of the gradients)")
    level_arguments(p)
    f = p.add_argument_group("FSDP2 (--strategy fsdp)")
    f.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                   help="ddp (default), or fsdp: the model sharded with FSDP2's fully_shard, "
                        "each ModuleList block then the root")
    f.add_argument("--no-reshard-after-forward", action="store_true",
                   help="fully_shard(..., reshard_after_forward=False)")
    f.add_argument("--mp-param-dtype", choices=("bf16", "fp16"), default=None,
                   help="MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)")
    t = p.add_argument_group("plan and output")
    objective_argument(t, "default: throughput, per-rank batches of --batch-size with the "
                          "shortest step that fits; balance: the same share of memory on every "
                          "card; max-batch: the largest global batch")
    p.set_defaults(objective=None)   # the planner's default: the fastest batches that fit
    t.add_argument("--global-batch", type=global_batch_arg, metavar="N", default=None,
                   help="instead of --batch-size: N samples per optimizer step, trained with "
                        "gradient accumulation; the plan chooses the number of micro-batches "
                        "(a divisor of N) and each rank's batch, the fastest that fit")
    t.add_argument("--out", metavar="PATH", type=out_path,
                   help="a folder (plan.json + summary.md) or a .json file "
                        "(default reports/ddp-<Model>-<cluster>)")
    t.add_argument("--json", action="store_true",
                   help="print the plan as JSON on stdout, and nothing else there")
    t.add_argument("--quiet", "-q", action="store_true", help="only where the plan went")
    from dptune.cli.plan_lengths import plan_length_arguments   # --lengths, --buckets, ...

    plan_length_arguments(p)
    p.set_defaults(func=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    simulate = args.simulate
    if simulate is None:
        from dptune.hardware.cluster import DEFAULT_CLUSTER

        simulate = DEFAULT_CLUSTER
        if not args.quiet:
            print(f"dptune: planning for the simulated cluster {DEFAULT_CLUSTER} "
                  "(choose cards with --simulate SPEC)", file=sys.stderr)
    if args.lengths is not None:    # each rank's batch per length bucket
        from dptune.cli import plan_lengths

        check_cards(simulate)
        check_level_flags(args)
        check_nccl_bytes(args.nccl_bytes, simulate, args.headroom)
        return plan_lengths.run(args, simulate)
    if args.global_batch is not None:
        if args.batch_size is not None or args.objective not in (None, "throughput"):
            raise UsageError("--global-batch plans the fastest micro-batches of a global batch: "
                             "give it without --batch-size, with the default objective "
                             "(throughput)")
    elif args.objective != "max-batch" and args.batch_size is None:
        raise UsageError(f"--objective {args.objective or 'throughput'} splits a global batch: "
                         "give --batch-size N (or --objective max-batch for the largest that fits)")
    check_cards(simulate)
    check_level_flags(args)
    check_nccl_bytes(args.nccl_bytes, simulate, args.headroom)
    if args.out:  # checked before minutes of planning
        check_plan_out(args.out)
    if not args.quiet:
        print(objective_line("plan", args.objective), file=sys.stderr)
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        result = ddp_plan(
            workload_spec(args), simulate=simulate,
            global_batch=args.batch_size if args.global_batch is None else args.global_batch,
            micro_batches=1 if args.global_batch is None else "auto",
            objective=args.objective, budget=budget_of(args),
            bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view,
            strategy=args.strategy, reshard_after_forward=not args.no_reshard_after_forward,
            mp_param_dtype=args.mp_param_dtype)
        if args.out:
            target = args.out
        else:
            from dptune.report.files import default_folder

            target = str(default_folder(result.model_name, result.cluster,
                                        prefix=f"{args.strategy}-", strip_remark=False))
            check_plan_out(target, "the default folder")   # a plan or nothing there too
        written = result.save(target)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif not args.quiet:
        print(result.summary())
    print(f"plan written to {written}", file=out)
    return EXIT_OK
