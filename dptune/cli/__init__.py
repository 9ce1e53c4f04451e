"""dptune's command line: a thin layer over :class:`dptune.Tuner` (parse, build, call, show, write).

Design notes: docs/concepts/design-notes.md, "dptune/cli/__init__.py".
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
