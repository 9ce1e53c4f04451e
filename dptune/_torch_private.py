"""The only module of dptune that touches private torch API; each use says why.

- ``Scatter`` (``torch.nn.parallel._functions``): the autograd-aware scatter that takes
  per-device ``chunk_sizes``. DataParallel's public ``scatter`` always splits evenly; an uneven
  split needs the same function with sizes, and re-implementing it would lose its stream
  handling and its gradient path (Gather back to the source device).
- ``FakeTensorMode`` (``torch._subclasses``): tensors with real shapes, dtypes and storages but
  no data, so the simulated backend can run a model of any size on the CPU.
- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): sees every op below autograd, so
  the simulated backend can charge each new storage to the virtual card that makes it.
- The attention kernels' aten ops (``aten._scaled_dot_product_flash_attention``,
  ``_efficient_attention``, ``_cudnn_attention``, ``_safe_softmax``) and
  ``torch._C._get_sdp_priority_order``: the simulator runs the kernel a CUDA card would choose
  (through its meta kernel) so that the backward keeps that kernel's tensors; there is no
  public way to call a given kernel, nor to read the order ``sdpa_kernel`` may have set.
- ``Module._replicate_for_data_parallel``: the simulator's replicas are module copies made
  as ``torch.nn.parallel.replicate`` makes them (parameters as plain attributes), so that
  code re-running a replica's forward later (activation checkpointing) uses that card's
  weights; ``replicate`` itself only broadcasts between real CUDA devices.
- ``TorchFunctionMode`` (``torch.overrides``): sees ``F.scaled_dot_product_attention`` above
  autograd, where the kernel is chosen.

Everything is imported lazily: importing this module imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dispatch_mode_base", "fake_tensor_mode", "function_mode_active", "function_mode_base", "replica_module",
           "safe_softmax",
           "scatter_chunks", "sdp_priority_order", "sdpa_cudnn", "sdpa_efficient", "sdpa_flash"]


def scatter_chunks(tensor: Any, device_ids: list, chunk_sizes: list, dim: int) -> tuple:
    """Split ``tensor`` along ``dim`` into ``chunk_sizes`` pieces on ``device_ids``.

    Autograd-aware: the backward gathers the gradient back to the input's device. Every
    chunk size must be positive (the CUDA scatter rejects empty chunks): leave devices that
    get nothing out of ``device_ids``.
    """
    from torch.nn.parallel._functions import Scatter

    # Scatter.forward(ctx, target_gpus, chunk_sizes, dim, input)
    return Scatter.apply(list(device_ids), list(chunk_sizes), dim, tensor)


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A new ``FakeTensorMode``."""
    from torch._subclasses import FakeTensorMode

    return FakeTensorMode(**kwargs)


def is_fake(t: Any) -> bool:
    from torch._subclasses import FakeTensor

    return isinstance(t, FakeTensor)


def dispatch_mode_base() -> type:
    """The ``TorchDispatchMode`` base class."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def function_mode_base() -> type:
    """The ``TorchFunctionMode`` base class."""
    from torch.overrides import TorchFunctionMode

    return TorchFunctionMode


def function_mode_active() -> bool:
    """Whether any torch-function mode is active on this thread (the autograd engine runs
    backward nodes with none: the simulator enters its mode again around each node)."""
    import torch

    return bool(torch._C._len_torch_function_stack())


def sdp_priority_order() -> list:
    """The order torch tries attention kernels in (``torch.nn.attention.SDPBackend`` values)."""
    import torch

    get = getattr(torch._C, "_get_sdp_priority_order", None)
    return list(get()) if get is not None else [1, 2, 0, 3]


def sdpa_flash(q: Any, k: Any, v: Any, dropout_p: float, is_causal: bool, scale: float) -> Any:
    """The output of the flash-attention kernel (it saves q, k, v, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, dropout_p, is_causal, False, scale=scale)[0]


def sdpa_efficient(q: Any, k: Any, v: Any, bias: Any, compute_lse: bool, dropout_p: float,
                   is_causal: bool, scale: Any) -> Any:
    """The output of the memory-efficient kernel (saves q, k, v, bias, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, compute_lse, dropout_p, is_causal, scale=scale)[0]


def sdpa_cudnn(q: Any, k: Any, v: Any, bias: Any, compute_lse: bool, dropout_p: float,
               is_causal: bool, scale: Any) -> Any:
    """The output of the cuDNN attention kernel (saves q, k, v, bias, output, logsumexp)."""
    import torch

    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, compute_lse, dropout_p, is_causal, False, scale=scale)[0]


def safe_softmax(x: Any, dim: int) -> Any:
    """``aten._safe_softmax``: the softmax of the math attention path (rows of -inf give 0)."""
    import torch

    return torch.ops.aten._safe_softmax(x, dim)



def replica_module(module: Any, tensors: dict) -> Any:
    """A replica of ``module`` as ``torch.nn.parallel.replicate`` makes one for a device.

    ``tensors`` maps ``id()`` of each of the module's parameters and buffers to the tensor the
    replica uses in its place (one that is missing keeps the module's own). Submodules are
    shallow copies (``_replicate_for_data_parallel``) sharing hooks and attributes.
    """
    mods = list(module.modules())
    copies = {id(m): m._replicate_for_data_parallel() for m in mods}
    for m in mods:
        r = copies[id(m)]
        for key, child in m._modules.items():
            if child is None:
                r._modules[key] = None
            else:
                setattr(r, key, copies[id(child)])
        for key, p in m._parameters.items():
            if p is None:
                r._parameters[key] = None
            else:
                setattr(r, key, tensors.get(id(p), p))
        for key, b in m._buffers.items():
            if b is None:
                r._buffers[key] = None
            else:
                setattr(r, key, tensors.get(id(b), b))
    return copies[id(module)]
