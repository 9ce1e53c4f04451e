"""Checkpoints that do not care whether the model was wrapped.

A model wrapped in ``DataParallel`` (or :class:`dptune.BalancedDataParallel`, or
``DistributedDataParallel``) saves its weights under ``module.``-prefixed keys, which a plain
model then refuses to load, and the other way round. :func:`state_dict` always saves without
the prefix, and :func:`load_state_dict` loads either kind into either kind::

    torch.save(dptune.state_dict(model), "ckpt.pt")          # model wrapped or not
    dptune.load_state_dict(other_model, "ckpt.pt")            # other_model wrapped or not
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Union

from dptune.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["unwrap", "state_dict", "load_state_dict"]

_PREFIX = "module."


def unwrap(model: "torch.nn.Module") -> "torch.nn.Module":
    """The model inside any number of ``DataParallel``/``DistributedDataParallel`` wrappers."""
    import torch

    wrappers = (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def state_dict(model: "torch.nn.Module") -> "dict[str, Any]":
    """The model's state dict without the wrappers' ``module.`` prefix."""
    return unwrap(model).state_dict()


def _leading_prefixes(keys: list[str]) -> int:
    """How many ``module.`` prefixes every key starts with."""
    if not keys:
        return 0
    depth = 0
    while all(k.startswith(_PREFIX * (depth + 1)) for k in keys):
        depth += 1
    return depth


def _read(path: Union[str, "os.PathLike[str]"]) -> Mapping[str, Any]:
    import torch

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise UsageError(f"no checkpoint at {p!r}; give a file written by torch.save(state_dict, path)")
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # unpickling errors are many types
        raise UsageError(
            f"cannot read {p!r} as a state dict ({type(e).__name__}: {e}); save one with "
            "torch.save(dptune.state_dict(model), path)") from e
    if not isinstance(obj, Mapping):
        raise UsageError(f"{p!r} holds a {type(obj).__name__}, not a state dict")
    return obj


def load_state_dict(model: "torch.nn.Module",
                    state: Union[Mapping[str, Any], str, "os.PathLike[str]"],
                    strict: bool = True) -> Any:
    """Load a state dict, or a file saved with ``torch.save``, into a wrapped or plain model.

    Leading ``module.`` prefixes that every key has (from saving a wrapped model) are removed
    as far as the model's own keys do not have them, so a model whose first child really is
    named ``module`` still loads. Files are read with ``weights_only=True`` onto the CPU.
    Returns what ``torch.nn.Module.load_state_dict`` returns (missing and unexpected keys).
    """
    if isinstance(state, (str, os.PathLike)):
        state = _read(state)
    if not isinstance(state, Mapping):
        raise UsageError(f"state must be a state dict or a path, got {type(state).__name__}")
    target = unwrap(model)
    extra = _leading_prefixes(list(state.keys())) - _leading_prefixes(list(target.state_dict().keys()))
    if extra > 0:
        from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

        fixed: OrderedDict[str, Any] = OrderedDict(state)
        meta = getattr(state, "_metadata", None)
        if meta is not None:
            fixed._metadata = OrderedDict(meta)  # type: ignore[attr-defined]
        for _ in range(extra):
            consume_prefix_in_state_dict_if_present(fixed, _PREFIX)
        state = fixed
    return target.load_state_dict(state, strict=strict)
