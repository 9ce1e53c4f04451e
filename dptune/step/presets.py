"""The built-in losses and optimizers a :class:`~dptune.step.spec.WorkloadSpec` names
(``loss="mse"``, ``optimizer="adamw"``; on the command line ``--loss mse``,
``--optimizer adamw``), in the parent and in an isolated probe's child alike.

Losses take ``(output, batch)`` and return a scalar; optimizers are factories
``params -> torch.optim.Optimizer``. ``None`` in a table means the tuner's default (the
output's own ``loss``, else its sum) or no optimizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from dptune.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["LOSSES", "OPTIMIZERS", "sum_loss", "mean_loss", "cross_entropy_loss", "mse_loss",
           "sgd", "adam", "adamw"]


def _float_leaves(output: Any) -> list:
    from dptune.step import tree as _tree

    leaves = [t for t in _tree.leaves(output) if t.is_floating_point()]
    if not leaves:
        raise UsageError("the model's output holds no floating-point tensor to compute a loss on")
    return leaves


def sum_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """``--loss sum``: the sum of every floating-point tensor of the output."""
    return sum(t.sum() for t in _float_leaves(output))


def mean_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """``--loss mean``: the mean of each floating-point tensor of the output, added up."""
    return sum(t.mean() for t in _float_leaves(output))


def cross_entropy_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """``--loss cross_entropy``: the output's logits, shape (B, ..., classes), against
    class-0 targets (the targets' values do not change memory)."""
    import torch
    import torch.nn.functional as F

    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None:
        logits = _float_leaves(output)[0]
    if logits.dim() < 2:
        raise UsageError(f"--loss cross_entropy needs logits of shape (batch, ..., classes); "
                         f"the model returned shape {tuple(logits.shape)}")
    targets = torch.zeros(logits.shape[:-1].numel(), dtype=torch.long, device=logits.device)
    return F.cross_entropy(logits.flatten(0, -2), targets)


def mse_loss(output: Any, batch: Any = None) -> "torch.Tensor":
    """``--loss mse``: mean squared error of each floating-point output against zeros."""
    import torch
    import torch.nn.functional as F

    leaves = _float_leaves(output)
    return sum((F.mse_loss(t, torch.zeros_like(t)) for t in leaves[1:]),
               F.mse_loss(leaves[0], torch.zeros_like(leaves[0])))


def sgd(params: Any) -> Any:
    """``--optimizer sgd``: SGD with momentum 0.9 (one buffer per parameter)."""
    import torch

    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def adam(params: Any) -> Any:
    """``--optimizer adam``: Adam (two buffers per parameter)."""
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def adamw(params: Any) -> Any:
    """``--optimizer adamw`` (the default, what most models train with): two buffers per
    parameter."""
    import torch

    return torch.optim.AdamW(params, lr=1e-3)


Named = Optional[Callable[..., Any]]

LOSSES: dict[str, Named] = {  # None: the tuner's default
    "default": None, "sum": sum_loss, "mean": mean_loss,
    "cross_entropy": cross_entropy_loss, "mse": mse_loss,
}
OPTIMIZERS: dict[str, Named] = {
    "adamw": adamw, "adam": adam, "sgd": sgd, "none": None,
}
