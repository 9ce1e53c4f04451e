"""How the command line shows what went wrong: the user's traceback without dptune's own
frames, and dptune's warnings as one line each.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import traceback
from typing import Any, Iterator, Optional

__all__ = ["format_user_traceback", "one_line_warnings"]

# Frames left out of the traceback of the user's error: dptune's own, and the import machinery.
_HIDDEN_FRAMES = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                  os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep,
                  "<frozen importlib")


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
def one_line_warnings() -> Iterator[None]:
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
