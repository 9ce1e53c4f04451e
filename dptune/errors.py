"""dptune's exceptions and the command line's exit codes.

Every error a user can cause is one of these, with a message that says what is wrong
and what to do. The tree::

    DptuneError                      exit 1
    ├── UsageError (ValueError)      exit 2  bad argument, bad cluster spec, bad import string
    │   ├── SpecError                        a cluster spec that does not parse
    │   ├── ImportStringError                "module:attr" that is malformed or names nothing
    │   ├── ReportError                      a report folder or report.json that is missing or invalid
    │   └── OutputError                      a report or plot folder that cannot be written
    ├── NoFeasibleSplitError         exit 3  no split of the batch was found within every card's budget
    │                                        (proven not to fit, or the probes ran out: the
    │                                        message says which)
    ├── BackendUnavailableError      exit 4  GPUs asked for are missing, NVML/CUDA unusable
    ├── UserCodeError (RuntimeError) exit 1  the user's model, loss or optimizer raised;
    │                                        chained (``raise ... from``) to their exception
    └── InternalError (RuntimeError) exit 5  dptune's own machinery failed (a bug in dptune,
                                             never blamed on the user's code), naming the part

Out-of-memory during a probe is not an error: the probe records which card ran out.
Things dptune did on the user's behalf that they should know about (e.g. unwrapping a model
given inside a ``DataParallel``) are a :class:`DptuneWarning`, one line each; the command line
prints them as ``dptune: <message>``.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_USER_CODE = 1
EXIT_USAGE = 2
EXIT_NO_FIT = 3
EXIT_BACKEND = 4
EXIT_INTERNAL = 5

__all__ = [
    "EXIT_OK", "EXIT_USER_CODE", "EXIT_USAGE", "EXIT_NO_FIT", "EXIT_BACKEND", "EXIT_INTERNAL",
    "DptuneError", "UsageError", "SpecError", "ImportStringError", "ReportError", "OutputError",
    "NoFeasibleSplitError", "BackendUnavailableError", "UserCodeError", "InternalError",
    "DptuneWarning",
]


class DptuneError(Exception):
    """Base class of every dptune error. Raised as itself only where no more specific class
    is known (an error rebuilt from another process): dptune's own failure, exit code 5,
    never blamed on the user's code."""

    exit_code: int = EXIT_INTERNAL


class UsageError(DptuneError, ValueError):
    """An argument is malformed or inconsistent."""

    exit_code = EXIT_USAGE


class SpecError(UsageError):
    """A simulated-cluster spec that does not parse."""


class ImportStringError(UsageError):
    """An import string such as ``mymod:Net`` that is malformed or names nothing."""


class ReportError(UsageError):
    """A report (folder or ``report.json``) that is missing, unreadable or inconsistent."""


class OutputError(UsageError):
    """A folder a report or plot is to be written to that cannot be (a file, read-only, ...)."""


class NoFeasibleSplitError(DptuneError, RuntimeError):
    """No split of the batch was found within every card's budget: proven not to fit (the
    probes bound every card below the batch), or the probes ran out before one fitted; the
    message says which, and never claims "no split fits" where the probes do not prove it.

    ``shortfall_bytes`` is how much memory is missing on the tightest card for the best
    split found (``None`` when unknown).
    """

    exit_code = EXIT_NO_FIT

    def __init__(self, message: str, shortfall_bytes: int | None = None):
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes


class BackendUnavailableError(DptuneError, RuntimeError):
    """The requested backend cannot run here (e.g. GPUs asked for are not visible)."""

    exit_code = EXIT_BACKEND


class UserCodeError(DptuneError, RuntimeError):
    """The user's model, batch builder, loss or optimizer raised during a probe.

    The original exception is the ``__cause__``; the message says where (card, split).
    """

    exit_code = EXIT_USER_CODE


class InternalError(DptuneError, RuntimeError):
    """dptune's own code failed (a simulator hook, the ledger...): a bug to report.

    The message names the part of dptune and the construct that was running; the original
    exception is the ``__cause__``. Exit code 5: never the user's code's 1.
    """

    exit_code = EXIT_INTERNAL


class DptuneWarning(UserWarning):
    """Something dptune did for the user that they should know about (one line)."""
