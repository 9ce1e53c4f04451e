"""The ``dptune`` program: the parser of every subcommand and :func:`main`, which maps each
failure to its one line and exit code (see :mod:`dptune.cli`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import NoReturn, Optional, Sequence

from dptune.cli.arguments import EPILOG, EXIT_INTERRUPTED
from dptune.cli.failures import format_user_traceback, one_line_warnings
from dptune.cli.plan_command import plan_parser
from dptune.cli.report_commands import devices_parser, plot_parser, show_parser
from dptune.cli.search_command import search_parser
from dptune.errors import EXIT_USAGE, EXIT_USER_CODE, DptuneError, UserCodeError

__all__ = ["main", "build_parser", "argv_command"]


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
        with one_line_warnings():
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
