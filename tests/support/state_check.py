"""Test helpers for :mod:`dptune.step.state`: compare the present with a snapshot.

``differences(snap)`` lists what differs from what :func:`dptune.step.state.snapshot` recorded
(empty when everything is as it was); ``preserved(model)`` snapshots on enter and restores on
exit. Only tests use them, so they live here, not in the package.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator, Optional, Sequence

import torch

from dptune.step.state import Snapshot, _cudnn_flags, _numpy_random, _Saved, restore, snapshot


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

    Compares what :func:`restore` would put back.
    """
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
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False
