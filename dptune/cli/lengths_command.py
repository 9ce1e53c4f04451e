"""``dptune search ... --lengths FILE --buckets 8|128,256,...``: a plan per length bucket.

The flags are added to ``search`` by :func:`length_arguments`; :func:`run` does the work
when ``--lengths`` is given. With ``--hf-trainer`` (``--lengths`` without a file) the plan is
the Trainer's (:func:`dptune.integrations.trainer_lengths.plan_trainer_lengths`: its train
dataset's lengths, its examples resized to each bucket's length through its collator, its
model, optimizer and step settings). Otherwise the batch is the one ``search`` would build, at
each bucket's length: ``--input-shape`` with the entry at ``--length-axis`` replaced by the length (that
entry is the longest length the model takes), or ``--sample MODULE:FUNC`` called as
``fn(batch_size, length=L)`` (a model's ``.method`` the same way).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import pathlib
import re
import sys
from typing import Any, Callable, Optional

from dptune.errors import EXIT_OK, UsageError
from dptune.types import Objective

__all__ = ["length_arguments", "run", "length_sample"]

#: ``--lengths`` given without a file: the lengths of ``--hf-trainer``'s train dataset.
FROM_TRAINER = ""
#: ``--max-probes`` when not given, per bucket (a given one is kept, even below it)
DEFAULT_BUCKET_PROBES = 16


def bucket_arguments(g: Any) -> None:
    """The buckets, the length's axis and the padding (``dptune search`` and ``dptune plan``)."""
    g.add_argument("--buckets", default="8", metavar="K|E1,E2,...",
                   help="with --lengths: K quantile buckets (default 8) or the edges, e.g. "
                        "128,256,512,1024 (the last edge is always the longest length)")
    g.add_argument("--length-axis", type=int, default=1, metavar="D",
                   help="the batch's length dimension (default 1: token ids (batch, length))")
    g.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="M",
                   help="lengths are padded to a multiple of M, as the collator pads them")


def length_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("variable lengths (a batch per length bucket)")
    g.add_argument("--lengths", metavar="FILE[:COLUMN]", default=None, nargs="?",
                   const=FROM_TRAINER,
                   help="the training samples' lengths: one integer per line, or a column of a "
                        "CSV/Parquet file; plans the largest batch of every length bucket. With "
                        "--hf-trainer give no FILE: the train dataset's lengths")
    bucket_arguments(g)
    g.add_argument("--ddp", action="store_true",
                   help="with --lengths and --simulate: each card a DDP rank with its own batch "
                        "per bucket (nothing gathered)")


def length_sample(sample: Any, axis: int) -> tuple[Callable[[int, int], Any], Optional[int]]:
    """``sample(batch_size, length)`` from the workload's batch builder, and the longest
    length the model takes when the batch is given by its shape."""
    from dptune.step.spec import RandomBatch

    if isinstance(sample, RandomBatch):
        shape = list(sample.shape)
        if not 1 <= axis <= len(shape):
            raise UsageError(f"--length-axis {axis}: --input-shape {sample.shape} has axes "
                             f"1..{len(shape)} after the batch")

        def from_shape(n: int, length: int) -> Any:
            s = list(shape)
            s[axis - 1] = length
            return dataclasses.replace(sample, shape=tuple(s))(n)
        return from_shape, shape[axis - 1]
    kwargs = getattr(sample, "kwargs", None)
    if not isinstance(kwargs, dict):
        raise UsageError("--lengths needs a batch that takes the length: --input-shape, or "
                         "--sample MODULE:FUNC taking (batch_size, length=...)")

    def with_length(n: int, length: int) -> Any:
        s = copy.copy(sample)
        s.kwargs = {**kwargs, "length": length}
        try:
            return s(n)
        except Exception as e:
            cause = e if isinstance(e, TypeError) else e.__cause__
            if isinstance(cause, TypeError) and "unexpected keyword argument 'length'" in str(cause):
                raise UsageError("--lengths needs a batch that takes the length, and this sample "
                                 "function takes no length= argument: give it one "
                                 "(sample(batch_size, length=...)), or use --input-shape with "
                                 "--length-axis") from None
            raise
    return with_length, None


def _read(spec: str) -> list[int]:
    from dptune.lengths.buckets import read_lengths

    path, column = spec, None
    m = re.match(r"^(.*\.(?:csv|parquet|pq)):([^:/\\]+)$", spec, re.IGNORECASE)
    if m:
        path, column = m.group(1), m.group(2)
    return read_lengths(path, column)


def _check_flags(args: argparse.Namespace) -> Any:
    """One line for each flag that does not apply; the headroom to plan with."""
    if args.objective not in tuple(o.flag for o in Objective):
        raise UsageError(f"--lengths plans the largest batch of every bucket; --objective "
                         f"{args.objective} does not apply to it")
    if args.output_device not in (0, "0"):
        raise UsageError("--lengths gathers the outputs on card 0; drop --output-device")
    if args.pad_to_multiple_of is not None and args.pad_to_multiple_of < 1:
        raise UsageError(f"--pad-to-multiple-of must be >= 1, got {args.pad_to_multiple_of}")
    if args.hf_trainer is None and args.lengths == FROM_TRAINER:
        raise UsageError("--lengths needs a FILE (one integer per line, or FILE.csv:COLUMN); "
                         "only with --hf-trainer are the lengths read from the train dataset")
    if args.hf_trainer is not None and args.lengths != FROM_TRAINER:
        raise UsageError("with --hf-trainer the lengths are the Trainer's train dataset's: give "
                         "--lengths without a FILE")
    return args.headroom      # None: the budget level's default, as for search


def _say_objective(args: argparse.Namespace) -> None:
    """Which question a length plan answers, and how to ask the others (stderr)."""
    if not args.quiet:
        from dptune.cli.objectives import objective_line

        command = getattr(args, "objective_of", "search")     # plan --lengths: "plan"
        print(objective_line(command, args.objective, lengths=True), file=sys.stderr)


def run(args: argparse.Namespace, spec: Any) -> int:
    """``dptune search --lengths``: plan, print one line per bucket, write the report
    (``spec``: the :class:`dptune.step.spec.WorkloadSpec` the CLI made of the flags; ``None`` with
    ``--hf-trainer``)."""
    from dptune.lengths.search import plan_lengths

    headroom = _check_flags(args)
    if args.hf_trainer is not None:
        _say_objective(args)
        return _run_trainer(args, headroom)
    lengths = _read(args.lengths)
    _say_objective(args)      # after the inputs are read: a bad input stays one line
    wl = spec.build()
    sample, longest = length_sample(wl.sample, args.length_axis)
    plan = plan_lengths(wl.model, sample, lengths, args.buckets, loss_fn=wl.loss_fn,
                        optimizer=wl.optimizer, simulate=args.simulate, device_ids=args.devices,
                        headroom=headroom, pad_to_multiple_of=args.pad_to_multiple_of,
                        length_axis=args.length_axis, max_length=longest,
                        batch_size=args.batch_size or 256,
                        max_probes=args.max_probes or DEFAULT_BUCKET_PROBES,
                        amp=wl.amp, accumulate=wl.accumulate, clip_grad_norm=wl.clip_grad_norm,
                        step=wl.step, ddp=args.ddp, verbose=not args.quiet, **_options(args))
    return _report(args, plan, lengths)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The objective and the budget level's flags, as for search (each bucket's probe replayed
    through the allocator model at the reserved level)."""
    levels = {k: getattr(args, k) for k in ("budget_level", "allocator", "nccl_bytes")
              if getattr(args, k, None) is not None}
    goal = Objective.THROUGHPUT if args.objective == Objective.THROUGHPUT.flag else Objective.MAX_BATCH
    return {"objective": goal.value, **levels}


def _run_trainer(args: argparse.Namespace, headroom: Any) -> int:
    """``--hf-trainer MODULE:FUNC --lengths``: the Trainer's own plan per bucket."""
    from dptune.cli.arguments import load_trainer, model_only_flags

    ignored = model_only_flags(args) + (
        ["--length-axis"] if args.length_axis != 1 else [])
    if ignored:
        raise UsageError(f"--hf-trainer takes the model, batch, loss, optimizer and step "
                         f"settings from the Trainer and its TrainingArguments; drop "
                         f"{', '.join(ignored)}")
    trainer = load_trainer(args.hf_trainer)
    from dptune.integrations.trainer_lengths import all_lengths, plan_trainer_lengths

    _, lengths = all_lengths(trainer)
    options: dict[str, Any] = {}
    if args.pad_to_multiple_of is not None:   # else the collator's
        options["pad_to_multiple_of"] = args.pad_to_multiple_of
    plan = plan_trainer_lengths(trainer, args.buckets, simulate=args.simulate,
                                device_ids=args.devices, headroom=headroom, lengths=lengths,
                                batch_size=args.batch_size or 256,
                                max_probes=args.max_probes or DEFAULT_BUCKET_PROBES, ddp=args.ddp,
                                verbose=not args.quiet, **options, **_options(args))
    return _report(args, plan, lengths, trainer=args.hf_trainer)


def _report(args: argparse.Namespace, plan: Any, lengths: list[int], trainer: str = "") -> int:
    from dptune.lengths.budget import token_budgets
    from dptune.lengths.render import render_text, write_plan_report

    out = sys.stderr if args.json else sys.stdout
    folder = pathlib.Path(args.out) if args.out else _default_dir(plan.model_name, plan.cluster)
    write_plan_report(plan, str(folder), lengths, plots=not args.no_plots)
    if args.json:
        print(json.dumps({**plan.to_dict(), "token_budget": token_budgets(plan).to_dict()},
                         indent=2))
    elif not args.quiet:
        print(render_text(plan))
    print(f"report written to {folder}/", file=out)
    if trainer and not args.quiet and not plan.ddp:
        module, _, func = trainer.partition(":")
        print(f"train with it: from {module} import {func}; from dptune.integrations."
              f"trainer_lengths import with_length_plan; "
              f"with_length_plan({func}(), {str(folder)!r}).train()", file=out)
    return EXIT_OK


def _default_dir(model: str, cluster: str) -> pathlib.Path:
    from dptune.report.files import default_folder

    return default_folder(model, cluster, suffix="-lengths")
