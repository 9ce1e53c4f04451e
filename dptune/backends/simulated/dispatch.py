"""The dispatch mode that charges every new storage an aten op makes to a virtual card.

Each op's outputs land where CUDA would put them: on the card of its first input on a card, on
the host if all its inputs are there, where the code runs for a factory op, or on the card a
copy between cards is forced to (:mod:`dptune.backends.simulated.ledger` keeps the records).
While the step runs, CUDA's device check applies (:mod:`dptune.backends.simulated.device_rules`),
and ops the fake kernels let through or refuse unlike CUDA are made to act as CUDA does
(operands of two dtypes in a matrix op, ``aten._grouped_mm`` on fp32/fp16). Ops whose output
size depends on tensor values are noted for the estimate's notes.

:class:`_FunctionModes` enters the simulator's torch-function modes (device rules, attention)
as one, so that backward hooks can re-enter them around autograd's nodes.
"""

from __future__ import annotations

import contextlib
import functools
from itertools import chain
from typing import Any, Iterator, NamedTuple, Optional

import torch

from dptune.step import tree as _tree
from dptune._torch_private import (bound_size, dispatch_mode_base, no_dispatch_modes, no_function_modes,
                                   private_op)
from dptune.backends.simulated.device_rules import (HOST, DeviceMismatchError, InputCard, check_devices,
                                                    input_cards)
from dptune.backends.simulated.errors import _internal
from dptune.backends.simulated.index_bounds import IndexBounds, IndexOutOfRangeError
from dptune.backends.simulated.index_bounds import kind as _bounds_kind
from dptune.backends.simulated.ledger import _Ledger
from dptune.backends.simulated.scratch import bound_bytes, scratch_bytes, scratch_kind

__all__: list[str] = []


class _FunctionModes:
    """The simulator's torch-function modes entered as one (outermost first); re-entered
    around backward nodes, which autograd runs without them."""

    def __init__(self, *modes: Any):
        self.modes = modes
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> "_FunctionModes":
        stack = contextlib.ExitStack()
        for mode in self.modes:
            stack.enter_context(mode)
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().__exit__(*exc)



# aten ops whose output size depends on the input's values
_DATA_DEPENDENT = {"nonzero", "nonzero_static", "masked_select", "index", "unique", "_unique",
                   "_unique2", "unique_consecutive", "unique_dim", "repeat_interleave", "bincount",
                   "masked_scatter", "argwhere"}


def _symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) for d in t.shape)


def _note_data_dependent(ledger: _Ledger, func: Any, args: Any, out: Any) -> None:
    """Remember ops that read tensor values: a size that depends on them, or ``.item()``."""
    name = getattr(func, "__name__", str(func))
    if name.startswith("_local_scalar_dense"):
        read = next(iter(_tree.leaves(args)), None)
        if read is not None and ledger.card_of(read) != HOST:   # not a host scalar such as
            ledger.bounded["value read as a Python number (.item(), int(t), float(t))"] = (
                "kept symbolic")                                 # AdamW's step, read on CUDA too
        return
    if name.split(".")[0] not in _DATA_DEPENDENT:
        return
    outs = [t for t in _tree.leaves(out) if _symbolic(t)]
    if not outs or any(_symbolic(t) for t in _tree.leaves(args)):
        return
    numel = [t.numel() for t in _tree.leaves(args) if not _symbolic(t)]
    ledger.bounded[f"aten.{name.split('.')[0]}"] = (
        f"sized as if all of its up to {max(numel) if numel else '?'} elements were selected")


# matrix ops whose two operands CUDA requires in one dtype: op name -> their positions
# (convolutions already refuse mixed dtypes under the fake mode, as on CUDA)
_SAME_DTYPE = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "addbmm": (1, 2),
               "mv": (0, 1), "addmv": (1, 2)}


def _check_dtypes_as_cuda(func: Any, args: Any) -> None:
    """Raise what CUDA raises for operands of two dtypes (an fp16 batch into an fp32 layer),
    which the fake kernels let through."""
    pos = _SAME_DTYPE.get(getattr(func, "__name__", "").split(".")[0])
    if pos is None or len(args) <= max(pos):
        return
    a, b = args[pos[0]], args[pos[1]]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
        op = getattr(func, "__name__", str(func))
        raise RuntimeError(f"expected mat1 and mat2 to have the same dtype, but got: {a.dtype} != "
                           f"{b.dtype} (aten.{op}, as CUDA raises it)")


_LIFTS = {"lift", "lift_fresh", "lift_fresh_copy"}   # the data of torch.tensor(...) made fake


def _call_as_cuda(func: Any, args: Any, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` on fake tensors, where torch's fake kernel refuses what CUDA
    runs: ``aten._grouped_mm`` (a HF mixture of experts' expert layers) takes fp32 and fp16 on
    CUDA since torch 2.9 (through its fallback kernel), but its meta kernel still asks for
    bf16. The output's shape comes from the meta kernel on bf16 stand-ins of the same shapes,
    its dtype is ``out_dtype`` or the operands' (as the fallback makes it)."""
    if func is _GROUPED_MM and func is not None:
        a, b = args[0], args[1]
        if a.dtype in _GROUPED_MM_FALLBACK and a.dtype == b.dtype:
            def stand_in(x: Any) -> Any:
                if not isinstance(x, torch.Tensor):
                    return x
                dtype = torch.bfloat16 if x.is_floating_point() else x.dtype
                return torch.empty(x.shape, dtype=dtype, device="meta")   # only the shape counts

            # out_dtype (position 4, or by name) must be bf16 for the meta kernel: left out
            # of the stand-in call, applied to the output as the fallback applies it
            out_dtype = args[4] if len(args) > 4 else kwargs.get("out_dtype")
            plain = [stand_in(x) for x in args[:4]]
            named = {k: stand_in(v) for k, v in kwargs.items() if k != "out_dtype"}
            with no_dispatch_modes():
                shape = func(*plain, **named).shape
            return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)
    out = func(*args, **kwargs)
    if func is _PACK_PADDED and func is not None:
        # batch_sizes has one entry per step up to the longest length, a value: at most the
        # padded input's longer dimension (the fake kernel sizes the packed data by the steps
        # alone, not by the sum of the lengths, so that is charged short)
        x = args[0]
        bound_size(out[1].shape[0], max(x.shape[0], x.shape[1]))
    return out


_GROUPED_MM_FALLBACK = (torch.float32, torch.float16)
_GROUPED_MM = private_op("_grouped_mm")                  # None on a torch without it
_PACK_PADDED = private_op("_pack_padded_sequence")


class _OpFacts(NamedTuple):
    """What the dispatch needs to know of an aten op, worked out once per op."""

    name: str                       # e.g. "add.Tensor"
    lift: bool                      # a factory of torch.tensor's data: lands where code runs
    data_dependent: bool            # its output size depends on values (_DATA_DEPENDENT)
    reads_value: bool               # _local_scalar_dense: .item()
    same_dtype: Optional[tuple[int, int]]   # operands CUDA requires in one dtype
    sets_storage: bool              # set_: an input gets another storage
    unlike_cuda: bool               # the fake kernel acts unlike CUDA's (_call_as_cuda)
    scratch: Optional[str]          # CUDA's kernel allocates scratch (simulated.scratch)
    bounds: int                     # 1: its integer output's bound followed, 2: indices checked


@functools.lru_cache(maxsize=None)
def _op_facts(func: Any) -> _OpFacts:
    name = getattr(func, "__name__", str(func))
    packet = name.split(".")[0]
    return _OpFacts(name, packet in _LIFTS, packet in _DATA_DEPENDENT,
                    name.startswith("_local_scalar_dense"), _SAME_DTYPE.get(packet),
                    packet in ("set_", "set", "swap_"),
                    any(func is op for op in (_GROUPED_MM, _PACK_PADDED) if op is not None),
                    scratch_kind(packet), _bounds_kind(func))


def _arg_tensors(args: Any) -> Iterator[torch.Tensor]:
    """The tensors of an aten op's arguments or outputs: tensors and lists (tuples) of
    tensors, which is all an aten schema holds (no walk of dicts or dataclasses)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    yield x
                elif isinstance(x, (list, tuple)):
                    yield from _arg_tensors(x)


def _output_card(ledger: _Ledger, facts: _OpFacts, args: Any, kwargs: Any,
                 cards: Optional[list[InputCard]]) -> int:
    """The card an op's outputs land on: the card copies are forced to, else the card of its
    first input on a card; the host if all its inputs are there; where code runs for a
    factory op (lift_fresh: the data of torch.tensor) or an op without tensor inputs.
    ``cards``: the inputs' cards, if looked up before the op (for the device check)."""
    card = ledger.forced_card
    if card is not None:
        return card
    card, inputs = HOST, False
    if facts.lift:
        pass
    elif cards is not None:        # looked up before the op, for the device check
        inputs = bool(cards)
        card = next((c.card for c in cards if c.card != HOST), HOST)
    else:
        card_of = ledger.card_of
        for t in chain(_arg_tensors(args), _arg_tensors(kwargs.values()) if kwargs else ()):
            inputs = True
            c = card_of(t)
            if c != HOST:
                card = c
                break
    if card != HOST:
        ledger.last_card = card
    elif not inputs:
        card = ledger.running_card()
    return card


@_internal("the ledger (charging an op's outputs to a card)")
def _account(ledger: _Ledger, func: Any, facts: _OpFacts, args: Any, kwargs: Any, out: Any,
             cards: Optional[list[InputCard]]) -> None:
    """Charge the new storages of an op's outputs to their card (:func:`_output_card`)."""
    if facts.data_dependent or facts.reads_value:
        _note_data_dependent(ledger, func, args, out)
    card = _output_card(ledger, facts, args, kwargs, cards)
    category = ledger.category
    if isinstance(out, torch.Tensor):
        ledger.charge(out, card, category)
    elif isinstance(out, (list, tuple)):
        for t in _arg_tensors(out):
            ledger.charge(t, card, category)
    if facts.scratch is not None and ledger.as_cuda and ledger.scratch:
        ledger.transient(card, scratch_bytes(facts.scratch, facts.name.split(".")[0], args, out),
                         bound_bytes(facts.scratch, facts.name.split(".")[0], args, out))
    if ledger.observer is not None:
        ledger.observer(func, args, kwargs, out, card)
        if ledger.mirrors(card):
            _observe_mirrored(ledger, func, args, kwargs, out)


def _observe_mirrored(ledger: _Ledger, func: Any, args: Any, kwargs: Any, out: Any) -> None:
    """The op again as card 0's replica runs it (``ledger.mirror``): on card 0, a copy made
    onto card 0."""
    assert ledger.mirror is not None and ledger.observer is not None
    src, dst = ledger.mirror
    forced = ledger.forced_card
    if forced == src:
        ledger.forced_card = dst
    try:
        ledger.observer(func, args, kwargs, out, dst)
    finally:
        ledger.forced_card = forced


@_internal("the device check (host and card tensors in one op)", DeviceMismatchError)
def _checked_cards(ledger: _Ledger, func: Any, args: Any, kwargs: Any) -> list[InputCard]:
    """The cards of an op's tensor arguments, after CUDA's device check of them."""
    cards = input_cards(args, kwargs, ledger)
    check_devices(func, args, kwargs, ledger, cards)
    return cards


_DEVICE_QUERY = torch.ops.prim.device.default   # a tensor's .device, asked by C++ code


@_internal("the ledger (a tensor's device asked)")
def _device_query(ledger: _Ledger, func: Any, args: Any) -> Any:
    """``prim.device`` (autograd and the dispatcher ask a fake tensor's device; most ops of a
    step are these): what :func:`_account` does for it, without the rest of an op's path. It
    makes no storage and no device check can fail on one tensor; only the card last computed
    on follows the tensor asked (as :func:`_output_card` makes it)."""
    if ledger.forced_card is None:
        card = ledger.card_of(args[0])
        if card != HOST:
            ledger.last_card = card
    with no_function_modes():
        return func(*args)


def _make_accountant(ledger: _Ledger) -> Any:
    """The dispatch mode that charges every new storage to a card of ``ledger`` (module
    docstring)."""
    base = dispatch_mode_base()
    bounds = IndexBounds()          # integer tensors' known values: indices past a table raise
    check_indices = _internal("the index bounds (indices past a table)", IndexOutOfRangeError)(bounds.check)
    follow_bounds = _internal("the index bounds (an integer tensor's values)")(bounds.after)

    class _Accountant(base):  # type: ignore[misc, valid-type]
        """Charges every new storage an op makes to a virtual card."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is _DEVICE_QUERY and not kwargs and ledger.observer is None:
                return _device_query(ledger, func, args)
            # below the torch-function modes (device rules, attention): every tensor method
            # that dptune's ledger or the fake mode calls here would pass through them
            with no_function_modes():
                return self._dispatch(func, args, kwargs)

        def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
            facts = _op_facts(func)
            if facts.same_dtype is not None:
                _check_dtypes_as_cuda(func, args)
            cards = None
            if ledger.as_cuda and ledger.forced_card is None:
                cards = _checked_cards(ledger, func, args, kwargs)
            if facts.bounds == 2:
                check_indices(func, args)
            out = _call_as_cuda(func, args, kwargs or {}) if facts.unlike_cuda else func(*args, **(kwargs or {}))
            if facts.bounds == 1:
                follow_bounds(func, args, kwargs, out)
            # set_ gives its input another storage: where it is is looked up again
            _account(ledger, func, facts, args, kwargs, out, None if facts.sets_storage else cards)
            return out

    return _Accountant()

