"""A fake copy of the user's model for the simulated cluster: built under ``FakeTensorMode``
(or on the meta device for a factory), run eagerly, optimizers stepped as on CUDA."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Union

import torch
import torch.nn as nn

from dptune._torch_private import no_dispatch_modes
from dptune.errors import UsageError, UserCodeError
from dptune.step.workload import model_name


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s shape, strides and dtype (no data is read)."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")


def _fake_module(model: Union[nn.Module, Callable[[], nn.Module]]) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake; call under FakeTensorMode.

    A factory is called on the ``meta`` device (its initialisation allocates nothing and may
    not read values); a real module is deep-copied with its tensors replaced by fake ones, so
    the user's module is never touched and no weight data is copied. Tied weights stay tied.
    """
    if isinstance(model, nn.Module):
        memo: dict[int, Any] = {}
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(_fake_like(p), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = _fake_like(b)
        try:
            return copy.deepcopy(model, memo)
        except Exception as e:
            raise UsageError(
                f"could not copy the model for simulation ({type(e).__name__}: {e}); pass a "
                "zero-argument factory instead (e.g. model=lambda: Net()), which dptune builds "
                "on the meta device") from e
    try:
        # plain meta tensors, outside the fake mode: a factory may convert them (.to(dtype))
        with no_dispatch_modes(), torch.device("meta"):
            module = model()
    except Exception as e:
        raise UserCodeError(f"the model factory {model_name(model)!r} raised while building the "
                            f"model on the meta device: {type(e).__name__}: {e}") from e
    if not isinstance(module, nn.Module):
        raise UsageError(f"the model factory returned {type(module).__name__}, not an nn.Module")
    new: dict[int, Any] = {}
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is not None:
                if id(param) not in new:
                    new[id(param)] = nn.Parameter(_fake_like(param), requires_grad=param.requires_grad)
                mod._parameters[name] = new[id(param)]
        for name, buf in list(mod._buffers.items()):
            if buf is not None:
                if id(buf) not in new:
                    new[id(buf)] = _fake_like(buf)
                mod._buffers[name] = new[id(buf)]
    return module


def _eager(module: nn.Module) -> tuple[nn.Module, bool]:
    """The module a ``torch.compile`` wrapper holds (run eagerly here), and whether it was one."""
    inner = getattr(module, "_orig_mod", None)
    if isinstance(inner, nn.Module) and type(module).__name__ == "OptimizedModule":
        return inner, True
    return module, False


def _accepts_foreach(group: Mapping[str, Any]) -> bool:
    return "foreach" in group and group["foreach"] is None and not group.get("fused")


def warmed_optimizer(factory: Any, ledger: Any, params: list) -> Any:
    """``factory(params)`` (``None`` without one), its state created on card 0 as a warm-up
    step creates it (``foreach`` where torch's CUDA default is), with the step counters of
    non-capturable, non-fused optimizers on the host as torch keeps them."""
    if factory is None:
        return None
    try:
        optimizer = factory(params)
    except Exception as e:
        raise UserCodeError(f"the optimizer factory raised: {type(e).__name__}: {e}") from e
    for group in getattr(optimizer, "param_groups", []):
        if _accepts_foreach(group):
            group["foreach"] = True
    with ledger.on(0, "optimizer"):
        for p in params:
            with ledger.forced(0, "gradients"):
                p.grad = torch.zeros_like(p)
        try:
            optimizer.step()
        except Exception as e:
            raise UserCodeError(
                f"optimizer.step() raised in the simulated warm-up: {type(e).__name__}: {e}") from e
        optimizer.zero_grad(set_to_none=True)
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for p in group["params"]:
                step = optimizer.state.get(p, {}).get("step")
                if isinstance(step, torch.Tensor) and step.dim() == 0:
                    ledger.to_host(step)
    return optimizer
