"""Host tensors and device checks on the simulated cluster, as CUDA has them.

Every tensor of the simulator is a fake CPU tensor; which device it is on (a virtual card or
the host) is the ledger's record. During the training step this module makes the records
follow what would happen on CUDA cards:

- **Where a new tensor lands.** A factory call (``torch.arange``, ``zeros``, ``tensor``...)
  with no ``device`` makes a host tensor (not charged to any card), as on CUDA, unless
  ``torch.set_default_device`` chose another default. With a device it lands on a card:
  ``"cuda"`` on the card that runs, ``"cuda:k"`` on card k, and a ``torch.device("cpu")``
  object also on the card that runs, since that is what a card tensor's ``.device`` reads on
  the simulated cluster (``device=x.device`` is the common way to ask for x's card). Only the
  *string* ``"cpu"`` names the host. ``.to(device)``, ``.to(other)``, ``.cuda()`` and
  ``.cpu()`` copy between the host and a card by the same rules.
- **Mixing.** An op that takes a host tensor of one or more dimensions together with a card
  tensor raises what CUDA's ``TensorIterator`` raises ("Expected all tensors to be on the same
  device, but found at least two devices, cuda:0 and cpu!"), with the op named. As on CUDA,
  0-dim host tensors (``torch.tensor(0.5)``) mix freely, and copies (``copy_``, ``_to_copy``),
  indexing with host indices and packed sequences' host ``batch_sizes`` are allowed.

What is not modelled: a tensor made with the explicit object ``torch.device("cpu")`` is taken
as the running card's (see above); ops between two different cards are not checked (the
simulator's own DataParallel copies do that on purpose).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, NamedTuple, Optional, Protocol, Sequence

import torch

from dptune import _torch_private
from dptune.step import tree as _tree
from dptune.errors import DptuneError, InternalError

__all__ = ["HOST", "DeviceMismatchError", "InputCard", "Placement", "check_devices", "device_mode",
           "input_cards"]

HOST = -1                              # "card" of tensors on the host: not charged


class Placement(Protocol):
    """What the device rules need from the simulator's ledger."""

    n: int                              # number of virtual cards
    as_cuda: bool                       # the step runs: CUDA's device rules apply

    def card_of(self, t: torch.Tensor) -> int: ...

    def running_card(self) -> int: ...

    def forced(self, card: int, category: Optional[str] = None) -> ContextManager[Any]: ...


class DeviceMismatchError(RuntimeError):
    """What CUDA raises for an op given tensors on two devices (the user's error)."""


def _name(card: int) -> str:
    return "cpu" if card == HOST else f"cuda:{card}"


# ops that take tensors on several devices on CUDA (FakeTensor's own multi-device ops, the
# copies, and the ops whose CPU arguments CUDA requires or accepts)
_ANY_DEVICE = frozenset({
    "copy", "copy_", "_copy_from", "_copy_from_and_resize", "_to_copy", "slice_scatter",
    "diagonal_scatter", "_foreach_copy", "_foreach_copy_", "lift", "lift_fresh",
    "lift_fresh_copy", "set_", "_local_scalar_dense", "_pack_padded_sequence",
    "_pad_packed_sequence", "lstm", "gru", "rnn_tanh", "rnn_relu", "tensor_split",
    "_assert_tensor_metadata", "is_same_size", "_has_same_storage_numel",
})
# indexing: the indices (argument 1) may be host tensors on CUDA
_INDEXING = frozenset({"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
                       "_unsafe_index_put"})


@functools.lru_cache(maxsize=None)
def _check_kind(func: Any) -> tuple[str, int]:
    """``(name, kind)`` of an op for :func:`check_devices`: kind 0 not checked (any device),
    1 indexing (argument 1 may be on the host), 2 checked."""
    op = getattr(func, "__name__", str(func))
    packet = op.split(".")[0]
    return op, 0 if packet in _ANY_DEVICE else 1 if packet in _INDEXING else 2


def _tensors(args: Any) -> Any:
    """The tensors of an aten op's arguments: tensors and lists (tuples) of them."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _tensors(a)


class InputCard(NamedTuple):
    """One tensor argument of an aten op, where it was given and where it is."""

    position: int                   # its argument's position (-1: a keyword argument)
    tensor: torch.Tensor
    card: int


def input_cards(args: Sequence[Any], kwargs: Optional[dict], where: Placement) -> list[InputCard]:
    """Every tensor of an aten op's arguments (tensors and lists of them), in order, with its
    card: looked up once per op, for the check and for the charge of its outputs."""
    card_of = where.card_of
    found = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            found.append(InputCard(i, a, card_of(a)))
        elif isinstance(a, (list, tuple)):
            found += [InputCard(i, t, card_of(t)) for t in _tensors(a)]
    if kwargs:
        found += [InputCard(-1, t, card_of(t)) for t in _tensors(kwargs.values())]
    return found


def check_devices(func: Any, args: Sequence[Any], kwargs: Optional[dict], where: Placement,
                  cards: Optional[list[InputCard]] = None) -> None:
    """Raise :class:`DeviceMismatchError` where CUDA would: ``func`` given a host tensor of
    one or more dimensions and a card tensor (``args`` and ``kwargs`` as an aten op gets
    them: tensors and lists of tensors; ``cards``: :func:`input_cards` of them, if known)."""
    op, kind = _check_kind(func)
    if kind == 0:
        return
    first: Optional[int] = None
    for pos, t, card in input_cards(args, kwargs, where) if cards is None else cards:
        if kind == 1 and pos == 1:
            continue                    # indices: host tensors allowed
        if card == HOST and t.dim() == 0:
            continue                    # a CPU scalar: CUDA kernels take it as a number
        if first is None:
            first = card
        elif (card == HOST) != (first == HOST):
            raise DeviceMismatchError(
                "Expected all tensors to be on the same device, but found at least two devices, "
                f"{_name(first)} and {_name(card)}! (aten.{op}, as CUDA raises it: a tensor made "
                "without device= is on the host; make it with device=x.device or move it with "
                ".to(x.device))")


# torch functions that make a new tensor and take device=
_FACTORIES = ("arange", "range", "linspace", "logspace", "zeros", "ones", "empty", "full", "rand",
              "randn", "randint", "randperm", "eye", "tensor", "as_tensor", "asarray",
              "empty_strided", "scalar_tensor", "tril_indices", "triu_indices", "zeros_like",
              "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
              "bartlett_window", "blackman_window", "hamming_window", "hann_window",
              "kaiser_window", "normal", "complex", "polar", "sparse_coo_tensor", "from_file")
_NO_DEVICE = object()


def _target(where: Placement, device: Any) -> Optional[int]:
    """The card (or :data:`HOST`) a device argument names; ``None``: not a host or card device
    (e.g. ``"meta"``), left alone."""
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device if 0 <= device < where.n else where.running_card()
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError:
            return None
        if dev.type == "cpu":
            return HOST                 # the string "cpu": the host
    elif isinstance(device, torch.device):
        dev = device
        if dev.type == "cpu":
            return where.running_card()  # what a card tensor's .device reads here
    else:
        return None
    if dev.type != "cuda":
        return None
    if dev.index is not None and 0 <= dev.index < where.n:
        return dev.index
    return where.running_card()


def _on_cpu(device: Any) -> Any:
    """``device`` with a CUDA device replaced by the CPU (every fake tensor here is a CPU one)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


@dataclass
class _Placed:
    """Where a factory call or a copy puts its result: ``card`` (or :data:`HOST`), the call's
    arguments with a CUDA device replaced by the CPU, and the tensor being copied (``.to``,
    ``.cuda()``, ``.cpu()``), which is cloned when the CPU build makes no copy but a card would."""

    card: int
    args: list
    kwargs: dict
    source: Optional[torch.Tensor] = None


def _guarded(fn: Callable[..., Optional[_Placed]]) -> Callable[..., Optional[_Placed]]:
    """A failure in dptune's own placement logic is dptune's, never the user's."""
    @functools.wraps(fn)
    def run(*args: Any) -> Optional[_Placed]:
        try:
            return fn(*args)
        except DptuneError:
            raise
        except Exception as e:
            raise InternalError(
                f"dptune's simulator failed placing a new tensor on a card or the host "
                f"({type(e).__name__}: {e}); this is a bug in dptune, not in your model: please "
                "report it with the model that shows it") from e
    return run


def _place_factory(where: Placement, args: list, kwargs: dict) -> Optional[_Placed]:
    """Where a factory call (``torch.zeros``, ``arange``...) puts its tensor; ``None``: where
    torch puts it (on the device of a tensor it is given, or a device that is no card)."""
    device = kwargs.get("device", _NO_DEVICE)
    if device is _NO_DEVICE or device is None:
        if any(True for _ in _tree.leaves((args, kwargs))):
            return None          # zeros_like(x), tensor(x): on x's device
        default = torch.get_default_device()
        return _Placed(HOST if default.type == "cpu" else where.running_card(), args, kwargs)
    card = _target(where, device)
    if card is None:
        return None
    return _Placed(card, args, {**kwargs, "device": _on_cpu(device)})


def _place_copy(where: Placement, func: Any, args: list, kwargs: dict) -> Optional[_Placed]:
    """Where ``t.cpu()``, ``t.cuda(...)`` or ``t.to(...)`` puts its copy; ``None``: not a move
    between the host and a card (``.to(dtype)``, another device type)."""
    t = args[0]
    if func is _CPU:
        return _Placed(HOST, [t], {}, t)
    if func is _CUDA:
        device = kwargs.get("device", args[1] if len(args) > 1 else None)
        card = _target(where, "cuda" if device is None else device)
        return None if card is None else _Placed(card, [t], {}, t)
    spec = args[1] if len(args) > 1 else kwargs.get("device", kwargs.get("other"))
    if isinstance(spec, torch.Tensor):       # to(other): other's device and dtype
        return _Placed(where.card_of(spec), args, kwargs, t)
    if spec is None or isinstance(spec, torch.dtype):
        return None
    card = _target(where, spec)
    if card is None:
        return None
    if len(args) > 1:
        args = [t, _on_cpu(spec), *args[2:]]
    else:
        kwargs = {**kwargs, "device": _on_cpu(spec)}
    return _Placed(card, args, kwargs, t)


_TO, _CUDA, _CPU = torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu


def device_mode(where: Placement) -> Any:
    """A torch-function mode that places new tensors and copies as CUDA would (module docstring).

    It must be entered before (outside) other torch-function modes of the simulator, so that
    it also sees the factory calls those make.
    """
    base = _torch_private.function_mode_base()
    factories = {getattr(torch, n) for n in _FACTORIES if hasattr(torch, n)}
    to, cuda, cpu = _TO, _CUDA, _CPU
    changed = factories | {to, cuda, cpu}     # the functions place() may change

    @_guarded
    def place(func: Any, args: list, kwargs: dict) -> Optional[_Placed]:
        if func in factories:
            return _place_factory(where, args, kwargs)
        if not (func is to or func is cuda or func is cpu) or not isinstance(args[0], torch.Tensor):
            return None
        return _place_copy(where, func, args, kwargs)

    class _DeviceMode(base):  # type: ignore[misc, valid-type]
        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                               kwargs: Optional[dict] = None) -> Any:
            kwargs = kwargs or {}
            if func not in changed or not where.as_cuda:   # the common case: not ours
                return func(*args, **kwargs)
            placed = place(func, list(args), dict(kwargs))
            if placed is None:
                return func(*args, **kwargs)
            with where.forced(placed.card):
                if func is cpu or func is cuda:   # ``.to()`` without a device: no copy
                    out = placed.source
                else:
                    out = func(*placed.args, **placed.kwargs)
                source = placed.source
                if source is not None and out is source and where.card_of(source) != placed.card:
                    out = source.clone()          # the CPU build made no copy; a card would
            return out

    return _DeviceMode()
