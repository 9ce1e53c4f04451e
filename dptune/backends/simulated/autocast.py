"""CUDA autocast on the simulated cluster, with CUDA's casting rules.

The simulated cards are fake CPU tensors. On such tensors ``torch.autocast("cuda")`` does
nothing (torch even disables it, with a warning, on a build without CUDA), and CPU autocast
has other rules than CUDA's (on CUDA ``softmax``, ``layer_norm`` and the losses run in fp32,
so e.g. the attention probabilities and the logits' ``log_softmax`` are stored in fp32).

While :func:`cuda_autocast` is active:

- ``torch.autocast("cuda", dtype)`` and ``torch.amp.GradScaler("cuda")`` work as on a GPU;
- the thread's dispatch keys include ``AutocastCUDA``, so while CUDA autocast is on every op
  passes through that key, where Python kernels apply CUDA's op lists (copied below from
  ``ATen/autocast_mode.h`` of torch 2.13: ``AT_FORALL_LOWER_PRECISION_FP``,
  ``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, the ``norm`` overloads of
  ``fp32_append_dtype`` and ``AT_FORALL_PROMOTE``) with the same policies, including the cache
  of lower-precision copies of fp32 leaf weights that lives until the outermost autocast
  region exits. ``binary_cross_entropy`` keeps CUDA's own kernel, which refuses to run.

The casts happen above autograd, as on a GPU, so what autograd saves (a bf16 copy of a
Linear's input, an fp32 softmax output) is what a GPU would hold.

Where the emulation differs from CUDA: every floating tensor counts as a CUDA tensor (on a
GPU, CPU tensors in the same op are not cast); ops that torch adds to its lists after 2.13
are not cast. ``torch.utils.checkpoint`` restores the autocast state of its inputs' device
when it recomputes a region; the fake tensors say "cpu", so while a simulated step runs the
checkpoint is told "cuda" (``amp_as_if_cuda``) and recomputes in the forward's precision.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

from dptune._torch_private import PythonKernels, amp_as_if_cuda, exclude_dispatch_key, include_dispatch_key

__all__ = ["cuda_autocast", "autocast_inputs", "LOWER_PRECISION_FP", "FP32", "FP32_SET_OPT_DTYPE", "FP32_APPEND_DTYPE",
           "PROMOTE"]

KEY = "AutocastCUDA"

#: CUDA's op lists (``ATen/autocast_mode.h``), as ``name`` or ``name.overload``.
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    "cudnn_convolution", "cudnn_convolution_transpose",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa",
    "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
    "sum.dim_IntList",
)
#: overload without a dtype -> the overload it is redispatched to with ``dtype=float32``
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype",
                     "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
           "index_put", "tensordot", "scatter_add")


def _overload(name: str) -> Any:
    import torch

    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


class _Casts:
    """``cached_cast`` of ``ATen/autocast_mode.cpp``, with its cache of weight casts."""

    def __init__(self) -> None:
        self.cache: dict[int, tuple[Any, Any]] = {}

    def clear(self) -> None:
        self.cache.clear()

    @staticmethod
    def eligible(t: Any) -> bool:
        import torch

        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def cast(self, to: Any, arg: Any) -> Any:
        import torch

        if isinstance(arg, (list, tuple)):
            return type(arg)(self.cast(to, a) for a in arg)
        if not self.eligible(arg) or arg.dtype == to:
            return arg
        lower = torch.get_autocast_dtype("cuda")
        cacheable = (to == lower and arg.dtype == torch.float32 and arg.requires_grad
                     and arg.is_leaf and not arg._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return arg.to(to)
        hit = self.cache.get(id(arg))
        if hit is not None and hit[0]() is arg:
            return hit[1]
        out = arg.to(to)
        self.cache[id(arg)] = (weakref.ref(arg), out)
        return out


def _tensors(args: Any) -> Iterator[Any]:
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


def _guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with the autocast key excluded, as the C++ wrapper runs the op below it."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with exclude_dispatch_key(KEY):
            return fn(*args, **kwargs)
    return kernel


def _lower(casts: _Casts, op: Any) -> Callable[..., Any]:
    """``lower_precision_fp``: floating inputs cast to the autocast dtype."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        to = torch.get_autocast_dtype("cuda")
        return op(*casts.cast(to, args), **{k: casts.cast(to, v) for k, v in kwargs.items()})
    return _guarded(run)


def _fp32(casts: _Casts, op: Any) -> Callable[..., Any]:
    """``fp32``: floating inputs cast to float32."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        to = torch.float32
        return op(*casts.cast(to, args), **{k: casts.cast(to, v) for k, v in kwargs.items()})
    return _guarded(run)


def _set_opt_dtype(casts: _Casts, op: Any) -> Callable[..., Any]:
    """``fp32_set_opt_dtype``: ``dtype=float32`` where the call gives none."""
    import torch

    names = [a.name for a in op._schema.arguments]
    kw_only = {a.name for a in op._schema.arguments if a.kwarg_only}
    pos = names.index("dtype")

    def run(*args: Any, **kwargs: Any) -> Any:
        if not (args and casts.eligible(args[0])):
            return op(*args, **kwargs)
        if "dtype" in kw_only or pos >= len(args):
            if kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
        elif args[pos] is None:
            args = (*args[:pos], torch.float32, *args[pos + 1:])
        return op(*args, **kwargs)
    return _guarded(run)


def _append_dtype(casts: _Casts, target: Any) -> Callable[..., Any]:
    """``fp32_append_dtype``: redispatched to ``target``, the overload that takes a dtype."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        out = torch.float32 if casts.eligible(args[0]) else args[0].dtype
        return target(*args, **kwargs, dtype=out)
    return _guarded(run)


def _promote(casts: _Casts, op: Any) -> Callable[..., Any]:
    """``promote``: all to the autocast dtype, or all to float32 if any input is wider."""
    import torch

    def run(*args: Any, **kwargs: Any) -> Any:
        lower_dtype = torch.get_autocast_dtype("cuda")
        to = lower_dtype
        for t in _tensors((*args, *kwargs.values())):
            if casts.eligible(t) and t.dtype != lower_dtype:
                to = torch.float32
        return op(*casts.cast(to, args), **{k: casts.cast(to, v) for k, v in kwargs.items()})
    return _guarded(run)


def _kernels(casts: _Casts) -> dict[str, Callable[..., Any]]:
    """The Python kernel of every op of CUDA's lists, by ``name`` or ``name.overload``."""
    out: dict[str, Callable[..., Any]] = {}
    for names, make in ((LOWER_PRECISION_FP, _lower), (FP32, _fp32),
                        (FP32_SET_OPT_DTYPE, _set_opt_dtype), (PROMOTE, _promote)):
        for name in names:
            op = _overload(name)
            if op is not None:
                out[name] = make(casts, op)
    for name, target in FP32_APPEND_DTYPE.items():
        op, to = _overload(name), _overload(target)
        if op is not None and to is not None:
            out[name] = _append_dtype(casts, to)
    return out


def autocast_inputs(*tensors: Any) -> tuple[tuple[Any, ...], Any]:
    """For code that replaces an op of the lower-precision list above the dispatcher (the
    simulator's attention): the inputs cast as CUDA autocast would cast them, and a context
    to run the op's implementation in with autocast off, as the C++ wrapper does."""
    import torch

    if not torch.is_autocast_enabled("cuda"):
        return tensors, contextlib.nullcontext()
    to = torch.get_autocast_dtype("cuda")
    cast = tuple(t.to(to) if _Casts.eligible(t) and t.dtype != to else t for t in tensors)
    return cast, exclude_dispatch_key(KEY)


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """Make ``torch.autocast("cuda")`` act on the simulated cluster's tensors (see above)."""
    casts = _Casts()
    kernels = PythonKernels(_kernels(casts), KEY)
    try:
        with amp_as_if_cuda(casts.clear), include_dispatch_key(KEY):
            yield
    finally:
        casts.clear()
        kernels.close()
