"""Import an object named by a ``"module:attribute"`` string, as the command line does.

``import_from_string("mymodels:Net")`` imports ``mymodels`` and returns its ``Net``. The
attribute may be dotted (``"pkg.mod:Outer.make"``). Errors a user can cause by typing the
string wrong raise :class:`dptune.errors.ImportStringError` (a usage error, exit 2), with a
message that names the string and says what to type. An error raised *inside* the user's
module while it imports (including an ``ImportError`` for some other module it needs) is
let through unchanged, so the user sees their own bug and its traceback.

The working directory is searched first, as ``python -m`` does: when it is not on
``sys.path`` it is put at the front, and left there so that imports the user's module makes
later (inside functions) still resolve. So ``models.py`` in the working directory wins over
an installed package of that name, as it would with ``python -m``.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import Any

from dptune.errors import ImportStringError

__all__ = ["import_from_string"]

_SHOWN_NAMES = 12


def import_from_string(import_str: str) -> Any:
    """Return the object that ``"module:attribute"`` names.

    Raises :class:`ImportStringError` when the string is malformed, the module does not
    exist or the attribute is missing. Any other exception raised while the module
    imports is the user's own and is re-raised unchanged.
    """
    module_name, attr_path = _split(import_str)
    _add_cwd_to_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Only "the module you named (or a package above it) does not exist" is a usage
        # error; a module that *imports* something missing is the user's bug: re-raise it.
        if exc.name is None or not _is_self_or_parent(exc.name, module_name):
            raise
        raise ImportStringError(
            f"cannot import {import_str!r}: no module named {exc.name!r} "
            f"(looked in the working directory {os.getcwd()!r} and the installed packages)"
        ) from None

    obj: Any = module
    walked = module_name
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ImportStringError(
                f"cannot import {import_str!r}: {walked!r} has no attribute {part!r}"
                f"{_what_it_has(obj, part)}") from None
        walked = f"{walked}:{part}" if walked == module_name else f"{walked}.{part}"
    return obj


def _split(import_str: Any) -> tuple[str, str]:
    hint = f'expected "module:attribute", e.g. "mymodels:Net", got {import_str!r}'
    if not isinstance(import_str, str):
        raise ImportStringError(hint)
    module_name, sep, attr_path = import_str.strip().partition(":")
    if not sep or not _dotted(module_name) or not _dotted(attr_path):
        raise ImportStringError(hint)
    return module_name, attr_path


def _dotted(name: str) -> bool:
    """``a.b.c`` of Python identifiers (any a Python file may use, unicode included)."""
    return all(part.isidentifier() for part in name.split("."))


def _is_self_or_parent(missing: str, module_name: str) -> bool:
    return module_name == missing or module_name.startswith(missing + ".")


def _add_cwd_to_path() -> None:
    cwd = os.getcwd()
    known = {os.path.abspath(p or os.curdir) for p in sys.path}
    if cwd not in known:
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()


def _what_it_has(obj: Any, wanted: str) -> str:
    names = sorted(n for n in dir(obj) if not n.startswith("_"))
    if not names:
        return " (it has no public names)"
    close = difflib.get_close_matches(wanted, names, n=3)
    shown = ", ".join(names[:_SHOWN_NAMES]) + (", ..." if len(names) > _SHOWN_NAMES else "")
    did_you_mean = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return f"{did_you_mean} (it has: {shown})"
