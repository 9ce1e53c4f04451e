"""Which attention kernel CUDA runs for ``F.scaled_dot_product_attention``, and running it.

- :class:`SdpaCall`: What the kernel choice depends on, read from one call's arguments.
- :class:`SdpaFlags`: The switches torch consults: ``torch.backends.cuda.*_sdp_enabled()`` and the order.
- :func:`run_kernel`: The output of ``scaled_dot_product_attention`` computed the way CUDA does with ``kernel``.
- :func:`sdpa_mode`: A torch-function mode that runs every ``F.scaled_dot_product_attention`` as CUDA would.
- :func:`select_kernel`: The kernel CUDA runs for ``call`` on a card of compute ``capability``.

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/sdpa.py".
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from dptune import _torch_private
from dptune.backends.simulated.autocast import autocast_inputs

__all__ = ["CUDNN_VERSION_ASSUMED", "KERNELS", "Capability", "SdpaCall", "SdpaFlags", "run_kernel",
           "sdpa_mode", "select_kernel"]

Capability = tuple[int, int]
KERNELS = ("flash", "efficient", "cudnn", "math")
CUDNN_VERSION_ASSUMED = 91600        # cuDNN 9.16, as shipped with recent torch wheels
# torch.nn.attention.SDPBackend values, as _get_sdp_priority_order returns them
_BACKEND_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
_DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaFlags:
    """The switches torch consults: ``torch.backends.cuda.*_sdp_enabled()`` and the order."""

    flash: bool = True
    efficient: bool = True
    math: bool = True
    cudnn: bool = True
    order: tuple[str, ...] = _DEFAULT_ORDER
    deterministic: bool = False          # torch.use_deterministic_algorithms(True), not warn-only
    cudnn_deprioritized: bool = False    # TORCH_CUDNN_SDPA_DEPRIORITIZED=1

    @classmethod
    def from_torch(cls) -> "SdpaFlags":
        """The flags as the running torch has them (``sdpa_kernel`` context included)."""
        import torch.backends.cuda as cb

        order = tuple(_BACKEND_NAMES.get(i, "?") for i in _torch_private.sdp_priority_order())
        return cls(flash=cb.flash_sdp_enabled(), efficient=cb.mem_efficient_sdp_enabled(),
                   math=cb.math_sdp_enabled(), cudnn=cb.cudnn_sdp_enabled(),
                   order=tuple(o for o in order if o in KERNELS),
                   deterministic=(torch.are_deterministic_algorithms_enabled()
                                  and not torch.is_deterministic_algorithms_warn_only_enabled()),
                   cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "")
                   in ("1", "true", "TRUE", "ON", "on"))


@dataclass(frozen=True)
class SdpaCall:
    """What the kernel choice depends on, read from one call's arguments."""

    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype]     # query, key, value
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    requires_grad: bool = False          # an input requires grad and grad mode is on
    mask_shape: Optional[tuple[int, ...]] = None
    mask_requires_grad: bool = False
    last_strides: tuple[int, int, int] = (1, 1, 1)           # stride(-1) of query, key, value
    mask_last_stride: int = 1
    storage_offsets: tuple[int, int, int] = (0, 0, 0)        # in elements
    element_size: int = 4

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
           is_causal: bool = False, enable_gqa: bool = False) -> "SdpaCall":
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        return cls(
            q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape),
            dtypes=(q.dtype, k.dtype, v.dtype), dropout_p=float(dropout_p),
            is_causal=bool(is_causal), enable_gqa=bool(enable_gqa), requires_grad=grad,
            mask_shape=None if attn_mask is None else tuple(attn_mask.shape),
            mask_requires_grad=bool(attn_mask is not None and attn_mask.requires_grad),
            last_strides=tuple(t.stride(-1) if t.dim() else 1 for t in (q, k, v)),  # type: ignore[arg-type]
            mask_last_stride=attn_mask.stride(-1) if attn_mask is not None and attn_mask.dim() else 1,
            storage_offsets=(int(q.storage_offset()), int(k.storage_offset()), int(v.storage_offset())),
            element_size=q.element_size())


# ---- the filters (each mirrors a check_* of sdp_utils) --------------------------------------
def _sm_in(cap: Capability, lo: Capability, hi: Capability) -> bool:
    return lo <= cap <= hi


def _dense_ok(c: SdpaCall, *, ignore_singleton_dim: bool, gqa: bool) -> bool:
    """check_nonzero_sequence_lengths_dense, check_last_dim_stride_equals_1_dense,
    check_batch_size_and_num_heads_dense."""
    if c.q_shape[-2] == 0 or c.k_shape[-2] == 0:
        return False
    strides_ok = all(s == 1 for s in c.last_strides) or (ignore_singleton_dim and c.q_shape[-1] == 1)
    if not strides_ok or (c.mask_shape is not None and c.mask_last_stride != 1):
        return False
    if not c.q_shape[0] == c.k_shape[0] == c.v_shape[0]:
        return False
    hq, hk, hv = c.q_shape[-3], c.k_shape[-3], c.v_shape[-3]
    if c.enable_gqa and gqa:
        return hk == hv and hk > 0 and hq % hk == 0
    return hq == hk == hv


def _four_d(c: SdpaCall) -> bool:
    return len(c.q_shape) == len(c.k_shape) == len(c.v_shape) == 4


def _gemm_alignment(c: SdpaCall, cap: Capability) -> int:
    """minimum_gemm_alignment: elements a head size must be a multiple of (mem-efficient)."""
    half = c.dtypes[0] in _HALF
    tensor_cores = cap[0] >= 8 or (cap[0] >= 7 and half)
    align = 4 if cap[0] >= 8 else 1
    if tensor_cores:
        align = max(align, 128 // (16 if half else 32))
    return align


def can_use_flash(c: SdpaCall, cap: Capability, flags: SdpaFlags) -> bool:
    if not flags.flash or not _four_d(c) or c.mask_shape is not None:
        return False
    dq, dk, dv = c.q_shape[-1], c.k_shape[-1], c.v_shape[-1]
    if not (dq == dk == dv and dq <= 256):
        return False
    if not _sm_in(cap, (8, 0), (12, 1)):
        return False
    sm86_89_or_12x = _sm_in(cap, (8, 6), (8, 9)) or _sm_in(cap, (12, 0), (12, 1))
    if (c.requires_grad and sm86_89_or_12x
            and not (dq <= 192 or (c.dropout_p == 0.0 and dq > 224))):
        return False
    if c.is_causal and c.q_shape[-2] != c.k_shape[-2]:
        return False
    if not (c.dtypes[0] == c.dtypes[1] == c.dtypes[2] and c.dtypes[0] in _HALF):
        return False
    return _dense_ok(c, ignore_singleton_dim=True, gqa=True)


def can_use_efficient(c: SdpaCall, cap: Capability, flags: SdpaFlags) -> bool:
    if not flags.efficient or not _sm_in(cap, (5, 0), (12, 1)) or not _four_d(c):
        return False
    align = _gemm_alignment(c, cap)
    dq, dk, dv = c.q_shape[-1], c.k_shape[-1], c.v_shape[-1]
    if not (dq == dk and dq > 0 and dv > 0 and dq % align == 0 and dv % align == 0):
        return False
    if cap[0] >= 8:
        align_bytes = align * c.element_size
        if any((off * c.element_size) % align_bytes for off in c.storage_offsets):
            return False
    if not _dense_ok(c, ignore_singleton_dim=False, gqa=False):   # no grouped-query heads
        return False
    allowed = (torch.float16, torch.float32, torch.bfloat16) if cap[0] >= 8 else (torch.float16, torch.float32)
    return c.dtypes[0] == c.dtypes[1] == c.dtypes[2] and c.dtypes[0] in allowed


def _mask_shape_ok(c: SdpaCall) -> bool:
    """check_attn_mask_shape (cuDNN)."""
    m = c.mask_shape
    if m is None:
        return True
    if c.mask_requires_grad or len(m) not in (2, 4):
        return False
    b, h, lq = c.q_shape[0], c.q_shape[1], c.q_shape[2]
    lk = c.k_shape[2]
    if m[-2] not in (lq, 1) or m[-1] not in (lk, 1):
        return False
    return len(m) == 2 or (m[0] in (1, b) and m[1] in (1, h))


def can_use_cudnn(c: SdpaCall, cap: Capability, flags: SdpaFlags,
                  cudnn_version: int = CUDNN_VERSION_ASSUMED) -> bool:
    if c.dropout_p > 0.0 and 91100 < cudnn_version < 91400:
        return False
    if not flags.cudnn or not _four_d(c) or flags.deterministic:
        return False
    if not (c.dtypes[0] == c.dtypes[1] == c.dtypes[2] and c.dtypes[0] in _HALF):
        return False
    if not _mask_shape_ok(c) or not _sm_in(cap, (8, 0), (12, 1)):
        return False
    if c.dropout_p * 16.0 != math.floor(c.dropout_p * 16.0):
        return False
    if not _dense_ok(c, ignore_singleton_dim=True, gqa=True):
        return False
    b, h, s_q, d_qk = c.q_shape
    s_k, d_v = c.k_shape[2], c.v_shape[3]
    if b > 65535 or h > 65535:
        return False
    sm90_or_10x = cap == (9, 0) or cap[0] == 10
    d256 = sm90_or_10x and cap != (10, 7) and cudnn_version > 92200
    limit = 256 if d256 else (192 if sm90_or_10x and d_qk == 192 and d_v == 128 else 128)
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if s_k == 1 or (c.dropout_p != 0.0 and s_q == 1):
        return False
    bprop_ok = (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))
    return not (c.requires_grad and d256 and not bprop_ok)


def priority(cap: Capability, flags: SdpaFlags) -> tuple[str, ...]:
    """The order the kernels are tried in (torch's ``priority_order``)."""
    order = flags.order
    prefer_cudnn = (not flags.cudnn_deprioritized and CUDNN_VERSION_ASSUMED > 91500
                    and cap[0] in (9, 10))
    if prefer_cudnn and order == _DEFAULT_ORDER:
        return ("cudnn", "flash", "efficient", "math")
    return order


def select_kernel(call: SdpaCall, capability: Capability,
                  flags: Optional[SdpaFlags] = None) -> str:
    """The kernel CUDA runs for ``call`` on a card of compute ``capability``.

    One of ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``, or ``"error"`` when every
    kernel is disabled or unusable (torch raises "No available kernel" then).
    """
    flags = flags or SdpaFlags()
    checks: dict[str, Callable[[], bool]] = {
        "cudnn": lambda: can_use_cudnn(call, capability, flags),
        "flash": lambda: can_use_flash(call, capability, flags),
        "efficient": lambda: can_use_efficient(call, capability, flags),
        "math": lambda: flags.math,
    }
    for name in priority(capability, flags):
        if checks[name]():
            return name
    return "error"


# ---- running the chosen kernel as attention.cpp does on CUDA ---------------------------------
def _bool_to_additive(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """convert_boolean_attn_mask: a boolean mask becomes 0 / -inf of the query's dtype."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _aligned(t: torch.Tensor, alignment: int) -> bool:
    return all(t.stride(i) % alignment == 0 for i in range(t.dim() - 1)) and t.stride(-1) == 1


def _preprocess_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """preprocess_mask (memory-efficient kernel): pad the last dim to 8, expand to 4-D."""
    if not _aligned(mask, 8):
        last = mask.shape[-1]
        mask = torch.nn.functional.pad(mask, (0, 8 - last % 8))[..., :last]
    return mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
          dropout_p: float, is_causal: bool, scale: Optional[float], enable_gqa: bool) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` as it runs on CUDA.

    Written out (rather than calling the aten composite) for one difference: its dropout is
    ``at::dropout``, which on a CUDA tensor is ``native_dropout`` (a boolean mask is saved)
    but on the CPU multiplies by a noise tensor of the input's dtype (four times larger).
    """
    origin = q.dtype
    if not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed():
        q, k, v = (t.float() if t.dtype in _HALF else t for t in (q, k, v))
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    factor = math.sqrt(abs(s))
    q = q * (-factor if s < 0 else factor)
    if is_causal:
        if mask is not None:
            raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                               "when is_causal=True")
        causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = _bool_to_additive(causal, q.dtype)
    if enable_gqa and not q.shape[-3] == k.shape[-3] == v.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if mask is not None:
        attn = attn.add(mask)
    attn = _torch_private.safe_softmax(attn, -1)
    if dropout_p > 0.0:
        attn = cuda_dropout(attn, dropout_p)
    return torch.matmul(attn, v).to(origin)


def cuda_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` as CUDA runs it: ``native_dropout``, a boolean mask."""
    if 0.0 < p < 1.0 and x.numel() > 0:
        return torch.native_dropout(x, p, True)[0]
    return torch.nn.functional.dropout(x, p, True)


def run_kernel(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: Optional[float] = None,
               enable_gqa: bool = False) -> torch.Tensor:
    """The output of ``scaled_dot_product_attention`` computed the way CUDA does with ``kernel``.

    Mirrors the CUDA branch of ``scaled_dot_product_attention`` in attention.cpp: masks
    converted and padded as there, head sizes padded to a multiple of 8 for flash, the
    logsumexp kept only when an input requires grad.
    """
    lse = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if kernel == "flash":
        d = q.shape[-1]
        og_scale = scale if scale is not None else 1.0 / math.sqrt(d)
        if d % 8:
            pad = (0, 8 - d % 8)
            q, k, v = (torch.nn.functional.pad(t, pad) for t in (q, k, v))
        out = _torch_private.sdpa_flash(q, k, v, dropout_p, is_causal, og_scale)
        return out[..., :d] if out.shape[-1] != d else out
    if kernel == "efficient":
        bias = _bool_to_additive(attn_mask, q.dtype)
        if bias is not None:
            bias = _preprocess_mask(bias, q, k)
        return _torch_private.sdpa_efficient(q, k, v, bias, lse, dropout_p, is_causal, scale)
    if kernel == "cudnn":
        bias = _bool_to_additive(attn_mask, q.dtype)
        return _torch_private.sdpa_cudnn(q, k, v, bias, lse, dropout_p, is_causal, scale)
    if kernel == "math":
        return _math(q, k, v, _bool_to_additive(attn_mask, q.dtype), dropout_p, is_causal, scale,
                     enable_gqa)
    raise RuntimeError("No available kernel. Aborting execution. (every scaled_dot_product_attention "
                       "backend is disabled or unusable for these inputs on this card)")


_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False,
                                  "scale": None, "enable_gqa": False}


def _bind(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_PARAMS, args))
    bound.update(kwargs)
    return bound


def sdpa_mode(capability_of: Callable[[torch.Tensor], Optional[Capability]],
              on_choice: Callable[[str, Capability], None]) -> Any:
    """A torch-function mode that runs every ``F.scaled_dot_product_attention`` as CUDA would.

    It also runs ``F.dropout`` on card tensors as CUDA does (``native_dropout``, which keeps a
    boolean mask for the backward, where the CPU build keeps a noise tensor of the input's
    dtype: 4 bytes an element instead of 1 in fp32).

    ``capability_of(query)`` is the compute capability of the card that holds ``query``, or
    ``None`` for a tensor on the host (left to the CPU's own kernel choice).
    ``on_choice(kernel, capability)`` is told each choice.
    """
    base = _torch_private.function_mode_base()
    target = torch.nn.functional.scaled_dot_product_attention
    dropouts = (torch.nn.functional.dropout, torch.dropout)

    class _SdpaMode(base):  # type: ignore[misc, valid-type]
        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                               kwargs: Optional[dict] = None) -> Any:
            kwargs = kwargs or {}
            if func in dropouts:
                return _dropout(func, args, kwargs)
            if func is not target:
                return func(*args, **kwargs)
            b = _bind(args, kwargs)
            q, k, v = b["query"], b["key"], b["value"]
            cap = capability_of(q) if isinstance(q, torch.Tensor) else None
            if cap is None or not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
                return func(*args, **kwargs)
            # under CUDA autocast, attention is a lower-precision op: its inputs are cast
            # before the kernel is chosen, and the kernel runs with autocast off
            (q, k, v, mask), autocast_off = autocast_inputs(q, k, v, b["attn_mask"])
            call = SdpaCall.of(q, k, v, mask, b["dropout_p"], b["is_causal"], b["enable_gqa"])
            kernel = select_kernel(call, cap, SdpaFlags.from_torch())
            on_choice(kernel, cap)
            with autocast_off:
                return run_kernel(kernel, q, k, v, mask, b["dropout_p"], b["is_causal"],
                                  b["scale"], b["enable_gqa"])

    def _dropout(func: Any, args: Sequence[Any], kwargs: dict) -> Any:
        names = ("input", "p", "training", "inplace") if func is not torch.dropout else ("input", "p", "train")
        b = {"p": 0.5, "training": True, "train": True, "inplace": False}
        b.update(zip(names, args))
        b.update(kwargs)
        x = b["input"]
        train = b["training"] if func is not torch.dropout else b["train"]
        if (isinstance(x, torch.Tensor) and train and not b["inplace"]
                and capability_of(x) is not None):
            return cuda_dropout(x, float(b["p"]))
        return func(*args, **kwargs)

    return _SdpaMode()
