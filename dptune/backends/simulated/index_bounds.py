"""Embedding indices beyond the table, raised on the simulated cards as a real card raises them.

The simulator computes no values, so an embedding lookup with an index past its table (a token
id from a larger vocabulary, a position past ``max_position_embeddings``) would run on. A CUDA
card stops at a device-side assert (``srcIndex < srcSelectDimSize``), the CPU at ``IndexError:
index out of range in self``. This module follows the bounds of integer tensors where they are
known without values and raises that error at ``aten.embedding`` / ``aten.index_select`` when
an index can reach past the table:

- made with known bounds: ``arange`` (exact), ``randint`` (``low`` .. ``high - 1``), ``full``,
  ``zeros``, ``ones`` and their ``_like`` forms (a constant), a real (non-fake) tensor or a fake
  one made from one (``torch.tensor(data)``: its values are there to read);
- carried through the ops that keep the values: views, copies and dtype casts, ``cat`` (the
  union), adding or subtracting a number (a shift) or another bounded tensor.

Anything else (a clamp, a modulo, indexing) gives no bound, and no check: this never raises
for indices that could be in range. ``randint``'s bound is the largest id it can draw, which a
batch of a few hundred ids almost surely reaches.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dptune._torch_private import is_fake, no_dispatch_modes

__all__ = ["IndexOutOfRangeError", "IndexBounds"]


class IndexOutOfRangeError(IndexError):
    """What a card raises for an index past a table (the user's error)."""


Bound = tuple[int, int]            # the smallest and the largest value an integer tensor holds

_FROM_FIRST = frozenset({
    "clone", "_to_copy", "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand",
    "slice", "select", "t", "transpose", "permute", "alias", "detach", "contiguous", "narrow",
    "lift_fresh_copy", "lift_fresh", "repeat", "flatten", "unflatten", "expand_as", "view_as",
    "_reshape_alias", "as_strided", "unbind", "split", "split_with_sizes", "chunk",
})
_CONSTANT = {"zeros": 0, "ones": 1, "zeros_like": 0, "ones_like": 1}
_TRACKED = _FROM_FIRST | set(_CONSTANT) | {"arange", "randint", "full", "full_like", "cat",
                                           "add", "sub", "rsub"}
_CHECKED = frozenset({"embedding", "index_select"})


@functools.lru_cache(maxsize=None)
def kind(func: Any) -> int:
    """0: not an op of this module; 1: its output's bound is followed; 2: its indices are
    checked (``aten.embedding``, ``aten.index_select``)."""
    packet = getattr(func, "__name__", str(func)).split(".")[0]
    return 2 if packet in _CHECKED else 1 if packet in _TRACKED else 0


def _int(x: Any) -> Optional[int]:
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        return x
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return None                     # a SymInt, a tensor, a non-integral number


def _integral(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.dtype.is_floating_point and not t.dtype.is_complex


class IndexBounds:
    """The known bounds of integer tensors (module docstring), by tensor."""

    def __init__(self) -> None:
        self._bounds: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def of(self, t: Any) -> Optional[Bound]:
        if not _integral(t):
            return None
        found = self._bounds.get(t)
        if found is not None:
            return found
        values = t if not is_fake(t) else getattr(t, "constant", None)
        if isinstance(values, torch.Tensor) and values.numel() and not is_fake(values):
            with no_dispatch_modes():         # a real tensor: its values are there to read
                return int(values.min()), int(values.max())
        return None

    def after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Record the bound of ``func``'s integer outputs where it follows from its inputs."""
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if _integral(o)]
        if not outs:
            return
        bound = self._bound(getattr(func, "__name__", str(func)).split(".")[0], args, kwargs or {})
        if bound is not None:
            for o in outs:
                self._bounds[o] = bound

    def _bound(self, op: str, args: Any, kwargs: dict) -> Optional[Bound]:
        if op in _FROM_FIRST:
            return self.of(args[0]) if args else None
        if op in _CONSTANT:
            return _CONSTANT[op], _CONSTANT[op]
        if op in ("full", "full_like"):
            v = _int(args[1]) if len(args) > 1 else _int(kwargs.get("fill_value"))
            return None if v is None else (v, v)
        if op == "arange":
            return _arange(args, kwargs)
        if op == "randint":
            nums = [_int(a) for a in args if not isinstance(a, (list, tuple))]
            if len(nums) == 1 and nums[0] is not None:         # randint(high, size)
                return 0, nums[0] - 1
            if len(nums) >= 2 and None not in nums[:2]:          # randint(low, high, size)
                lo, hi = nums[0], nums[1]
                assert lo is not None and hi is not None
                return lo, hi - 1
            return None
        if op == "cat":
            parts = [self.of(t) for t in args[0] if isinstance(t, torch.Tensor) and t.numel()]
            if not parts or any(p is None for p in parts):
                return None
            return min(p[0] for p in parts if p), max(p[1] for p in parts if p)
        return self._arithmetic(op, args, kwargs)

    def _arithmetic(self, op: str, args: Any, kwargs: dict) -> Optional[Bound]:
        if len(args) < 2:
            return None
        a = self.of(args[0])
        b = self.of(args[1]) if isinstance(args[1], torch.Tensor) else (
            None if _int(args[1]) is None else (_int(args[1]), _int(args[1])))
        alpha = _int(args[2]) if len(args) > 2 else _int(kwargs.get("alpha", 1))
        if a is None or b is None or alpha is None:
            return None
        lo_b, hi_b = sorted((alpha * b[0], alpha * b[1]))    # type: ignore[operator]
        if op == "add":
            return a[0] + lo_b, a[1] + hi_b
        if op == "sub":
            return a[0] - hi_b, a[1] - lo_b
        return lo_b - a[1], hi_b - a[0]                     # rsub: other - self

    def check(self, func: Any, args: Any) -> None:
        """Raise :class:`IndexOutOfRangeError` where an index can reach past the table."""
        op = getattr(func, "__name__", str(func)).split(".")[0]
        if op == "embedding":
            table, indices, rows = args[0], args[1], int(args[0].shape[0])
        else:                                                  # index_select(self, dim, index)
            table, indices = args[0], args[2]
            dim = int(args[1]) % max(table.dim(), 1)
            rows = int(table.shape[dim]) if table.dim() else 1
        bound = self.of(indices)
        if bound is None or not indices.numel():
            return
        lo, hi = bound
        if lo >= 0 and hi < rows:
            return
        worst = hi if hi >= rows else lo
        what = f"an embedding table of {rows} rows" if op == "embedding" else \
            f"a dimension of {rows} entries"
        raise IndexOutOfRangeError(
            f"index out of range in self: an index of {worst} into {what} "
            f"(aten.{op}; indices from {lo} to {hi}); a GPU stops here at CUDA's device-side "
            "assert `srcIndex < srcSelectDimSize`, the CPU with this IndexError: keep token ids "
            "below the vocabulary size and sequences within the model's positions")


def _arange(args: Any, kwargs: dict) -> Optional[Bound]:
    nums: list[Optional[int]] = [_int(a) for a in args]
    if not nums:
        return None
    if len(nums) == 1:
        nums = [0, nums[0], 1]                       # arange(end)
    elif len(nums) == 2:
        nums.append(_int(kwargs.get("step", 1)))     # arange(start, end)
    start, end, step = nums[:3]
    if start is None or end is None or step is None or step == 0:
        return None
    count = -(-(end - start) // step)
    if count <= 0:
        return None
    last = start + (count - 1) * step
    return min(start, last), max(start, last)
