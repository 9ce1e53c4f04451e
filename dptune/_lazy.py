"""Lazy public names for a package ``__init__`` (PEP 562): each name imported from its home
module on first use, so that importing the package imports nothing heavy.

    __getattr__, __dir__ = lazy_names(__name__, {"Tuner": "dptune.tuner"}, globals(), __all__)
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, MutableMapping, Sequence

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str], namespace: MutableMapping[str, Any],
               public: Sequence[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name of ``homes`` is imported from
    its module once and kept in ``namespace`` (the package's ``globals()``); any other name
    raises ``AttributeError`` as a module does. ``__dir__`` lists the public names (what
    ``__all__`` promises, loaded or not)."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__
