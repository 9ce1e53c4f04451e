"""What a CUDA op allocates for itself and frees before it returns (its scratch), which the
fake kernels, run on the CPU, never allocate: a new peak while the op runs, where the op
comes at the step's peak.

- :func:`scratch_kind`: ``'matrix'``, ``'conv'`` or ``None``: whether an aten op (its overload packet's name) may allocate scratch on CUDA.
- :func:`scratch_bytes`: The bytes an op of ``kind`` (:func:`scratch_kind`) allocates while it runs on a CUDA card and frees before it returns (none charged for operands ...

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/scratch.py".
"""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["CONV_WORKSPACE_BASE", "scratch_kind", "scratch_bytes", "bound_bytes"]

MiB = 1 << 20
CONV_WORKSPACE_BASE = 14 * MiB

# aten op (overload packet) -> the positions of its matrix operands, and their rank
_MATRIX_OPS = {"mm": ((0, 1), 2), "addmm": ((1, 2), 2), "bmm": ((0, 1), 3), "baddbmm": ((1, 2), 3)}
_CONV_OPS = ("convolution", "convolution_backward")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def scratch_kind(packet: str) -> Optional[str]:
    """``'matrix'``, ``'conv'`` or ``None``: whether an aten op (its overload packet's name)
    may allocate scratch on CUDA."""
    if packet in _MATRIX_OPS:
        return "matrix"
    return "conv" if packet in _CONV_OPS else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dense(t: torch.Tensor) -> bool:
    """``is_non_overlapping_and_dense``: the elements fill a block of memory with no gap."""
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def _blas_copy(t: torch.Tensor) -> bool:
    """Whether cuBLAS gets a contiguous copy of the 2-D operand ``t``."""
    if t.dim() != 2 or t.numel() == 0 or _dense(t):
        return False
    (r, c), (sr, sc) = t.shape, t.stride()
    return not ((sr == 1 and sc >= max(1, r)) or (sc == 1 and sr >= max(1, c)))


def _batch_blas_copy(t: torch.Tensor) -> bool:
    """Whether the batched cuBLAS call gets a contiguous copy of the 3-D operand ``t``."""
    if t.dim() != 3 or t.numel() == 0:
        return False
    _, r, c = t.shape
    _, sr, sc = t.stride()
    if (sc == 1 and sr >= max(1, c)) or (sr == 1 and sc >= max(1, r)):
        return False
    return not (t.is_contiguous() and sr != 0 and sc != 0)


def _matrix_scratch(packet: str, args: Any) -> int:
    pos, rank = _MATRIX_OPS[packet]
    copies = _blas_copy if rank == 2 else _batch_blas_copy
    return sum(_nbytes(args[i]) for i in pos
               if len(args) > i and isinstance(args[i], torch.Tensor) and copies(args[i]))


def conv_workspace_bound(x: torch.Tensor, y: torch.Tensor) -> int:
    """The bound charged for cuDNN's workspace in a convolution of input ``x``, output ``y``."""
    return CONV_WORKSPACE_BASE + max(_nbytes(x), _nbytes(y))


def _conv_scratch(packet: str, args: Any, out: Any) -> int:
    if packet == "convolution_backward":
        y, x = args[0], args[1]         # the output's gradient, the input
    else:
        x, y = args[0], out
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or (
            x.dtype not in _FLOATS or x.dim() < 3):
        return 0
    copy = 0
    if packet == "convolution_backward":
        fmt = torch.channels_last if x.dim() == 4 and x.is_contiguous(
            memory_format=torch.channels_last) and not x.is_contiguous() else torch.contiguous_format
        copy = 0 if y.is_contiguous(memory_format=fmt) else _nbytes(y)
    return copy + conv_workspace_bound(x, y)


def bound_bytes(kind: str, packet: str, args: Any, out: Any) -> int:
    """The part of an op's scratch (:func:`scratch_bytes`) that is a bound, not a measurement:
    cuDNN's workspace in a convolution (:func:`conv_workspace_bound`), else 0."""
    if kind != "conv" or _symbolic(args[:3]):
        return 0
    x, y = (args[1], args[0]) if packet == "convolution_backward" else (args[0], out)
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or (
            x.dtype not in _FLOATS or x.dim() < 3):
        return 0
    return conv_workspace_bound(x, y)


def _symbolic(args: Any) -> bool:
    return any(isinstance(d, torch.SymInt) for t in args if isinstance(t, torch.Tensor)
               for d in (*t.shape, *t.stride()))


def scratch_bytes(kind: str, packet: str, args: Any, out: Any) -> int:
    """The bytes an op of ``kind`` (:func:`scratch_kind`) allocates while it runs on a CUDA
    card and frees before it returns (none charged for operands of data-dependent sizes)."""
    if _symbolic(args[:3]):
        return 0
    if kind == "matrix":
        return _matrix_scratch(packet, args)
    return _conv_scratch(packet, args, out)
