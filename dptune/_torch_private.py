"""The only module of dptune that touches private torch API; each use says why.

- ``Scatter`` (``torch.nn.parallel._functions``): the autograd-aware scatter that takes
  per-device ``chunk_sizes``. DataParallel's public ``scatter`` always splits evenly; an uneven
  split needs the same function with sizes, and re-implementing it would lose its stream
  handling and its gradient path (Gather back to the source device).
- ``FakeTensorMode`` (``torch._subclasses``): tensors with real shapes, dtypes and storages but
  no data, so the simulated backend can run a model of any size on the CPU.
- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): sees every op below autograd, so
  the simulated backend can charge each new storage to the virtual card that makes it.

Everything is imported lazily: importing this module imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

__all__ = ["scatter_chunks", "fake_tensor_mode", "dispatch_mode_base"]


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
