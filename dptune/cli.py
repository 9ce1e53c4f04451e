"""dptune's command line: a thin layer over :class:`dptune.Tuner` (parse, build, call, show, write).

Commands::

    dptune search --model mymodels:Net --batch-size 64 [--simulate 4x24GB | --devices 0,1]
    dptune plan --model mymodels:Net --batch-size 256 --simulate 2x32GB,2x24GB
                                   per-rank batch sizes for DistributedDataParallel
    dptune show reports/NAME       print a saved report's (or DDP plan's) summary
    dptune plot reports/NAME       redraw a saved report's plots
    dptune devices                 list the visible GPUs

Exit codes (also in ``dptune --help``)::

    0    success
    1    an error in the user's code (model, batch, loss, optimizer): its traceback is shown
    2    usage: bad flags, cluster spec, import string, JSON, or report folder
    3    no split of the batch fits every card's budget
    4    the backend is unavailable (e.g. --devices on a machine without a visible GPU)
    130  interrupted (Ctrl-C)

Errors dptune diagnoses are one line on stderr, ``dptune: error: <message>``, with no
traceback; so are argparse's own (with the command's ``--help`` to read instead of the usage
block). Inputs out of any sensible range are checked before any work (:mod:`dptune.cli_checks`). Each subcommand is registered by a ``*_parser(subparsers)`` function; the work
is done by plain functions that take and return values (:func:`search`, :func:`ddp_plan`),
and printing is kept apart from them.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pathlib
import sys
import traceback
from typing import TYPE_CHECKING, Any, Iterator, NoReturn, Optional, Sequence, Union

from dptune.cli_checks import (REPORT_TEMP_ROOM, accumulate_arg, batch_size_arg, card_or_auto,
                               check_cards, check_level_flags, check_out, check_plan_out,
                               device_ids_arg, headroom_arg, level_arguments, level_options,
                               out_path, positive_float, positive_int)
from dptune.errors import (EXIT_BACKEND, EXIT_NO_FIT, EXIT_OK, EXIT_USAGE, EXIT_USER_CODE,
                           DptuneError, UsageError, UserCodeError)
from dptune.presets import (LOSSES, OPTIMIZERS, adam, adamw, cross_entropy_loss, mean_loss, mse_loss,
                            sgd, sum_loss)
from dptune.spec import DTYPES, WorkloadSpec, import_users, users_code

if TYPE_CHECKING:  # pragma: no cover

    from dptune.result import TuneResult

__all__ = ["main", "build_parser", "search", "search_trainer", "ddp_plan", "workload_spec",
           "WorkloadSpec", "DTYPES",
           # the built-ins, from dptune.presets
           "LOSSES", "OPTIMIZERS", "sum_loss", "mean_loss", "cross_entropy_loss", "mse_loss",
           "sgd", "adam", "adamw"]

EXIT_INTERRUPTED = 130

EPILOG = f"""\
exit codes:
  {EXIT_OK}    success
  {EXIT_USER_CODE}    an error in your model, batch, loss or optimizer (its traceback is shown)
  {EXIT_USAGE}    usage: bad flags, cluster spec, import string, JSON or report folder
  {EXIT_NO_FIT}    no split of the batch fits every card's budget
  {EXIT_BACKEND}    backend unavailable (e.g. --devices with no visible GPU)
  {EXIT_INTERRUPTED}  interrupted
"""

# Frames left out of the traceback of the user's error: dptune's own, and the import machinery.
_HIDDEN_FRAMES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                  os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep,
                  "<frozen importlib")


# ---- from flags to a workload spec ----------------------------------------------------------

#: ``--batch-size`` when not given (with --model).
DEFAULT_BATCH_SIZE = 256


def parse_model_kwargs(text: Optional[str]) -> dict[str, Any]:
    """``--model-kwargs '{"depth": 12}'`` -> ``{"depth": 12}``."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--model-kwargs is not valid JSON ({e.msg} at column {e.colno}): "
                         f"{text!r}; e.g. --model-kwargs '{{\"depth\": 12}}'") from None
    if not isinstance(value, dict):
        raise UsageError(f"--model-kwargs must be a JSON object, got {text!r}; "
                         "e.g. --model-kwargs '{\"depth\": 12}'")
    return value


def parse_shape(text: str) -> tuple[int, ...]:
    """``"3,224,224"`` -> ``(3, 224, 224)`` (one sample's shape, without the batch)."""
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(","))
    except ValueError:  # not a number, or an empty item ("3,,224")
        shape = ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"--input-shape {text!r}: give one sample's shape as positive ints "
                         "separated by commas, e.g. 3,224,224 (the batch dimension is added)")
    return shape


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The :class:`~dptune.spec.WorkloadSpec` the flags of ``search`` and ``plan`` describe."""
    return WorkloadSpec(
        model=args.model, model_kwargs=parse_model_kwargs(args.model_kwargs), sample=args.sample,
        input_shape=args.input_shape, dtype=args.dtype, vocab_size=args.vocab_size,
        loss=args.loss, optimizer=args.optimizer, amp=args.amp, accumulate=args.accumulate,
        clip_grad_norm=args.clip_grad_norm, step=args.step)


def search(spec: WorkloadSpec, *, batch_size: int = DEFAULT_BATCH_SIZE,
           devices: Optional[Sequence[int]] = None, simulate: Optional[str] = None,
           objective: str = "balance", headroom_bytes: Optional[int] = None, max_probes: int = 12,
           verbose: bool = True, isolate: bool = False,
           output_device: Union[int, str] = 0, budget_level: str = "allocated",
           allocator: Optional[str] = None, nccl_bytes: Optional[int] = None) -> "TuneResult":
    """``dptune search`` without the printing: :meth:`dptune.Tuner.from_spec`, then ``fit``.
    With neither ``devices`` nor ``simulate``, all visible GPUs are used, or the default
    simulated cluster when none is visible (the tuner says so once). ``headroom_bytes``
    ``None``: the budget level's default; ``budget_level``, ``allocator``, ``nccl_bytes``: as
    :class:`dptune.Tuner`'s."""
    from dptune.tuner import Tuner

    tuner = Tuner.from_spec(spec, batch_size, device_ids=list(devices) if devices else None,
                            simulate=simulate, isolate=isolate, objective=objective,
                            headroom=headroom_bytes, verbose=verbose, max_probes=max_probes,
                            output_device=output_device, budget_level=budget_level,
                            allocator=allocator, nccl_bytes=nccl_bytes)
    return tuner.fit()


def search_trainer(make_trainer: str, *, ignored: Sequence[str] = (),
                   batch_size: Optional[int] = None, devices: Optional[Sequence[int]] = None,
                   simulate: Optional[str] = None, objective: str = "balance",
                   headroom_bytes: Optional[int] = None, max_probes: int = 12,
                   verbose: bool = True, **levels: Any) -> "TuneResult":
    """``dptune search --hf-trainer mymod:make_trainer``: call ``make_trainer()`` and tune the
    Trainer it returns with :func:`dptune.integrations.transformers.tune_trainer`.

    ``ignored`` names flags given that describe a model, which the Trainer already defines;
    ``levels``: ``budget_level``, ``allocator``, ``nccl_bytes`` for the :class:`dptune.Tuner`.
    """
    from dptune.backends.cluster import parse_cluster

    if ignored:
        raise UsageError(f"--hf-trainer takes the model, batch, loss, optimizer and step "
                         f"settings from the Trainer and its TrainingArguments; drop "
                         f"{', '.join(ignored)}")
    cluster = parse_cluster(simulate) if simulate is not None else None
    trainer = load_trainer(make_trainer)
    from dptune.backends.reserved import DEFAULT_HEADROOM, parse_level
    from dptune.integrations.transformers import tune_trainer

    if headroom_bytes is None:   # the level's default (tune_trainer's own is the allocated one)
        headroom_bytes = DEFAULT_HEADROOM[parse_level(levels.get("budget_level", "allocated"))]
    return tune_trainer(trainer, objective=objective, simulate=cluster, headroom=headroom_bytes,
                        batch_size=batch_size, device_ids=list(devices) if devices else None,
                        max_probes=max_probes, verbose=verbose, **levels)


def load_trainer(make_trainer: str) -> Any:
    """``--hf-trainer mymod:make_trainer``: the ``transformers.Trainer`` it returns."""
    try:
        import transformers
    except ImportError:
        raise UsageError("--hf-trainer needs the transformers package: "
                         "pip install 'dptune[hf]'") from None
    factory = import_users(make_trainer, "--hf-trainer")
    if not callable(factory):
        raise UsageError(f"--hf-trainer {make_trainer!r} names a {type(factory).__name__}; give "
                         "a function that returns a configured transformers.Trainer")
    with users_code(f"building the Trainer with {make_trainer}()"):
        trainer = factory()
    if not isinstance(trainer, transformers.Trainer):
        raise UsageError(f"--hf-trainer {make_trainer}() returned a {type(trainer).__name__}, "
                         "not a transformers.Trainer")
    return trainer


def _model_only_flags(args: argparse.Namespace) -> list[str]:
    """Flags given that describe a model and its batch (meaningless with --hf-trainer)."""
    given = [("--model-kwargs", args.model_kwargs is not None), ("--sample", args.sample is not None),
             ("--input-shape", args.input_shape is not None), ("--dtype", args.dtype is not None),
             ("--vocab-size", args.vocab_size is not None), ("--loss", args.loss != "default"),
             ("--optimizer", args.optimizer != "adamw"), ("--isolate", args.isolate),
             ("--amp", args.amp is not None), ("--accumulate", args.accumulate != 1),
             ("--clip-grad-norm", args.clip_grad_norm is not None), ("--step", args.step is not None),
             ("--output-device", args.output_device != 0)]
    return [flag for flag, on in given if on]


def default_report_dir(result: "TuneResult") -> pathlib.Path:
    """``reports/<Model>-<cluster>``, e.g. ``reports/TinyGPT-4x24GB`` (the cluster's
    description without its parenthesised remark, in characters safe for a file name)."""
    from dptune.report.files import default_folder

    return default_folder(result.model_name, result.cluster)


# ---- argument types (the others are in dptune.cli_checks) ---------------------------------

def _shape(text: str) -> tuple[int, ...]:
    try:
        return parse_shape(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--input-shape ", "", 1)) from None


# ---- subcommands -----------------------------------------------------------------------

def workload_arguments(p: argparse.ArgumentParser, *, batch_default: Optional[int],
                       batch_help: str, hf_trainer: bool = False) -> Any:
    """The "model and batch" flags, shared by ``search`` and ``plan``; returns the group.

    ``hf_trainer``: ``--hf-trainer`` may stand in for ``--model`` (``search`` only)."""
    g = p.add_argument_group("model and batch")
    what = g.add_mutually_exclusive_group(required=True) if hf_trainer else g
    what.add_argument("--model", metavar="MODULE:ATTR", required=not hf_trainer,
                      help="model class or factory, e.g. mymodels:Net (imported from the working "
                           "directory or installed packages)")
    if hf_trainer:
        what.add_argument("--hf-trainer", metavar="MODULE:FUNC",
                          help="a function returning a configured transformers.Trainer: its "
                               "model, data, optimizer and step settings are tuned (needs "
                               "dptune[hf])")
    g.add_argument("--model-kwargs", metavar="JSON", default=None,
                   help='keyword arguments for the model, as a JSON object, e.g. \'{"depth": 12}\'')
    batch = g.add_mutually_exclusive_group()
    batch.add_argument("--sample", metavar="MODULE:FUNC",
                       help="function batch_size -> batch (tensor, tuple or dict)")
    batch.add_argument("--input-shape", type=_shape, metavar="D1,D2,...",
                       help="one sample's shape, e.g. 3,224,224; random data of --dtype")
    g.add_argument("--dtype", choices=DTYPES, default=None,
                   help="dtype of --input-shape data (default float32; long with --vocab-size)")
    g.add_argument("--vocab-size", type=positive_int, metavar="N",
                   help="token ids for --input-shape are drawn from 0..N-1 (dtype long)")
    g.add_argument("--batch-size", type=batch_size_arg, default=batch_default, metavar="N",
                   help=batch_help)
    g.add_argument("--loss", default="default", metavar="NAME",
                   help="default (the output's .loss, else the sum of the output), sum, mean, "
                        "cross_entropy, mse, or MODULE:FUNC taking (output, batch)")
    g.add_argument("--optimizer", default="adamw", metavar="NAME",
                   help="adamw (default), adam, sgd (momentum 0.9), none, or MODULE:FUNC "
                        "taking the parameters")
    return g


def _headroom_argument(group: Any) -> None:
    group.add_argument("--headroom", type=headroom_arg, default=None, metavar="SIZE",
                       help="memory kept free on every card, e.g. 512MiB (default 1GiB at "
                            "--budget-level allocated, 256MiB at reserved)")


def _objective_argument(group: Any, help: str) -> None:
    group.add_argument("--objective", choices=("balance", "max-batch", "throughput"), default="balance",
                       type=lambda s: s.replace("_", "-"), help=help)


def step_arguments(p: argparse.ArgumentParser) -> Any:
    """The training-step flags (amp, accumulation, clipping, own step), shared by ``search``
    and ``plan``; returns the group."""
    st = p.add_argument_group("training step (what the split is tuned for)")
    st.add_argument("--amp", choices=("bf16", "fp16"), default=None,
                    help="mixed precision: forward and loss under torch.autocast('cuda', dtype), "
                         "with a GradScaler for fp16 (default: fp32)")
    st.add_argument("--accumulate", type=accumulate_arg, default=1, metavar="N",
                    help="micro-batches per optimizer step (gradient accumulation); --batch-size "
                         "stays per forward pass (default 1)")
    st.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="X",
                    help="clip_grad_norm_ to max norm X before the optimizer step")
    st.add_argument("--step", metavar="MODULE:FUNC", default=None,
                    help="your own step(model, batch, optimizer), replacing the built-in step "
                         "(model: already wrapped; optimizer: built from --optimizer)")
    return st


def search_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "search", help="find the per-GPU split of the batch that balances memory",
        description="Probe the training step of a model at a few splits of the batch, fit\n"
                    "per-card memory and pick the split that balances it (or fits the largest\n"
                    "batch); print a table and write a report folder.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p, batch_default=None, hf_trainer=True,
                       batch_help="total batch size over all cards (default 256, with "
                                  "--hf-trainer per_device_train_batch_size x cards; for "
                                  "--objective max-batch, where the search starts)")
    step_arguments(p)
    c = p.add_argument_group("cards")
    where = c.add_mutually_exclusive_group()
    where.add_argument("--devices", type=device_ids_arg, metavar="I,J,...",
                       help="real GPUs to use, e.g. 0,1,2,3 (default: all visible)")
    where.add_argument("--simulate", metavar="SPEC",
                       help="virtual cards, e.g. 4x24GB, 2xA100-80GB,2xA100-40GB or "
                            "4x24GB,used=0:6GB (default when no GPU is visible: 4x24GB)")
    _headroom_argument(c)
    level_arguments(p)
    t = p.add_argument_group("search and output")
    _objective_argument(t, "balance: even out memory at --batch-size (default); max-batch: the "
                           "largest batch that fits; throughput: the fastest split of --batch-size "
                           "that fits (cards may differ in speed, or be left out)")
    t.add_argument("--max-probes", type=positive_int, default=12, metavar="N",
                   help="at most this many training steps are probed (default 12)")
    t.add_argument("--output-device", type=card_or_auto, default=0, metavar="K|auto",
                   help="the card the outputs are gathered on (default 0, as DataParallel); "
                        "'auto' with --objective max-batch tries another card and keeps it when "
                        "it fits a larger batch")
    t.add_argument("--out", metavar="DIR", type=out_path,
                   help="report folder (default reports/<Model>-<cluster>)")
    t.add_argument("--no-plots", action="store_true", help="write the report without PNG plots")
    c.add_argument("--isolate", action="store_true",
                   help="with --devices: run each probe in a spawned child process, so a sticky "
                        "CUDA error costs only that child")
    t.add_argument("--json", action="store_true",
                   help="print the result as JSON on stdout, and nothing else there")
    t.add_argument("--quiet", "-q", action="store_true",
                   help="no progress bar and no table; only where the report went")
    from dptune.lengths.cli import length_arguments   # --lengths, --buckets, --length-axis

    length_arguments(p)
    p.set_defaults(func=_search_command)


def _search_command(args: argparse.Namespace) -> int:
    from dptune.report import render_table, report_dict, write_report

    out = sys.stderr if args.json else sys.stdout
    if args.out:  # before minutes of probing
        check_out(args.out, "--out", room=REPORT_TEMP_ROOM, report=True)
    check_cards(args.simulate, args.devices, 0 if args.hf_trainer else args.output_device)
    check_level_flags(args)
    if args.lengths is not None:   # a plan per length bucket
        from dptune.lengths import cli as lengths_cli

        return lengths_cli.run(args, None if args.hf_trainer else workload_spec(args))

    # With --json, anything the tuner prints goes to stderr: stdout holds only the JSON.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        if args.hf_trainer:
            result = search_trainer(
                args.hf_trainer, ignored=_model_only_flags(args), batch_size=args.batch_size,
                devices=args.devices, simulate=args.simulate,
                objective=args.objective.replace("-", "_"), headroom_bytes=args.headroom,
                max_probes=args.max_probes, verbose=not args.quiet, **level_options(args))
        else:
            result = search(
                workload_spec(args), batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                devices=args.devices, simulate=args.simulate,
                objective=args.objective.replace("-", "_"), headroom_bytes=args.headroom,
                max_probes=args.max_probes, verbose=not args.quiet, isolate=args.isolate,
                output_device=args.output_device, **level_options(args))
        folder = pathlib.Path(args.out) if args.out else default_report_dir(result)
        write_report(result, folder, plots=not args.no_plots)
    if args.json:
        print(json.dumps(report_dict(result), indent=2))
    elif not args.quiet:
        print(render_table(result))
        for line in result.advice:
            print(f"advice: {line}")
    print(f"report written to {folder}{os.sep}", file=out)
    return EXIT_OK


def ddp_plan(spec: WorkloadSpec, *, global_batch: Optional[int] = None,
             simulate: str = "4x24GB", objective: str = "balance",
             headroom_bytes: Optional[int] = None, bucket_cap_mb: Optional[float] = None,
             gradient_as_bucket_view: bool = False, budget_level: str = "allocated",
             allocator: Optional[str] = None, nccl_bytes: Optional[int] = None,
             strategy: str = "ddp", reshard_after_forward: bool = True,
             mp_param_dtype: Optional[str] = None) -> Any:
    """``dptune plan`` without the printing: per-rank DDP batch sizes on a simulated cluster
    (one rank per card) for the step ``spec`` describes; returns the :class:`dptune.ddp.DDPPlan`.
    ``headroom_bytes`` ``None``: the budget level's default. ``strategy="fsdp"``: FSDP2 with
    the default sharding, ``mp_param_dtype`` ("bf16", "fp16") the ``MixedPrecisionPolicy``'s
    parameter dtype (gradients reduced in fp32)."""
    from dptune.backends.cluster import parse_cluster
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
    return plan(wl.model, wl.sample, wl.loss_fn, wl.optimizer, global_batch=global_batch,
                objective=objective, simulate=cluster, headroom=headroom_bytes,
                bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=gradient_as_bucket_view,
                amp=wl.amp, accumulate=wl.accumulate, clip_grad_norm=wl.clip_grad_norm,
                step=wl.step, budget_level=budget_level, allocator=allocator,
                nccl_bytes=nccl_bytes, **fsdp)


def plan_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="per-rank batch sizes for DistributedDataParallel on unequal cards",
        description="Plan one local batch per DDP rank (one rank per card of a simulated\n"
                    "cluster), so that every card uses the same share of its memory (or the\n"
                    "global batch is as large as fits); print the plan and write plan.json.\n"
                    "Inside a torchrun job, call dptune.ddp.plan(...) on every rank instead.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(p, batch_default=None,
                       batch_help="the global batch (the sum of the ranks' batches) to split; "
                                  "needed for --objective balance, an upper limit for max-batch")
    step_arguments(p)
    c = p.add_argument_group("cards and DDP")
    c.add_argument("--simulate", metavar="SPEC", default=None,
                   help="virtual cards, one rank each, e.g. 2x32GB,2x24GB or "
                        "4x24GB,used=3:10GB (default 4x24GB)")
    _headroom_argument(c)
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
    _objective_argument(t, "balance: the same share of memory on every card at --batch-size "
                           "(default); max-batch: the largest global batch; throughput: per-rank "
                           "batches of --batch-size with the shortest step that fits")
    t.add_argument("--out", metavar="PATH", type=out_path,
                   help="a folder (plan.json + summary.md) or a .json file "
                        "(default reports/ddp-<Model>-<cluster>)")
    t.add_argument("--json", action="store_true",
                   help="print the plan as JSON on stdout, and nothing else there")
    t.add_argument("--quiet", "-q", action="store_true", help="only where the plan went")
    p.set_defaults(func=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    out = sys.stderr if args.json else sys.stdout
    simulate = args.simulate
    if simulate is None:
        from dptune.backends.cluster import DEFAULT_CLUSTER

        simulate = DEFAULT_CLUSTER
        if not args.quiet:
            print(f"dptune: planning for the simulated cluster {DEFAULT_CLUSTER} "
                  "(choose cards with --simulate SPEC)", file=sys.stderr)
    if args.objective in ("balance", "throughput") and args.batch_size is None:
        raise UsageError(f"--objective {args.objective} splits a global batch: give --batch-size N "
                         "(or --objective max-batch for the largest that fits)")
    check_cards(simulate)
    check_level_flags(args)
    if args.out:  # checked before minutes of planning
        check_plan_out(args.out)
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        result = ddp_plan(
            workload_spec(args), global_batch=args.batch_size, simulate=simulate,
            objective=args.objective.replace("-", "_"), headroom_bytes=args.headroom,
            bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view,
            strategy=args.strategy, reshard_after_forward=not args.no_reshard_after_forward,
            mp_param_dtype=args.mp_param_dtype, **level_options(args))
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


def show_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("show", help="print a saved report's (or DDP plan's) summary",
                              description="Print the summary of a report folder written by "
                                          "`dptune search`.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT", help="report folder (or its report.json)")
    p.add_argument("--json", action="store_true", help="print report.json's content instead")
    p.set_defaults(func=_show_command)


def _report_folder(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    return p.parent if p.is_file() else p


def _show_command(args: argparse.Namespace) -> int:
    from dptune.ddp.result import DDPPlan, is_plan_path
    from dptune.report import PLOT_KINDS, read_report, render_summary, report_dict

    if is_plan_path(args.report):   # a DDP plan written by `dptune plan`
        plan = DDPPlan.load(args.report)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
        return EXIT_OK

    result = read_report(args.report)
    if args.json:
        print(json.dumps(report_dict(result), indent=2))
        return EXIT_OK
    folder = _report_folder(args.report)
    plots = [k for k in PLOT_KINDS if (folder / f"{k}.png").exists()]
    print(render_summary(result, plots=plots))
    return EXIT_OK


def plot_parser(subparsers: Any) -> None:
    from dptune.report import PLOT_KINDS

    p = subparsers.add_parser("plot", help="redraw a saved report's plots",
                              description="Redraw the PNG plots of a report folder written by "
                                          "`dptune search`.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT", help="report folder (or its report.json)")
    p.add_argument("--kind", choices=PLOT_KINDS, action="append",
                   help="which plot (repeatable; default: every plot the report has)")
    p.add_argument("--out", metavar="DIR", type=out_path,
                   help="where to write the PNGs (default: the report folder)")
    p.set_defaults(func=_plot_command)


def _plot_command(args: argparse.Namespace) -> int:
    from dptune.report import read_report, write_plots

    if args.out:
        check_out(args.out, "--out")
    result = read_report(args.report)
    folder = pathlib.Path(args.out) if args.out else _report_folder(args.report)
    for kind in write_plots(result, folder, args.kind, flag="--out" if args.out else "REPORT"):
        print(f"wrote {folder / f'{kind}.png'}")
    return EXIT_OK


def devices_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("devices", help="list the visible GPUs",
                              description="List the CUDA GPUs this process can see, with the "
                                          "memory others use on them (from NVML).")
    p.set_defaults(func=_devices_command)


def _devices_command(args: argparse.Namespace) -> int:
    from dptune.gpus import devices, format_devices

    print(format_devices(devices()))
    return EXIT_OK


class _ArgumentError(Exception):
    """argparse's own complaint about the command line: one line from :func:`main`."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are dptune's one line (``dptune: error: ...``, exit 2,
    pointing at the command's ``--help``) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(message)


def build_parser() -> argparse.ArgumentParser:
    from dptune import __version__

    parser = _Parser(
        prog="dptune",
        description="Measure per-GPU memory of a DataParallel training step and balance\n"
                    "the split of the batch across the cards.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dptune {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in (search_parser, plan_parser, show_parser, plot_parser, devices_parser):
        register(subparsers)
    return parser


# ---- errors ------------------------------------------------------------------------------

def _is_dptune_frame(frame: traceback.FrameSummary) -> bool:
    return frame.filename.startswith(_HIDDEN_FRAMES)


def format_user_traceback(exc: BaseException) -> str:
    """The traceback of an exception raised by the user's code, without dptune's own frames
    (and importlib's), so what is left is the user's code and the libraries it called.

    ``""`` when no frame is left (e.g. a ``TypeError`` for a wrong keyword argument, raised
    at the call itself): the one-line message then says it all.
    """
    te = traceback.TracebackException.from_exception(exc)
    link: Optional[traceback.TracebackException] = te
    while link is not None:
        link.stack = traceback.StackSummary.from_list(
            [f for f in link.stack if not _is_dptune_frame(f)])
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
    return "".join(te.format()) if te.stack else ""


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Show dptune's own warnings as ``dptune: <message>``, each once; others as Python does."""
    import warnings

    from dptune.errors import DptuneWarning

    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("always", DptuneWarning)
        python_shows = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                 line: Optional[str] = None) -> None:
            if not issubclass(category, DptuneWarning):
                python_shows(message, category, filename, lineno, file, line)
            elif str(message) not in seen:
                seen.add(str(message))
                print(f"dptune: {message}", file=sys.stderr)

        warnings.showwarning = show
        yield


def argv_command(argv: Optional[Sequence[str]]) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return args[0] if args else ""


def _error(message: str) -> None:
    print(f"dptune: error: {message}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as e:
        command = argv_command(argv)
        known = command in ("search", "plan", "show", "plot", "devices")
        _error(f"{e}; see 'dptune{' ' + command if known else ''} --help'")
        return EXIT_USAGE
    except SystemExit as e:  # --help and --version (0)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        with _one_line_warnings():
            return args.func(args)
    except SystemExit as e:  # the user's code exited somewhere dptune did not expect it
        _error(f"your code called sys.exit({e.code!r}) during `dptune {argv_command(argv)}`; "
               "dptune runs it in its own process, so it must return or raise, not exit")
        return EXIT_USER_CODE
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except UserCodeError as e:
        shown = format_user_traceback(e.__cause__) if e.__cause__ is not None else ""
        sys.stderr.write(shown)
        _error(f"{e}" + (" (traceback above)" if shown else ""))
        return e.exit_code
    except DptuneError as e:
        _error(str(e))
        return e.exit_code
    except Exception as e:  # not diagnosed: show everything
        traceback.print_exc()
        _error(f"unexpected {type(e).__name__}: {e}; if the traceback above ends in dptune's "
               "own code, please report it as a bug")
        return EXIT_USER_CODE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
