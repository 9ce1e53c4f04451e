"""The result of a search: the model (:mod:`~dptune.result.model`), its checked reader
(:mod:`~dptune.result.read`), its figures (:mod:`~dptune.result.figures`) and wrapping a
model from it (:mod:`~dptune.result.wrap`). :class:`TuneResult` and :func:`load_result` are
imported here on first use.
"""

from __future__ import annotations

from dptune._lazy import lazy_names

__all__ = ["TuneResult", "load_result"]


__getattr__, __dir__ = lazy_names(__name__, {n: "dptune.result.model" for n in __all__}, globals(), __all__)
