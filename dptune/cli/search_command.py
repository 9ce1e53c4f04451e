"""``dptune search``: the flags, the command, and :func:`search` / :func:`search_trainer`
(the work without the printing). ``--lengths`` hands over to :mod:`dptune.cli.lengths_command`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence, Union

from dptune.cli.arguments import (DEFAULT_BATCH_SIZE, load_trainer, model_only_flags, EPILOG, headroom_argument,
                                  objective_argument, step_arguments, workload_arguments,
                                  workload_spec)
from dptune.cli.objectives import objective_line
from dptune.cli.checks import (REPORT_TEMP_ROOM, budget_of, card_or_auto, check_cards, check_nccl_bytes,
                               check_out, device_ids_arg, global_batch_arg, level_arguments, out_path,
                               positive_int)
from dptune.errors import EXIT_OK, UsageError
from dptune.settings import SearchSettings
from dptune.step.spec import WorkloadSpec

if TYPE_CHECKING:  # pragma: no cover
    from dptune.result.model import TuneResult
    from dptune.settings import Budget

__all__ = ["search", "search_trainer", "default_report_dir", "search_parser"]

#: ``--max-probes`` when not given (``--lengths``: :data:`lengths_command.DEFAULT_BUCKET_PROBES`
#: per bucket)
DEFAULT_MAX_PROBES = 12


def search(spec: WorkloadSpec, *, batch_size: int = DEFAULT_BATCH_SIZE,
           devices: Optional[Sequence[int]] = None, simulate: Optional[str] = None,
           objective: str = "balance", budget: Optional["Budget"] = None,
           search_settings: Optional["SearchSettings"] = None, isolate: bool = False,
           output_device: Union[int, str] = 0, global_batch: Optional[int] = None) -> "TuneResult":
    """``dptune search`` without the printing: :meth:`dptune.Tuner.from_spec`, then ``fit``.
    With neither ``devices`` nor ``simulate``, all visible GPUs are used, or the default
    simulated cluster when none is visible (the tuner says so once). ``budget`` and
    ``search_settings``: as :class:`dptune.Tuner`'s ``budget=`` and ``search=`` (``None``:
    the defaults)."""
    from dptune.tuner import Tuner

    tuner = Tuner.from_spec(spec, batch_size, device_ids=list(devices) if devices else None,
                            simulate=simulate, isolate=isolate, objective=objective,
                            budget=budget, search=search_settings, output_device=output_device,
                            global_batch=global_batch)
    with input_shape_checked(spec):
        return tuner.fit()


@contextlib.contextmanager
def input_shape_checked(spec: WorkloadSpec) -> Iterator[None]:
    """A batch from ``--input-shape`` whose ids run past one of the model's tables (a sequence
    longer than its positions, ``--vocab-size`` above its vocabulary): the flag's fault, said
    so (:class:`UsageError`), rather than the model's line failing."""
    from dptune.backends.simulated.index_bounds import IndexOutOfRangeError
    from dptune.errors import UserCodeError

    try:
        yield
    except UserCodeError as e:
        if spec.input_shape is None or not isinstance(e.__cause__, IndexOutOfRangeError):
            raise
        shape = ",".join(map(str, spec.input_shape))
        vocab = f" and --vocab-size {spec.vocab_size}" if spec.vocab_size is not None else ""
        raise UsageError(
            f"--input-shape {shape}{vocab}: the model's forward looked up an index past one of "
            f"its tables ({e.__cause__}; {str(e).split(' (split ')[0]}): give a sequence no "
            "longer than the model's positions (e.g. config.max_position_embeddings) and a "
            "--vocab-size no larger than its vocabulary") from e


def search_trainer(make_trainer: str, *, ignored: Sequence[str] = (),
                   batch_size: Optional[int] = None, devices: Optional[Sequence[int]] = None,
                   simulate: Optional[str] = None, objective: str = "balance",
                   budget: Optional["Budget"] = None,
                   search_settings: Optional["SearchSettings"] = None) -> "TuneResult":
    """``dptune search --hf-trainer mymod:make_trainer``: call ``make_trainer()`` and tune the
    Trainer it returns with :func:`dptune.integrations.transformers.tune_trainer`.

    ``ignored`` names flags given that describe a model, which the Trainer already defines;
    ``budget`` and ``search_settings``: as :class:`dptune.Tuner`'s ``budget=`` and ``search=``.
    """
    from dptune.hardware.cluster import parse_cluster

    if ignored:
        raise UsageError(f"--hf-trainer takes the model, batch, loss, optimizer and step "
                         f"settings from the Trainer and its TrainingArguments; drop "
                         f"{', '.join(ignored)}")
    cluster = parse_cluster(simulate) if simulate is not None else None
    trainer = load_trainer(make_trainer)
    from dptune.integrations.transformers import tune_trainer

    return tune_trainer(trainer, objective=objective, simulate=cluster, batch_size=batch_size,
                        device_ids=list(devices) if devices else None, budget=budget,
                        search=search_settings)


@contextlib.contextmanager
def _naming_nccl_bytes(nccl_bytes: Optional[int]) -> Iterator[None]:
    """A search that finds no split with ``--nccl-bytes`` given names the flag: the buffers it
    sets come out of every card's budget, and may be what leaves no room."""
    from dptune.errors import NoFeasibleSplitError
    from dptune.units import format_bytes

    try:
        yield
    except NoFeasibleSplitError as e:
        if nccl_bytes is None:
            raise
        raise NoFeasibleSplitError(f"{e} --nccl-bytes {format_bytes(nccl_bytes)} comes out of "
                                   "every card's budget (NCCL's buffers): check it against what "
                                   "NCCL_DEBUG=INFO or NVML shows") from None


def default_report_dir(result: "TuneResult") -> pathlib.Path:
    """``reports/<Model>-<cluster>``, e.g. ``reports/TinyGPT-4x24GB`` (the cluster's
    description without its parenthesised remark, in characters safe for a file name)."""
    from dptune.report.files import default_folder

    return default_folder(result.model_name, result.cluster)


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
    headroom_argument(c)
    level_arguments(p)
    t = p.add_argument_group("search and output")
    objective_argument(t, "balance: even out memory at --batch-size (default); max-batch: the "
                           "largest batch that fits; throughput: the fastest split of --batch-size "
                           "that fits (cards may differ in speed, or be left out)")
    t.add_argument("--max-probes", type=positive_int, default=None, metavar="N",
                   help="at most this many training steps are probed (default 12; with "
                        "--lengths, per bucket, default 16)")
    t.add_argument("--global-batch", type=global_batch_arg, metavar="N",
                   help="with --objective throughput: N samples per optimizer step, as equal "
                        "micro-batches (gradient accumulation); the number of micro-batches and "
                        "the micro-batch's split that finish it fastest")
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
    from dptune.cli.lengths_command import length_arguments   # --lengths, --buckets, --length-axis

    length_arguments(p)
    p.set_defaults(func=_search_command)


def _search_command(args: argparse.Namespace) -> int:
    from dptune.report import render_table, report_dict, write_report

    out = sys.stderr if args.json else sys.stdout
    if args.out:  # before minutes of probing
        check_out(args.out, "--out", room=REPORT_TEMP_ROOM, report=True)
    check_cards(args.simulate, args.devices, 0 if args.hf_trainer else args.output_device)
    check_nccl_bytes(args.nccl_bytes, args.simulate, args.headroom)
    if args.output_device == "auto" and args.objective != "max-batch":
        raise UsageError(f"--output-device auto tries another card to fit a larger batch, which "
                         f"only --objective max-batch looks for; with --objective {args.objective} "
                         "give a card number (default 0) or drop --output-device")
    budget = budget_of(args)          # the flags' objects, built once
    look = SearchSettings(max_probes=args.max_probes or DEFAULT_MAX_PROBES, verbose=not args.quiet)
    if args.global_batch is not None and (args.objective != "throughput" or args.hf_trainer
                                          or args.lengths is not None):
        raise UsageError("--global-batch needs --objective throughput, with the model flags "
                         "(not with --hf-trainer or --lengths)")
    if not args.quiet and args.lengths is None:   # which question is answered, and how to ask the others
        print(objective_line("search", args.objective), file=sys.stderr)
    if args.lengths is not None:   # a plan per length bucket (its objective said once its inputs are read)
        from dptune.cli import lengths_command as lengths_cli

        return lengths_cli.run(args, None if args.hf_trainer else workload_spec(args))

    # With --json, anything the tuner prints goes to stderr: stdout holds only the JSON.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect, _naming_nccl_bytes(args.nccl_bytes):
        if args.hf_trainer:
            result = search_trainer(
                args.hf_trainer, ignored=model_only_flags(args), batch_size=args.batch_size,
                devices=args.devices, simulate=args.simulate,
                objective=args.objective.replace("-", "_"), budget=budget, search_settings=look)
        else:
            result = search(
                workload_spec(args), batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
                devices=args.devices, simulate=args.simulate,
                objective=args.objective.replace("-", "_"), budget=budget, search_settings=look,
                isolate=args.isolate, output_device=args.output_device,
                global_batch=args.global_batch)
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
