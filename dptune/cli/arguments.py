"""The flags ``search`` and ``plan`` share (the model and batch, the training step, the
headroom and the objective), and how they become a :class:`~dptune.step.spec.WorkloadSpec`; the
exit codes' epilog every command's ``--help`` ends with. The other argument types and checks
are in :mod:`dptune.cli.checks`.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

from dptune.cli.checks import accumulate_arg, batch_size_arg, headroom_arg, positive_float, positive_int
from dptune.errors import (EXIT_BACKEND, EXIT_INTERNAL, EXIT_NO_FIT, EXIT_OK, EXIT_USAGE, EXIT_USER_CODE,
                           UsageError)
from dptune.step.spec import DTYPES, WorkloadSpec, import_users, users_code

__all__ = ["EPILOG", "EXIT_INTERRUPTED", "DEFAULT_BATCH_SIZE", "parse_model_kwargs", "parse_shape",
           "workload_spec", "workload_arguments", "step_arguments", "headroom_argument",
           "objective_argument", "load_trainer", "model_only_flags"]

EXIT_INTERRUPTED = 130

EPILOG = f"""\
exit codes:
  {EXIT_OK}    success
  {EXIT_USER_CODE}    an error in your model, batch, loss or optimizer (its traceback is shown)
  {EXIT_USAGE}    usage: bad flags, cluster spec, import string, JSON or report folder
  {EXIT_NO_FIT}    no split of the batch within every card's budget (none fits, or the
       probes ran out before one did: the message says which)
  {EXIT_BACKEND}    backend unavailable (e.g. --devices with no visible GPU)
  {EXIT_INTERNAL}    dptune's own failure (a bug in dptune: please report it)
  141  the reader of the output went away (dptune show DIR | head)
  {EXIT_INTERRUPTED}  interrupted
"""


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
    """The :class:`~dptune.step.spec.WorkloadSpec` the flags of ``search`` and ``plan`` describe."""
    return WorkloadSpec(
        model=args.model, model_kwargs=parse_model_kwargs(args.model_kwargs), sample=args.sample,
        input_shape=args.input_shape, dtype=args.dtype, vocab_size=args.vocab_size,
        loss=args.loss, optimizer=args.optimizer, amp=args.amp, accumulate=args.accumulate,
        clip_grad_norm=args.clip_grad_norm, step=args.step)


# ---- argument types (the others are in dptune.cli.checks) ---------------------------------

def _shape(text: str) -> tuple[int, ...]:
    try:
        return parse_shape(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).replace("--input-shape ", "", 1)) from None


# ---- the shared flags ----------------------------------------------------------------------

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


def headroom_argument(group: Any) -> None:
    group.add_argument("--headroom", type=headroom_arg, default=None, metavar="SIZE",
                       help="memory kept free on every card, e.g. 512MiB (default 256MiB at "
                            "--budget-level reserved, the default; 1GiB at allocated)")


def objective_argument(group: Any, help: str) -> None:
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


def model_only_flags(args: argparse.Namespace) -> list[str]:
    """Flags given that describe a model and its batch (meaningless with --hf-trainer)."""
    given = [("--model-kwargs", args.model_kwargs is not None), ("--sample", args.sample is not None),
             ("--input-shape", args.input_shape is not None), ("--dtype", args.dtype is not None),
             ("--vocab-size", args.vocab_size is not None), ("--loss", args.loss != "default"),
             ("--optimizer", args.optimizer != "adamw"), ("--isolate", args.isolate),
             ("--amp", args.amp is not None), ("--accumulate", args.accumulate != 1),
             ("--clip-grad-norm", args.clip_grad_norm is not None), ("--step", args.step is not None),
             ("--output-device", args.output_device != 0)]
    return [flag for flag, on in given if on]
