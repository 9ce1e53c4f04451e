"""What a probe runs: the model, how to build a batch, the loss and the optimizer.

Both backends use these helpers, so a probe means the same thing on real and virtual cards:
``output = model(*args, **kwargs)`` on the batch, ``loss = loss_fn(output, batch)``,
``loss.backward()``, ``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Union

from dptune.errors import DptuneWarning, UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Workload", "batch_to_args", "default_loss", "has_batchnorm", "model_name",
           "unwrap_parallel", "UnwrappingFactory"]

ModelLike = Union["torch.nn.Module", Callable[[], "torch.nn.Module"]]


def unwrap_parallel(model: "torch.nn.Module") -> "torch.nn.Module":
    """The module inside a ``DataParallel``/``BalancedDataParallel``/``DistributedDataParallel``
    (any number of them), with a one-line :class:`DptuneWarning` when there was a wrapper:
    dptune probes the module itself and wraps it in its own ``BalancedDataParallel``."""
    from dptune.checkpoint import unwrap

    inner = unwrap(model)
    if inner is not model:
        warnings.warn(
            f"the model is wrapped in {type(model).__name__}; dptune tunes the module inside it "
            f"(model.module, a {type(inner).__name__}) and wraps that in its own "
            "BalancedDataParallel", DptuneWarning, stacklevel=3)
    return inner


class UnwrappingFactory:
    """A model factory whose model is taken out of any ``DataParallel``-style wrapper
    (see :func:`unwrap_parallel`); it keeps the factory's name for reports."""

    def __init__(self, factory: Callable[[], "torch.nn.Module"]) -> None:
        self.factory = factory
        self.__name__ = model_name(factory)

    def __call__(self) -> "torch.nn.Module":
        import torch

        model = self.factory()
        return unwrap_parallel(model) if isinstance(model, torch.nn.Module) else model


@dataclass
class Workload:
    """The user's training step, as given to ``Tuner`` or ``estimate_memory``.

    - ``model``: an ``nn.Module``, or a zero-argument factory that builds one (the simulated
      backend calls it on the ``meta`` device, so it may describe a model far larger than
      this machine's memory).
    - ``sample(batch_size)``: builds one batch. A tensor is passed as ``model(x)``, a tuple
      or list as ``model(*batch)``, a dict as ``model(**batch)``.
    - ``loss_fn(output, batch)``: the scalar loss; ``None`` means :func:`default_loss`.
    - ``optimizer``: a factory ``params -> torch.optim.Optimizer``; ``None`` means no
      optimizer (no optimizer state, no step).
    """

    model: ModelLike
    sample: Callable[[int], Any]
    loss_fn: Optional[Callable[[Any, Any], Any]] = None
    optimizer: Optional[Callable[[Iterable[Any]], Any]] = None

    def __post_init__(self) -> None:
        import torch

        if not isinstance(self.model, torch.nn.Module) and not callable(self.model):
            raise UsageError(
                f"model must be an nn.Module or a zero-argument factory, got {type(self.model).__name__}")
        if isinstance(self.model, torch.nn.Module):
            self.model = unwrap_parallel(self.model)
        elif not isinstance(self.model, UnwrappingFactory):
            self.model = UnwrappingFactory(self.model)
        if not callable(self.sample):
            raise UsageError(
                "sample must be a function batch_size -> batch (a tensor, tuple or dict), "
                f"got {type(self.sample).__name__}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise UsageError("loss_fn must be callable as loss_fn(output, batch) -> scalar tensor")
        if self.optimizer is not None and not callable(self.optimizer):
            raise UsageError(
                "optimizer must be a factory params -> torch.optim.Optimizer, "
                "e.g. lambda p: torch.optim.AdamW(p, lr=1e-4)")

    @property
    def is_factory(self) -> bool:
        import torch

        return not isinstance(self.model, torch.nn.Module)

    def loss(self, output: Any, batch: Any) -> "torch.Tensor":
        fn = self.loss_fn or default_loss
        return fn(output, batch)


def batch_to_args(batch: Any) -> tuple[tuple, dict]:
    """How a batch is passed to the model: tensor -> (x,), tuple/list -> *batch, dict -> **batch."""
    if isinstance(batch, dict):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _find_loss(output: Any) -> Any:
    if isinstance(output, dict):
        return output.get("loss")
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    return None


def _tensor_leaves(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensor_leaves(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensor_leaves(v)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensor_leaves(getattr(obj, f.name))]
    return []


def default_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """The loss when none is given.

    The model's own loss when its output has one (``output.loss`` or ``output["loss"]``;
    per-replica losses gathered by DataParallel are averaged), else the sum of every
    floating-point tensor in the output.
    """
    loss = _find_loss(output)
    if loss is not None:
        return loss.mean() if loss.dim() > 0 else loss
    leaves = [t for t in _tensor_leaves(output) if t.is_floating_point() and t.requires_grad]
    if not leaves:
        raise UsageError(
            "the model's output has no floating-point tensor that requires grad, so there is "
            "nothing to backpropagate; pass loss_fn=(output, batch) -> loss")
    total = leaves[0].sum()
    for t in leaves[1:]:
        total = total + t.sum()
    return total


def has_batchnorm(module: "torch.nn.Module") -> bool:
    """True when the module has a BatchNorm layer (a chunk of 1 sample breaks it in training)."""
    import torch.nn as nn

    kinds = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    return any(isinstance(m, kinds) for m in module.modules())


def model_name(model: ModelLike) -> str:
    """A short name for reports: the class name, or the factory's name."""
    import torch

    if isinstance(model, torch.nn.Module):
        return type(model).__name__
    return str(getattr(model, "__name__", None) or getattr(type(model), "__name__", "model"))
