"""The ``dptune`` program: the parser of every subcommand and :func:`main`, which maps each
failure to its one line and exit code (see :mod:`dptune.cli`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import NoReturn, Optional, Sequence

from dptune.cli.arguments import EPILOG, EXIT_INTERRUPTED
from dptune.cli.failures import format_user_traceback, one_line_warnings
from dptune.cli.plan_command import plan_parser
from dptune.cli.report_commands import devices_parser, plot_parser, show_parser
from dptune.cli.search_command import search_parser
from dptune.errors import EXIT_INTERNAL, EXIT_USAGE, EXIT_USER_CODE, DptuneError, UserCodeError

#: 128 + SIGPIPE, as a shell reports a program whose reader closed the pipe (``dptune show | head``)
EXIT_BROKEN_PIPE = 141

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
    except BrokenPipeError:     # the reader went away (| head): stop quietly, as a shell tool does
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as e:  # not diagnosed: show everything, and say whose code failed
        traceback.print_exc()
        if _ends_in_dptune(e):
            _error(f"unexpected {type(e).__name__} in dptune's own code: {e}; this is a bug in "
                   "dptune, not in your code: please report it with the traceback above")
            return EXIT_INTERNAL
        _error(f"unexpected {type(e).__name__}: {e}; see the traceback above")
        return EXIT_USER_CODE


def _ends_in_dptune(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback that belongs to dptune or to code it
    runs for the user is dptune's. Frames of the standard library and of torch (which both
    call) are skipped; any other code, installed packages included (a transformers model),
    counts as the user's."""
    import sysconfig

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"])
    last = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(package + os.sep):
            last = "dptune"
            continue
        parts = path.split(os.sep)
        top = parts[parts.index("site-packages") + 1] if "site-packages" in parts[:-1] else None
        if (path.startswith(stdlib + os.sep) and top is None) or top in _SHARED_PACKAGES:
            continue
        last = "user"
    return last == "dptune"


#: packages both dptune and the user's code call: a failure inside them is blamed on the caller
_SHARED_PACKAGES = frozenset({"torch", "numpy", "functorch", "typing_extensions"})


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
