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
    5    dptune's own failure (a bug in dptune, never blamed on the user's code)
    130  interrupted (Ctrl-C)
    141  the reader of the output went away (``dptune show DIR | head``): a quiet stop

Errors dptune diagnoses are one line on stderr, ``dptune: error: <message>``, with no
traceback; so are argparse's own (with the command's ``--help`` to read instead of the usage
block). Inputs out of any sensible range are checked before any work (:mod:`dptune.cli.checks`).
Each subcommand is registered by a ``*_parser(subparsers)`` function; the work is done by plain
functions that take and return values (:func:`search`, :func:`ddp_plan`), and printing is
kept apart from them. One module per concern:

- :mod:`dptune.cli.app`: the parser and :func:`main` (each failure's line and exit code);
- :mod:`dptune.cli.arguments`: the flags ``search`` and ``plan`` share, and the workload spec;
- :mod:`dptune.cli.search_command`, :mod:`dptune.cli.plan_command`,
  :mod:`dptune.cli.report_commands` (``show``, ``plot``, ``devices``): the subcommands;
- :mod:`dptune.cli.failures`: the user's traceback without dptune's frames, one-line warnings.
"""

from dptune.cli.app import argv_command, build_parser, main
from dptune.cli.arguments import (DEFAULT_BATCH_SIZE, EPILOG, EXIT_INTERRUPTED, parse_model_kwargs,
                                  parse_shape, step_arguments, workload_arguments, workload_spec)
from dptune.cli.failures import format_user_traceback
from dptune.cli.plan_command import ddp_plan
from dptune.cli.search_command import default_report_dir, search, search_trainer
from dptune.step.presets import (LOSSES, OPTIMIZERS, adam, adamw, cross_entropy_loss, mean_loss, mse_loss,
                            sgd, sum_loss)
from dptune.step.spec import DTYPES, WorkloadSpec

__all__ = ["main", "build_parser", "search", "search_trainer", "ddp_plan", "workload_spec",
           "WorkloadSpec", "DTYPES",
           # the built-ins, from dptune.step.presets
           "LOSSES", "OPTIMIZERS", "sum_loss", "mean_loss", "cross_entropy_loss", "mse_loss",
           "sgd", "adam", "adamw",
           # the parts of the subcommands
           "argv_command", "DEFAULT_BATCH_SIZE", "EPILOG", "EXIT_INTERRUPTED", "parse_model_kwargs",
           "parse_shape", "step_arguments", "workload_arguments", "format_user_traceback",
           "default_report_dir"]
