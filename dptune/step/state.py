"""Leave no trace: snapshot and restore everything a probe could touch.

A probe moves the user's model to a card, trains it for a step or two, switches it to
training mode, draws random numbers and flips cuDNN flags. :func:`snapshot` records, and
:func:`restore` puts back, bit for bit:

- every parameter and buffer of the model (values, ``requires_grad``, device, dtype, and the
  ``module._parameters`` / ``module._buffers`` entries themselves), and each parameter's
  ``.grad`` (``None`` stays ``None``);
- each submodule's ``training`` flag;
- the state and hyper-parameters of any optimizers passed in (generic: whatever
  ``optimizer.state`` and ``optimizer.param_groups`` hold);
- the RNG states of Python's ``random``, NumPy (when installed) and torch's CPU generator,
  and with ``cuda=True`` every CUDA generator;
- ``torch.backends.cudnn`` flags (``enabled``, ``benchmark``, ``deterministic``,
  ``allow_tf32``) and grad mode.

Copies go to host memory (``detach().clone()`` on the CPU), so snapshotting a model that sits
on a card costs host RAM equal to its weights (and gradients), not GPU memory.

Restore keeps identity: the same ``Parameter`` objects are put back in their modules and
their contents written in place (``copy_``), or, when the probe moved them to another device,
their ``.data`` pointed back to a tensor on the original device. An optimizer the user built
over the parameters therefore keeps working after a probe.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Snapshot", "snapshot", "restore"]


@dataclass
class _Saved:
    """A host copy of one tensor and where it lived."""

    value: "torch.Tensor"          # CPU copy
    device: "torch.device"
    dtype: "torch.dtype"
    requires_grad: bool = False


def _save(t: "torch.Tensor") -> _Saved:
    v = t.detach()
    cpu = v.to("cpu", copy=True) if v.device.type != "cpu" else v.clone()
    return _Saved(cpu, t.device, t.dtype, bool(t.requires_grad))


def _restored(saved: _Saved, consume: bool) -> "torch.Tensor":
    """A tensor with the saved value on the saved device (the host copy itself if allowed)."""
    if consume and saved.device.type == "cpu" and saved.value.dtype == saved.dtype:
        return saved.value
    return saved.value.to(device=saved.device, dtype=saved.dtype, copy=True)


def _put_back(t: "torch.Tensor", saved: _Saved, consume: bool = False) -> None:
    """Write ``saved`` into ``t`` in place, moving ``t`` back to its device if it moved."""
    import torch

    with torch.no_grad():
        if t.device == saved.device and t.dtype == saved.dtype and t.shape == saved.value.shape:
            t.copy_(saved.value)
        else:
            t.data = _restored(saved, consume)


@dataclass
class _ParamSaved:
    param: "torch.Tensor"
    data: _Saved
    grad: Optional[_Saved]


@dataclass
class _OptSaved:
    optimizer: Any
    groups: list                     # [(group dict object, params list object, other keys)]
    state: list                      # [(param, {key: _Saved | deep-copied value})]


@dataclass
class Snapshot:
    """What :func:`snapshot` recorded; pass it to :func:`restore`."""

    model: Any = None
    params: list = field(default_factory=list)          # [_ParamSaved], each param once
    module_params: list = field(default_factory=list)   # [(module, dict copy of _parameters)]
    buffers: list = field(default_factory=list)         # [(module, {name: (tensor|None, _Saved|None)}, non_persistent)]
    modes: list = field(default_factory=list)           # [(module, training)]
    optimizers: list = field(default_factory=list)      # [_OptSaved]
    python_rng: Any = None
    numpy_rng: Any = None
    torch_rng: Any = None
    cuda_rng: Optional[list] = None
    cudnn: Optional[dict] = None
    grad_enabled: Optional[bool] = None


def _cudnn_flags() -> dict:
    import torch

    c = torch.backends.cudnn
    return {"enabled": c.enabled, "benchmark": c.benchmark,
            "deterministic": c.deterministic, "allow_tf32": c.allow_tf32}


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


def snapshot(model: Optional["torch.nn.Module"] = None, *,
             optimizers: Sequence[Any] = (), rng: bool = True, cuda: bool = False,
             backends: bool = True) -> Snapshot:
    """Record the state a probe could change (see the module docstring).

    ``model`` may be ``None`` (RNG and flags only). ``cuda=True`` also records every CUDA
    generator (this initialises CUDA; leave it off on machines without GPUs).
    """
    import torch

    snap = Snapshot(model=model)
    if model is not None:
        seen: set[int] = set()
        for mod in model.modules():
            snap.modes.append((mod, mod.training))
            snap.module_params.append((mod, dict(mod._parameters)))
            for p in mod._parameters.values():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                snap.params.append(_ParamSaved(
                    p, _save(p), None if p.grad is None else _save(p.grad)))
            bufs = {name: (b, None if b is None else _save(b)) for name, b in mod._buffers.items()}
            snap.buffers.append((mod, bufs, set(mod._non_persistent_buffers_set)))
    for opt in optimizers:
        groups = [(g, g["params"], {k: copy.deepcopy(v) for k, v in g.items() if k != "params"})
                  for g in opt.param_groups]
        state = []
        for p, st in opt.state.items():
            state.append((p, {k: _save(v) if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                              for k, v in st.items()}))
        snap.optimizers.append(_OptSaved(opt, groups, state))
    if rng:
        snap.python_rng = random.getstate()
        np_random = _numpy_random()
        if np_random is not None:
            snap.numpy_rng = np_random.get_state()
        snap.torch_rng = torch.get_rng_state()
        if cuda and torch.cuda.is_available():
            snap.cuda_rng = torch.cuda.get_rng_state_all()
    if backends:
        snap.cudnn = _cudnn_flags()
        snap.grad_enabled = torch.is_grad_enabled()
    return snap


def _restore_module_params(mod: Any, saved: dict) -> None:
    mod._parameters.clear()
    mod._parameters.update(saved)


def _restore_param(ps: _ParamSaved, consume: bool) -> None:
    """The parameter's value, gradient and ``requires_grad``, in place where it can."""
    import torch

    p = ps.param
    _put_back(p, ps.data, consume)
    if ps.grad is None:
        p.grad = None
    elif (p.grad is not None and p.grad.device == ps.grad.device
          and p.grad.dtype == ps.grad.dtype and p.grad.shape == ps.grad.value.shape):
        with torch.no_grad():
            p.grad.copy_(ps.grad.value)
    else:
        p.grad = _restored(ps.grad, consume)
    p.requires_grad_(ps.data.requires_grad)


def _restore_buffers(mod: Any, bufs: dict, non_persistent: set, consume: bool) -> None:
    mod._buffers.clear()
    for name, (b, saved) in bufs.items():
        if b is not None and saved is not None:
            _put_back(b, saved, consume)
        mod._buffers[name] = b
    mod._non_persistent_buffers_set.clear()
    mod._non_persistent_buffers_set.update(non_persistent)


def _restore_optimizer(os_: _OptSaved) -> None:
    """The optimizer's param groups (the same dict objects) and its state."""
    opt = os_.optimizer
    groups = []
    for g, params, other in os_.groups:
        g.clear()
        g.update(copy.deepcopy(other))
        g["params"] = params
        groups.append(g)
    opt.param_groups[:] = groups
    opt.state.clear()
    for p, st in os_.state:
        opt.state[p] = {
            k: (v.value.to(device=v.device, dtype=v.dtype, copy=True)
                if isinstance(v, _Saved) else copy.deepcopy(v))
            for k, v in st.items()}


def _restore_globals(snap: Snapshot, attempt: Callable[..., None]) -> None:
    """The RNG states, cuDNN flags and grad mode, each part through ``attempt``."""
    import torch

    if snap.python_rng is not None:
        attempt(random.setstate, snap.python_rng)
    if snap.numpy_rng is not None:
        np_random = _numpy_random()
        if np_random is not None:
            attempt(np_random.set_state, snap.numpy_rng)
    if snap.torch_rng is not None:
        attempt(torch.set_rng_state, snap.torch_rng)
    if snap.cuda_rng is not None:
        attempt(torch.cuda.set_rng_state_all, snap.cuda_rng)
    if snap.cudnn is not None:
        for k, v in snap.cudnn.items():
            attempt(setattr, torch.backends.cudnn, k, v)
    if snap.grad_enabled is not None:
        attempt(torch.set_grad_enabled, snap.grad_enabled)


def restore(snap: Snapshot, *, consume: bool = False) -> None:
    """Put back everything ``snap`` recorded.

    Every part is attempted even when one fails; the first failure is raised at the end.
    ``consume=True`` lets tensors that go back to the host take the snapshot's own copies
    instead of new ones (no second host copy of a CPU model); ``snap`` must not be restored
    again afterwards.
    """
    errors: list[BaseException] = []

    def attempt(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - collected, first one re-raised below
            errors.append(exc)

    for mod, saved in snap.module_params:
        attempt(_restore_module_params, mod, saved)
    for ps in snap.params:
        attempt(_restore_param, ps, consume)
    for mod, bufs, non_persistent in snap.buffers:
        attempt(_restore_buffers, mod, bufs, non_persistent, consume)
    for mod, training in snap.modes:
        attempt(setattr, mod, "training", training)
    for os_ in snap.optimizers:
        attempt(_restore_optimizer, os_)
    _restore_globals(snap, attempt)
    if errors:
        raise errors[0]
