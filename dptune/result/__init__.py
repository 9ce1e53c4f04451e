"""The result of a search: the model (:mod:`~dptune.result.model`), its checked reader
(:mod:`~dptune.result.read`), its figures (:mod:`~dptune.result.figures`) and wrapping a
model from it (:mod:`~dptune.result.wrap`). :class:`TuneResult` and :func:`load_result` are
imported here on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TuneResult", "load_result"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("dptune.result.model"), name)
    globals()[name] = value
    return value
