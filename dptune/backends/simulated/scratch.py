"""What a CUDA op allocates for itself and frees before it returns (its scratch), which the
fake kernels, run on the CPU, never allocate: a new peak while the op runs, where the op
comes at the step's peak.

Measured on an H200 (torch 2.11, the allocator's history in
``benchmarks/measured/h200-2026-11-27/memory.json.gz``, read by ``benchmarks/memory_gap.py``)
and read in torch's source:

- **a matrix operand cuBLAS cannot read as it is** (``aten/src/ATen/native/cuda/Blas.cpp``,
  ``prepare_matrix_for_cublas``): a 2-D operand of ``mm``/``addmm`` that is neither dense
  nor strided as a column- or row-major matrix (a leading stride below the other size, e.g.
  the stride-0 gradient that ``loss = out.sum()`` sends into a linear layer's backward) is
  copied with ``clone(MemoryFormat::Contiguous)`` for the call. The batched ops (``bmm``,
  ``baddbmm``) copy a 3-D operand whose last two dimensions are neither (the
  ``prepare_batch_matrix_for_cublas`` rule, taken without its dependence on the output's
  layout). TinyGPT's head at batch 4 copies its 131 MB gradient twice this way on the
  H200, the step's peak.
- **cuDNN's convolution workspace** (``aten/src/ATen/native/cudnn/Conv_v8.cpp``: the plan's
  workspace is taken from the caching allocator for the call and freed after it) and, in the
  backward, a copy of an output gradient that is not contiguous in the input's memory format
  (cuDNN takes dense tensors; on the H200 SegNet's last convolution copies the stride-0
  gradient of ``out.sum()``, 5.5 MB, for its backward). The workspace's size is cuDNN's
  choice (its heuristics pick the algorithm, with ``cudnn.benchmark`` off), not in torch's
  source: it is charged as a bound, :data:`CONV_WORKSPACE_BASE` plus the larger of the
  convolution's input and output, fitted on the H200: every workspace of SmallResNet's and
  SegNet's steps is under it (from 400 bytes to 37.9 MB, which is SegNet's 25.2 MB input plus
  12.8 MB; the tightest, 1.5 MB under, ResNet's 256-channel layers' 14.2 MB beside 1 MB
  tensors). Affine in the batch, as the rest of a step's memory, so that the searches' lines
  still fit. In the backward the data and the weight gradients use a workspace each, one
  after the other: one is charged. A calibration on one card, one cuDNN and two models, not
  a law: another card or cuDNN may pick algorithms with larger workspaces.

The cuBLAS workspaces are not scratch (they stay allocated): ``Cluster.workspace_bytes``.
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
