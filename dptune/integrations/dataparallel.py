"""``patch_dataparallel``: make scripts that build ``torch.nn.DataParallel`` themselves balanced.

- :func:`patch_dataparallel`: Under this context, ``torch.nn.DataParallel(...)`` builds a ``BalancedDataParallel``.
- :func:`chunk_sizes_of`: The split in ``tuned``: a :class:`~dptune.TuneResult` (or anything with ``chunk_sizes``), a report folder or ``report.json`` written by ``dptune ...

Design notes: docs/concepts/design-notes.md, "dptune/integrations/dataparallel.py".
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence, Union

from dptune.errors import UsageError
from dptune.split import validate_chunk_sizes

__all__ = ["patch_dataparallel", "chunk_sizes_of"]

#: The name patched, in ``torch.nn`` and ``torch.nn.parallel``.
_NAME = "DataParallel"

#: What a tuned split may be given as.
Tuned = Union["os.PathLike[str]", str, Sequence[int], Any]


def chunk_sizes_of(tuned: Tuned) -> list[int]:
    """The split in ``tuned``: a :class:`~dptune.TuneResult` (or anything with ``chunk_sizes``),
    a report folder or ``report.json`` written by ``dptune search``, or a list of ints."""
    sizes: Any
    if isinstance(tuned, (str, os.PathLike)):
        from dptune.result.model import TuneResult

        sizes = TuneResult.load(os.fspath(tuned)).chunk_sizes  # UsageError names what is wrong
    else:
        sizes = getattr(tuned, "chunk_sizes", tuned)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise UsageError(f"expected a TuneResult, a report folder or a list of chunk sizes, got "
                         f"{type(tuned).__name__}")
    try:
        return validate_chunk_sizes(sizes)
    except ValueError as e:
        raise UsageError(str(e)) from None


class _PatchedMeta(type):
    """Metaclass of the stand-in class: calling the stand-in builds a ``BalancedDataParallel``,
    and ``isinstance``/``issubclass`` against it answer as the original DataParallel would."""

    _dptune_original: type
    _dptune_chunk_sizes: list[int]
    _dptune_plan: Any

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_dptune_original" not in cls.__dict__:  # a user's subclass of the stand-in
            return super().__call__(*args, **kwargs)
        from dptune.parallel import BalancedDataParallel

        if "chunk_sizes" in kwargs or "gpu0_bsz" in kwargs:
            raise UsageError("torch.nn.DataParallel takes no chunk_sizes or gpu0_bsz; under "
                             "dptune.patch_dataparallel the split comes from the tuned result")
        if cls._dptune_plan is not None:
            return BalancedDataParallel(*args, plan=cls._dptune_plan, **kwargs)
        return BalancedDataParallel(*args, chunk_sizes=list(cls._dptune_chunk_sizes), **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        if "_dptune_original" in cls.__dict__:
            return isinstance(obj, cls._dptune_original)
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        if "_dptune_original" in cls.__dict__:
            return issubclass(sub, cls._dptune_original)
        return super().__subclasscheck__(sub)

    def __repr__(cls) -> str:
        if "_dptune_original" in cls.__dict__:
            return (f"<torch.nn.DataParallel patched by dptune: BalancedDataParallel with "
                    f"{_what(cls._dptune_chunk_sizes, cls._dptune_plan)}>")
        return super().__repr__()


def _what(sizes: list[int], plan: Any) -> str:
    if plan is not None:
        return f"a length plan for lengths <= {plan.edges}"
    return f"chunk_sizes={sizes}"


def _stand_in(original: type, sizes: list[int], plan: Any = None) -> type:
    return _PatchedMeta(original.__name__, (original,), {
        "_dptune_original": original,
        "_dptune_chunk_sizes": list(sizes),
        "_dptune_plan": plan,
        "__module__": original.__module__,
        "__qualname__": original.__qualname__,
        "__doc__": (f"torch.nn.DataParallel, patched by dptune.patch_dataparallel: builds a "
                    f"BalancedDataParallel with {_what(sizes, plan)}.\n\n"
                    f"{original.__doc__ or ''}"),
    })


@contextlib.contextmanager
def patch_dataparallel(tuned: Tuned) -> Iterator[list[int]]:
    """Under this context, ``torch.nn.DataParallel(...)`` builds a ``BalancedDataParallel``.

    ``tuned`` is a :class:`~dptune.TuneResult`, a report folder written by ``dptune search``, a
    list of chunk sizes (one non-negative int per device), or a
    :class:`dptune.lengths.LengthPlan` (each batch split as its length bucket's plan says). The wrapper gets that split and the
    call's own arguments (``device_ids``, ``output_device``, ``dim``); when ``device_ids`` names
    another number of devices than the split has entries, building it raises a
    :class:`~dptune.UsageError` that says so. The block's value is the split (empty for a plan).

    The original class is restored on exit, also after an exception; blocks nest (the innermost
    split applies). Its example and known limitations: docs/concepts/design-notes.md.
    """
    import torch.nn
    import torch.nn.parallel

    import dptune.parallel  # noqa: F401  (BalancedDataParallel subclasses the real class)

    from dptune.lengths.plan import LengthPlan

    plan = tuned if isinstance(tuned, LengthPlan) else None
    sizes = [] if plan is not None else chunk_sizes_of(tuned)
    homes = (torch.nn, torch.nn.parallel)
    saved = [(home, home.__dict__[_NAME]) for home in homes]
    current = torch.nn.DataParallel
    original = current.__dict__.get("_dptune_original", current)
    stand_in = _stand_in(original, sizes, plan)
    try:
        for home, _ in saved:
            setattr(home, _NAME, stand_in)
        yield list(sizes)
    finally:
        for home, previous in saved:
            setattr(home, _NAME, previous)
