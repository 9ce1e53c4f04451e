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

import contextlib
import copy
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Snapshot", "snapshot", "restore", "preserved", "differences"]


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
    """What :func:`snapshot` recorded; pass it to :func:`restore` or :func:`differences`."""

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


def restore(snap: Snapshot, *, consume: bool = False) -> None:
    """Put back everything ``snap`` recorded.

    Every part is attempted even when one fails; the first failure is raised at the end.
    ``consume=True`` lets tensors that go back to the host take the snapshot's own copies
    instead of new ones (no second host copy of a CPU model); ``snap`` must not be restored
    again afterwards.
    """
    import torch

    errors: list[BaseException] = []

    def attempt(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - collected, first one re-raised below
            errors.append(exc)

    def restore_module_params(mod: Any, saved: dict) -> None:
        mod._parameters.clear()
        mod._parameters.update(saved)

    def restore_param(ps: _ParamSaved) -> None:
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

    def restore_buffers(mod: Any, bufs: dict, non_persistent: set) -> None:
        mod._buffers.clear()
        for name, (b, saved) in bufs.items():
            if b is not None and saved is not None:
                _put_back(b, saved, consume)
            mod._buffers[name] = b
        mod._non_persistent_buffers_set.clear()
        mod._non_persistent_buffers_set.update(non_persistent)

    def restore_optimizer(os_: _OptSaved) -> None:
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

    for mod, saved in snap.module_params:
        attempt(restore_module_params, mod, saved)
    for ps in snap.params:
        attempt(restore_param, ps)
    for mod, bufs, non_persistent in snap.buffers:
        attempt(restore_buffers, mod, bufs, non_persistent)
    for mod, training in snap.modes:
        attempt(setattr, mod, "training", training)
    for os_ in snap.optimizers:
        attempt(restore_optimizer, os_)
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
    if errors:
        raise errors[0]


@contextlib.contextmanager
def preserved(model: Optional["torch.nn.Module"] = None, *, optimizers: Sequence[Any] = (),
              cuda: bool = False) -> Iterator[Snapshot]:
    """Snapshot on enter, restore on exit, whatever happens inside (exceptions included).

    >>> with preserved(model):
    ...     model.cuda(); train_one_step(model)
    >>> # model is back on its device, with its weights, grads and mode; RNGs as before
    """
    snap = snapshot(model, optimizers=optimizers, cuda=cuda)
    try:
        yield snap
    finally:
        restore(snap)


def _same(t: Any, saved: _Saved) -> Optional[str]:
    if t.device != saved.device:
        return f"device {t.device} != {saved.device}"
    if t.dtype != saved.dtype:
        return f"dtype {t.dtype} != {saved.dtype}"
    if t.shape != saved.value.shape:
        return f"shape {tuple(t.shape)} != {tuple(saved.value.shape)}"
    import torch

    cur = t.detach().to("cpu")
    if torch.equal(cur, saved.value):
        return None
    # NaNs compare unequal to themselves: bit-identical tensors are still the same.
    if cur.is_floating_point():
        def bits(x: Any) -> Any:
            return x.reshape(-1).contiguous().view(torch.uint8)
        if torch.equal(bits(cur), bits(saved.value)):
            return None
    return "values differ"


def differences(snap: Snapshot) -> list[str]:
    """What differs now from ``snap`` (empty when everything is as recorded).

    Compares what :func:`restore` would put back; meant for tests and debug checks.
    """
    import torch

    out: list[str] = []
    names = {}
    if snap.model is not None:
        names = {id(p): n for n, p in snap.model.named_parameters(remove_duplicate=False)}
    for mod, saved in snap.module_params:
        if set(mod._parameters) != set(saved) or any(
                mod._parameters.get(k) is not v for k, v in saved.items()):
            out.append(f"{type(mod).__name__}._parameters entries changed")
    for ps in snap.params:
        name = names.get(id(ps.param), "<param>")
        why = _same(ps.param, ps.data)
        if why:
            out.append(f"{name}: {why}")
        if bool(ps.param.requires_grad) != ps.data.requires_grad:
            out.append(f"{name}: requires_grad changed")
        if ps.grad is None:
            if ps.param.grad is not None:
                out.append(f"{name}.grad: was None")
        elif ps.param.grad is None:
            out.append(f"{name}.grad: is None, was set")
        else:
            why = _same(ps.param.grad, ps.grad)
            if why:
                out.append(f"{name}.grad: {why}")
    for mod, bufs, _ in snap.buffers:
        if set(mod._buffers) != set(bufs):
            out.append(f"{type(mod).__name__}: buffer names changed")
        for bname, (b, saved) in bufs.items():
            if mod._buffers.get(bname) is not b:
                out.append(f"{type(mod).__name__}.{bname}: buffer object replaced")
            elif b is not None and saved is not None:
                why = _same(b, saved)
                if why:
                    out.append(f"{type(mod).__name__}.{bname}: {why}")
    for mod, training in snap.modes:
        if mod.training != training:
            out.append(f"{type(mod).__name__}: training={mod.training}, was {training}")
    for os_ in snap.optimizers:
        opt = os_.optimizer
        if len(opt.state) != len(os_.state):
            out.append(f"{type(opt).__name__}: state has {len(opt.state)} entries, had {len(os_.state)}")
        for p, st in os_.state:
            cur = opt.state.get(p)
            if cur is None:
                out.append(f"{type(opt).__name__}: state of a parameter missing")
                continue
            for k, v in st.items():
                if isinstance(v, _Saved):
                    why = _same(cur.get(k), v) if isinstance(cur.get(k), torch.Tensor) else "not a tensor"
                    if why:
                        out.append(f"{type(opt).__name__}.state[{k}]: {why}")
                elif cur.get(k) != v:
                    out.append(f"{type(opt).__name__}.state[{k}] changed")
        for g, params, other in os_.groups:
            if g.get("params") is not params or any(
                    not _eq(g.get(k), v) for k, v in other.items()):
                out.append(f"{type(opt).__name__}: param group changed")
    if snap.python_rng is not None and random.getstate() != snap.python_rng:
        out.append("python random state changed")
    if snap.numpy_rng is not None:
        np_random = _numpy_random()
        if np_random is not None:
            cur = np_random.get_state()
            if cur[0] != snap.numpy_rng[0] or not (cur[1] == snap.numpy_rng[1]).all() or \
                    tuple(cur[2:]) != tuple(snap.numpy_rng[2:]):
                out.append("numpy random state changed")
    if snap.torch_rng is not None and not torch.equal(torch.get_rng_state(), snap.torch_rng):
        out.append("torch CPU RNG state changed")
    if snap.cuda_rng is not None:
        cur_cuda = torch.cuda.get_rng_state_all()
        if len(cur_cuda) != len(snap.cuda_rng) or any(
                not torch.equal(a, b) for a, b in zip(cur_cuda, snap.cuda_rng)):
            out.append("CUDA RNG state changed")
    if snap.cudnn is not None and _cudnn_flags() != snap.cudnn:
        out.append(f"cudnn flags {_cudnn_flags()} != {snap.cudnn}")
    if snap.grad_enabled is not None and torch.is_grad_enabled() != snap.grad_enabled:
        out.append("grad mode changed")
    return out


def _eq(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False
