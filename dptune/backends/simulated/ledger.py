"""The simulated cluster: per-card memory of a DataParallel training step, without GPUs.

The user's real model runs under ``FakeTensorMode`` on the CPU: shapes, dtypes, storages and
autograd are real, but no arithmetic is done and no memory of the model's size is taken. A
dispatch mode sees every new storage and charges it to the virtual card that makes it:

- an op's outputs live where its inputs live (as on real devices); in the step, a factory call
  (``arange``, ``zeros``...) makes a host tensor unless it names a device, as on CUDA, and an
  op that mixes a host tensor (other than a 0-dim one) with a card tensor raises CUDA's error
  (:mod:`dptune.backends.simulated.device_rules`); the user's loss function gets the batch on the output
  card, as the CUDA backend gives it;
- DataParallel's copies are explicit, autograd-aware moves between cards: the scatter of the
  input chunks, the broadcast of the weights to cards 1..n-1 (and, in the backward, the
  reduction of every replica's gradients onto card 0), the gather of the outputs onto card 0
  (and, in the backward, the scatter of their gradient). Cards that would run the same
  replica are simulated once (the ledger's ``sharing`` plan: :mod:`dptune.backends.simulated.sharing`).

A storage is freed when Python frees it, so what autograd saves stays alive and what it does
not (a replica's weights not needed by the backward, say) is freed after the forward, exactly
as on a GPU. Peaks are per card over the whole step. Sizes are rounded up to multiples of
512 bytes as the CUDA caching allocator rounds them, so a peak compares with
``torch.cuda.max_memory_allocated`` after a warm-up step and ``reset_peak_memory_stats``.

One simulated probe is a steady-state training step: master weights and buffers on card 0,
the optimizer's state already created (as after a warm-up step), gradients set to ``None``
(as after ``zero_grad()``), then the workload's step (:func:`dptune.workload.run_step`:
forward, loss, backward per micro-batch, clipping, ``optimizer.step()``; or the user's own
step function, which gets the DataParallel-wrapped model).

Known limitations (what is not modelled):

- cuDNN/cuBLAS workspace choice: one cuBLAS workspace per card that runs a replica
  (``Cluster.workspace_bytes``, 32 MiB on Hopper cards and 8 MiB on others, as torch's
  defaults) is charged as ``other``; cuDNN's per-algorithm workspaces are not.
- NCCL buffers, the CUDA context beyond the fixed ``context_bytes`` per card, fragmentation
  and reserved-but-free memory (``max_memory_reserved`` is larger than the peak given here;
  ``reserved=ReservedModel()`` predicts it: :mod:`dptune.backends.reserved`).
- The allocator's rounding of large blocks that it does not split (a few hundred KiB at most
  per block above 1 MiB).
- DataParallel's coalesced buckets: the broadcast and the gradient reduction are modelled per
  tensor; the transient flattened bucket buffers (10 MiB each) are not.
- Everything runs on the CPU in one thread. Where CUDA runs another kernel than the CPU
  build and keeps other tensors for the backward, the simulator runs CUDA's: attention
  (``F.scaled_dot_product_attention``) takes the kernel CUDA picks for the card's compute
  capability (:mod:`dptune.backends.simulated.sdpa`: flash, memory-efficient, cuDNN or math, through
  their meta kernels), and ``F.dropout`` keeps a boolean mask (``native_dropout``) as on
  CUDA. Each card has a compute capability from the card table, 8.0 for a card given by its
  size only (``cc=`` in the spec sets it); the estimate's notes say which kernels ran.
- ``torch.autocast("cuda")`` (in the built-in step with ``amp=``, or in the user's code)
  applies CUDA's casting rules, emulated as :mod:`dptune.backends.simulated.autocast` says (with where
  it differs from CUDA). Models whose forward reads tensor values (``.item()``, ``nonzero``,
  data-dependent shapes) cannot be simulated.
- Optimizers are stepped with ``foreach=True`` where they accept it (torch's default on
  CUDA), whatever the CPU default would be.
- The batch is built on the host (CPU) and scattered from there, unless ``batch_on_card0``.

This module is the bottom of the simulator: the ledger (which card holds each storage, live
bytes and peaks per card and category), the dispatch mode that charges every new storage to
a card under CUDA's rules, and DataParallel's copies between cards. Above it:
:mod:`~dptune.backends.simulated.fake_model` (the fake copy of the user's model),
:mod:`~dptune.backends.simulated.errors` (the user's exceptions, mapped) and
:mod:`~dptune.backends.simulated.backend` (:class:`SimulatedBackend`, :func:`estimate_memory`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from itertools import chain
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, TypeVar

import torch
import torch.nn as nn

from dptune import _tree
from dptune._torch_private import (bound_size, dispatch_mode_base, function_mode_active,
                                   no_dispatch_modes, no_function_modes, replica_module, sparse_parts, upper_bound)
from dptune.backends.base import CATEGORIES
from dptune.backends.simulated.device_rules import (HOST, DeviceMismatchError, InputCard, check_devices,
                                                    input_cards)
from dptune.backends.simulated.errors import _user_error
from dptune.backends.simulated.sharing import ReplicaPlan
from dptune.errors import BackendUnavailableError, DptuneError, InternalError, UsageError
from dptune.split import scale_split

__all__ = ["ROUND_BYTES", "FOLLOW"]

ROUND_BYTES = 512                     # the caching allocator's minimum block size
FOLLOW = -2                           # current card in the backward: the card last computed on
_STRIDED = torch.strided


# --------------------------------------------------------------------------------------------
# The ledger: which card holds each storage, live bytes and peaks per card and category.
# --------------------------------------------------------------------------------------------
def _rounded(nbytes: int) -> int:
    return -(-nbytes // ROUND_BYTES) * ROUND_BYTES


class _Record:
    __slots__ = ("card", "nbytes", "category", "ref", "seq")

    def __init__(self, card: int, nbytes: int, category: str, seq: int):
        self.card, self.nbytes, self.category, self.seq = card, nbytes, category, seq
        self.ref: Any = None


class _Ledger:
    """Live and peak bytes per virtual card, by category."""

    def __init__(self, n: int):
        self.n = n
        self.live = [0] * n
        self.peak = [0] * n
        self.by_cat = [dict.fromkeys(CATEGORIES, 0) for _ in range(n)]
        self.peak_breakdown = [dict(b) for b in self.by_cat]
        self._records: dict[int, _Record] = {}
        self._seq = 0                  # allocations so far
        self._peak_seq = [0] * n       # allocations made when each card reached its peak
        # what the dispatch mode consults
        self.current_card = HOST       # the replica running (factory ops go there), or FOLLOW
        self.last_card = 0             # the card of the last op that read a card's tensor
        self.forced_card: Optional[int] = None
        self.as_cuda = False           # the step runs: CUDA's device rules (simulated.device_rules)
        self.category = "other"
        self.bounded: dict[str, str] = {}   # data-dependent ops seen -> how their size was bounded
        # the allocator trace: (card, +/-bytes, seq, stream); stream 1: the scatter's copy stream
        self.on_event: Optional[Callable[[int, int, int, int], None]] = None
        self.stream = 0
        self.observer: Optional[Callable[..., None]] = None  # sees every op (backends.timing)
        # the step simulates one card per class of like cards (simulated.sharing), or all
        self.sharing: Optional[ReplicaPlan] = None

    # -- storages ------------------------------------------------------------------------
    def record_of(self, t: torch.Tensor) -> Optional[_Record]:
        if t.layout is not _STRIDED:
            parts = sparse_parts(t)
            return self.record_of(parts[0]) if parts else None
        st = t.untyped_storage()
        rec = self._records.get(id(st))
        if rec is not None and rec.ref() is st:
            return rec
        return None

    def card_of(self, t: torch.Tensor) -> int:
        if t.layout is not _STRIDED:
            rec = self.record_of(t)
            return HOST if rec is None else rec.card
        st = t.untyped_storage()
        rec = self._records.get(id(st))
        return rec.card if rec is not None and rec.ref() is st else HOST

    def charge(self, t: torch.Tensor, card: int, category: str) -> None:
        """Charge ``t``'s storage to ``card`` if it is not known yet (a sparse tensor: the
        storages of its indices and values)."""
        if t.layout != torch.strided:
            for part in sparse_parts(t):
                self.charge(part, card, category)
            return
        st = t.untyped_storage()
        key = id(st)
        old = self._records.get(key)
        if old is not None and old.ref() is st:
            return
        nbytes = st.nbytes()
        if not isinstance(nbytes, int):   # a size that depends on tensor values
            bound = upper_bound(nbytes)
            if bound is None:
                raise BackendUnavailableError(
                    f"a tensor's size depends on tensor values with no known bound ({nbytes} "
                    "bytes, e.g. torch.zeros(int(x.item()))); the simulated cluster computes no "
                    "values: tune on real GPUs (--devices), or give the size without reading values")
            nbytes = bound
        self._seq += 1
        rec = _Record(card, _rounded(nbytes), category, self._seq)
        records = self._records

        def release(_ref: Any, key: int = key, rec: _Record = rec) -> None:
            if records.get(key) is rec:
                del records[key]
            self._free(rec)

        rec.ref = weakref.ref(st, release)
        records[key] = rec
        if card != HOST and rec.nbytes:
            if self.on_event is not None:
                self.on_event(card, rec.nbytes, rec.seq, self.stream)
            self.live[card] += rec.nbytes
            self.by_cat[card][category] += rec.nbytes
            if self.live[card] > self.peak[card]:
                self.peak[card] = self.live[card]
                self.peak_breakdown[card] = dict(self.by_cat[card])
                self._peak_seq[card] = self._seq

    def _free(self, rec: _Record) -> None:
        if rec.card != HOST and rec.nbytes:
            if self.on_event is not None:
                self.on_event(rec.card, -rec.nbytes, rec.seq, 0)
            self.live[rec.card] -= rec.nbytes
            self.by_cat[rec.card][rec.category] -= rec.nbytes

    def retag(self, t: torch.Tensor, category: str) -> None:
        rec = self.record_of(t)
        if rec is None or rec.category == category:
            return
        card = rec.card
        if card != HOST:
            self.by_cat[card][rec.category] -= rec.nbytes
            self.by_cat[card][category] += rec.nbytes
            if rec.seq <= self._peak_seq[card]:
                # alive now and allocated before the peak, so it was live at the peak
                self.peak_breakdown[card][rec.category] -= rec.nbytes
                self.peak_breakdown[card][category] += rec.nbytes
        rec.category = category

    def to_host(self, t: torch.Tensor) -> None:
        """Stop charging ``t``'s storage to a card (it lives on the host on real GPUs)."""
        rec = self.record_of(t)
        if rec is not None and rec.card != HOST:
            self._free(rec)
            rec.card = HOST

    def reset_peaks(self) -> None:
        """Like ``torch.cuda.reset_peak_memory_stats``: peaks restart from what is live."""
        self.peak = list(self.live)
        self.peak_breakdown = [dict(b) for b in self.by_cat]
        self._peak_seq = [self._seq] * self.n

    def running_card(self) -> int:
        """The card that runs now (the card last computed on, in the backward)."""
        return self.last_card if self.current_card == FOLLOW else self.current_card

    # -- context -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _setting(self, attr: str, card: Optional[int], category: Optional[str]) -> Iterator[None]:
        prev = getattr(self, attr), self.category
        setattr(self, attr, card)
        if category is not None:
            self.category = category
        try:
            yield
        finally:
            setattr(self, attr, prev[0])
            self.category = prev[1]

    def on(self, card: int, category: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Run code as the replica on ``card`` (factory ops land there)."""
        return self._setting("current_card", card, category)

    def forced(self, card: int, category: Optional[str] = None) -> contextlib.AbstractContextManager:
        """Every new storage goes to ``card`` (a copy between cards)."""
        return self._setting("forced_card", card, category)

    @contextlib.contextmanager
    def cuda_rules(self, on: bool) -> Iterator[None]:
        """CUDA's device rules (:mod:`dptune.backends.simulated.device_rules`) on or off: on while the step
        runs, off while dptune itself builds things (the model, the batch)."""
        prev = self.as_cuda
        self.as_cuda = on
        try:
            yield
        finally:
            self.as_cuda = prev

    @contextlib.contextmanager
    def phase(self, category: str) -> Iterator[None]:
        prev = self.category
        self.category = category
        try:
            yield
        finally:
            self.category = prev


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


_F = TypeVar("_F", bound=Callable[..., Any])


def _internal(part: str, *users: type[BaseException]) -> Callable[[_F], _F]:
    """Report a failure inside ``part`` of dptune's machinery as dptune's, not the user's
    (exceptions of the types ``users`` are the user's: they pass)."""
    passing: tuple[type[BaseException], ...] = (DptuneError, *users)

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except passing:
                raise
            except Exception as e:
                raise InternalError(
                    f"dptune's simulator failed in {part} ({type(e).__name__}: {e}); this is a bug "
                    "in dptune, not in your model: please report it with the model that shows it"
                ) from e
        return run  # type: ignore[return-value]
    return wrap


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
    if func is torch.ops.aten._grouped_mm.default:
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
    if func is torch.ops.aten._pack_padded_sequence.default:
        # batch_sizes has one entry per step up to the longest length, a value: at most the
        # padded input's longer dimension (the fake kernel sizes the packed data by the steps
        # alone, not by the sum of the lengths, so that is charged short)
        x = args[0]
        bound_size(out[1].shape[0], max(x.shape[0], x.shape[1]))
    return out


_GROUPED_MM_FALLBACK = (torch.float32, torch.float16)


class _OpFacts(NamedTuple):
    """What the dispatch needs to know of an aten op, worked out once per op."""

    name: str                       # e.g. "add.Tensor"
    lift: bool                      # a factory of torch.tensor's data: lands where code runs
    data_dependent: bool            # its output size depends on values (_DATA_DEPENDENT)
    reads_value: bool               # _local_scalar_dense: .item()
    same_dtype: Optional[tuple[int, int]]   # operands CUDA requires in one dtype
    sets_storage: bool              # set_: an input gets another storage


@functools.lru_cache(maxsize=None)
def _op_facts(func: Any) -> _OpFacts:
    name = getattr(func, "__name__", str(func))
    packet = name.split(".")[0]
    return _OpFacts(name, packet in _LIFTS, packet in _DATA_DEPENDENT,
                    name.startswith("_local_scalar_dense"), _SAME_DTYPE.get(packet),
                    packet in ("set_", "set", "swap_"))


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


def _make_accountant(ledger: _Ledger) -> Any:
    base = dispatch_mode_base()
    check = _internal("the device check (host and card tensors in one op)",
                      DeviceMismatchError)(check_devices)
    find_cards = _internal("the device check (host and card tensors in one op)")(input_cards)

    @_internal("the ledger (charging an op's outputs to a card)")
    def account(func: Any, facts: _OpFacts, args: Any, kwargs: Any, out: Any,
                cards: Optional[list[InputCard]]) -> None:
        if facts.data_dependent or facts.reads_value:
            _note_data_dependent(ledger, func, args, out)
        card = ledger.forced_card
        if card is None:
            # on the card of its first input on a card; on the host if all its inputs are
            # there; a factory op (lift_fresh: the data of torch.tensor) where code runs
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
        category = ledger.category
        if isinstance(out, torch.Tensor):
            ledger.charge(out, card, category)
        elif isinstance(out, (list, tuple)):
            for t in _arg_tensors(out):
                ledger.charge(t, card, category)
        if ledger.observer is not None:
            ledger.observer(func, args, kwargs, out, card)

    class _Accountant(base):  # type: ignore[misc, valid-type]
        """Charges every new storage an op makes to a virtual card."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
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
                cards = find_cards(args, kwargs, ledger)
                check(func, args, kwargs, ledger, cards)
            out = _call_as_cuda(func, args, kwargs or {})
            # set_ gives its input another storage: where it is is looked up again
            account(func, facts, args, kwargs, out, None if facts.sets_storage else cards)
            return out

    return _Accountant()


# --------------------------------------------------------------------------------------------
# DataParallel's copies, as autograd functions that move storages between virtual cards.
# --------------------------------------------------------------------------------------------
class _Move(torch.autograd.Function):
    """Copy ``x`` from card ``src`` to card ``dst``; the gradient goes back to ``src``."""

    @staticmethod
    @_internal("the copy of a batch chunk between cards (DataParallel's scatter)")
    def forward(ctx: Any, x: torch.Tensor, ledger: _Ledger, src: int, dst: int, category: str) -> torch.Tensor:
        ctx.ledger, ctx.src = ledger, src
        with ledger.forced(dst, category):
            return x.clone()

    @staticmethod
    @_internal("the backward of the scatter (a chunk's gradient copied back)")
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        with ctx.ledger.forced(ctx.src):
            return g.clone(), None, None, None, None


class _Broadcast(torch.autograd.Function):
    """Replicate the master weights (on card 0) to ``cards``; reduce the gradients onto card 0.

    Card 0's replica uses the master weights themselves (aliases, no copy), as
    ``comm.broadcast_coalesced`` does for the source device. The backward runs once every
    replica's gradients exist, as ``ReduceAddCoalesced`` does, and writes the sum into a new
    buffer on card 0. When it runs with some gradients missing (each segment of a reentrant
    checkpoint runs its own backward through it), autograd fills the missing ones with zeros
    on their replica's card, as it does for torch's ``Broadcast``.
    """

    @staticmethod
    @_internal("the broadcast of the weights to the replicas")
    def forward(ctx: Any, ledger: _Ledger, cards: tuple, *params: torch.Tensor) -> tuple:
        ctx.ledger, ctx.n_params, ctx.n_cards, ctx.cards = ledger, len(params), len(cards), cards
        ctx.meta = [(p.shape, p.dtype) for p in params]
        ctx.plan, ctx.reductions = ledger.sharing, 0
        ctx.set_materialize_grads(False)
        outs: list[torch.Tensor] = []
        for card in cards:
            if card == 0:
                outs += [p.view_as(p) for p in params]
            else:
                with ledger.forced(card, "weights"):
                    outs += [p.clone() for p in params]
        return tuple(outs)

    @staticmethod
    @_internal("the reduction of the replicas' gradients onto card 0")
    def backward(ctx: Any, *given: Optional[torch.Tensor]) -> tuple:
        ledger, n = ctx.ledger, ctx.n_params
        if all(g is None for g in given):
            return (None, None) + (None,) * n
        grads = list(given)
        ctx.reductions += 1
        if ctx.plan is not None and ctx.reductions > 1:
            ctx.plan.diverge("the gradients were reduced more than once (a reentrant checkpoint)")
        for i, g in enumerate(grads):
            if g is None:
                shape, dtype = ctx.meta[i % n]
                with ledger.forced(ctx.cards[i // n], "gradients"):
                    grads[i] = torch.zeros(shape, dtype=dtype)
        reduced: list[Optional[torch.Tensor]] = []
        with ledger.forced(0, "gradients"):
            for j in range(n):
                gs = [grads[k * n + j] for k in range(ctx.n_cards)]
                total = torch.empty_like(gs[0])
                total.copy_(gs[0])
                for g in gs[1:]:
                    total.add_(g)
                reduced.append(total)
        return (None, None, *reduced)


class _Gather(torch.autograd.Function):
    """Concatenate the replicas' outputs on the output card; scatter the gradient back."""

    @staticmethod
    @_internal("the gather of the replicas' outputs onto the output card")
    def forward(ctx: Any, ledger: _Ledger, cards: tuple, dim: int, out_card: int,
                owners: Optional[tuple], *outs: torch.Tensor) -> torch.Tensor:
        # owners: the card of each of outs where one output stands for a class of cards
        # (simulated.sharing): every card's entry is its representative's
        ctx.ledger, ctx.cards, ctx.out_card, ctx.owners = ledger, cards, out_card, owners
        if owners is not None:
            plan = ledger.sharing
            assert plan is not None
            by_card = dict(zip(owners, outs))
            outs = tuple(by_card[plan.rep[c]] for c in cards)
        scalar = outs[0].dim() == 0
        ctx.scalar = scalar
        ctx.sizes = [1 if scalar else o.shape[dim] for o in outs]
        ctx.dim = 0 if scalar else dim
        with ledger.forced(out_card, "outputs"):
            if scalar:
                return torch.stack(outs)
            return torch.cat(outs, dim)

    @staticmethod
    @_internal("the backward of the gather (the output's gradient scattered back)")
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        ledger, grads, start = ctx.ledger, [], 0
        owners = None if ctx.owners is None else set(ctx.owners)
        for card, size in zip(ctx.cards, ctx.sizes):
            if owners is not None and card not in owners:
                start += size             # a card that the class's representative stands for
                continue
            piece = g.narrow(ctx.dim, start, size)
            if ctx.scalar:
                piece = piece.squeeze(0)
            start += size
            if card == ctx.out_card:
                grads.append(piece)
            else:
                with ledger.forced(card, "activations"):
                    grads.append(piece.clone())
        return (None, None, None, None, None, *grads)


def _gather(ledger: _Ledger, cards: tuple, outputs: list, dim: int = 0, out: int = 0,
            run: Optional[tuple] = None) -> Any:
    """DataParallel's ``gather`` onto card ``out`` (:func:`dptune._tree.gather`: torch's rules).

    ``outputs`` has one entry per card of ``run`` (default ``cards``); a card of ``cards``
    that was not run takes its representative's (``ledger.sharing``)."""
    if run is None or run == cards:
        return _tree.gather(outputs, lambda ts, path: _Gather.apply(ledger, cards, dim, out, None, *ts))
    plan = ledger.sharing
    assert plan is not None
    by_card = dict(zip(run, outputs))
    full = [by_card[plan.rep[c]] for c in cards]
    where = [cards.index(c) for c in run]
    return _tree.gather(full, lambda ts, path: _Gather.apply(
        ledger, cards, dim, out, run, *[ts[i] for i in where]))


def _scatter(ledger: _Ledger, obj: Any, cards: Sequence[int], sizes: Sequence[int], source: int,
             path: str, run: Optional[Sequence[int]] = None) -> list:
    """DataParallel's ``scatter`` from ``source`` (:func:`dptune._tree.scatter`: torch's rules):
    one structure per busy card (per card of ``run`` only, if given), each tensor's chunk
    moved to its card."""
    batch = sum(sizes)
    keep = set(cards if run is None else run)

    def split(t: torch.Tensor, where: str) -> list:
        if t.dim() == 0 or t.shape[0] != batch:
            got = "a 0-dim tensor" if t.dim() == 0 else f"size {t.shape[0]} along dim 0"
            raise UsageError(f"batch tensor {where} has {got}, but the batch has {batch} samples; "
                             "every tensor of a batch must have the batch along dim 0")
        if ledger.sharing is not None and source != HOST and t.requires_grad:
            ledger.sharing.diverge("a batch tensor that requires grad is scattered from card 0")
        out, start = [], 0
        for card, c in zip(cards, sizes):
            if card in keep:
                piece = t.narrow(0, start, c)
                out.append(piece if card == source else _Move.apply(piece, ledger, source, card, "inputs"))
            start += c
        return out

    # from the host, DataParallel's Scatter copies on a background stream per card
    prev, ledger.stream = ledger.stream, 1 if source == HOST else 0
    try:
        return _tree.scatter(obj, len(keep), split, path)
    finally:
        ledger.stream = prev


def _first_batch_size(obj: Any) -> Optional[int]:
    for _, t in _tree.tensors(obj):
        if t.dim() > 0:
            return int(t.shape[0])
    return None


def _replicate(ledger: _Ledger, module: nn.Module, cards: tuple, single: bool
               ) -> tuple[dict[int, Optional[dict]], list]:
    """Each busy card's parameters and buffers, by name, as DataParallel's ``replicate`` makes them.

    Returns the replicas and the hooks to remove after the backward. Every gradient that
    reaches a replica's weights is tagged ``gradients`` when autograd produces it.
    """
    named = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    names = [n for n, p in named.items() if p.requires_grad]
    frozen = {n: p for n, p in named.items() if not p.requires_grad}

    @_internal("the gradient hook that tags the replicas' weight gradients")
    def tag(g: Optional[torch.Tensor]) -> None:
        if g is not None:
            ledger.retag(g, "gradients")

    if single:  # DataParallel on one device runs the module itself
        hooks = [named[n].register_hook(tag) for n in names]
        return {0: None}, hooks
    flat = _Broadcast.apply(ledger, cards, *[named[n] for n in names])
    replicas: dict[int, Optional[dict]] = {}
    for k, card in enumerate(cards):
        rep = dict(zip(names, flat[k * len(names):(k + 1) * len(names)]))
        for t in rep.values():
            if t.requires_grad:
                t.register_hook(tag)
        if card == 0:
            rep.update(frozen)
            rep.update(buffers)
        else:
            with ledger.forced(card, "weights"):
                rep.update({n: t.detach().clone() for n, t in frozen.items()})
                rep.update({n: t.detach().clone() for n, t in buffers.items()})
        replicas[card] = rep
    return replicas, []


def _retag_tree(ledger: _Ledger, obj: Any, category: str) -> None:
    for _, t in _tree.tensors(obj):
        ledger.retag(t, category)


def _run_replica(ledger: _Ledger, module: nn.Module, params: Optional[dict], card: int,
                 args: Any, kwargs: Any, sizes: Sequence[int]) -> Any:
    """Run the replica's forward on ``card`` (its inputs already scattered there).

    The replica is a module copy holding the card's weights (as DataParallel's replicas are),
    so a forward that runs again in the backward (activation checkpointing) uses them too.
    """
    if params is None:
        replica = module
    else:
        by_id = {}
        for name, t in chain(module.named_parameters(), module.named_buffers()):
            if name in params:
                by_id[id(t)] = params[name]
        replica = replica_module(module, by_id)
    with ledger.on(card, "activations"):
        try:
            out = replica(*args, **kwargs)
        except DptuneError:
            raise
        except Exception as e:
            raise _user_error(e, f"in the forward of replica {card} on virtual card {card}", sizes) from e
    _retag_tree(ledger, out, "outputs")
    return out


def _backward_hooks(outputs: Any, mode: Any, ledger: _Ledger) -> list:
    """Hooks on every autograd node behind ``outputs`` that make its backward run as on a card.

    The autograd engine runs every node without the caller's torch-function modes and (on
    real GPUs) on the device of its gradients. A node may run forward code again (activation
    checkpointing recomputes its segment): that code must see the CUDA kernel choices of the
    forward (``mode`` is entered around the node), and what it makes without reading a card's
    tensor lands on the card of the node's gradients. Returns the hook handles.
    """
    handles: list = []
    saved: list[tuple[bool, int]] = []

    @_internal("the backward hook that keeps CUDA's kernel choices in recomputation")
    def pre(grads: Any) -> None:
        enter = mode is not None and not function_mode_active()
        saved.append((enter, ledger.current_card))
        if enter:
            mode.__enter__()
        ledger.current_card = FOLLOW
        for g in grads:
            if isinstance(g, torch.Tensor):
                card = ledger.card_of(g)
                if card != HOST:
                    ledger.last_card = card
                    break

    @_internal("the backward hook that keeps CUDA's kernel choices in recomputation")
    def post(_grad_inputs: Any, _grad_outputs: Any) -> None:
        if saved:
            enter, card = saved.pop()
            ledger.current_card = card
            if enter:
                mode.__exit__(None, None, None)

    seen: set[int] = set()
    todo = [t.grad_fn for t in _tree.leaves(outputs)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if ledger.sharing is not None and "Checkpoint" in type(node).__name__:
            # a reentrant checkpoint runs its own backward: one reduction per segment per replica
            ledger.sharing.diverge("a reentrant activation checkpoint")
        handles += [node.register_prehook(pre), node.register_hook(post)]
        todo.extend(nxt for nxt, _ in node.next_functions)
    return handles


_PHASES = {  # step phase -> (category of what it allocates on card 0, where, for errors)
    "forward": ("activations", "in the forward"),
    "loss": ("outputs", "in the loss on virtual card 0"),
    "backward": ("activations", "in the backward"),
    "clip": ("other", "in clip_grad_norm_ on virtual card 0"),
    "optimizer": ("optimizer", "in optimizer.step() on virtual card 0"),
    "step": ("activations", "in the step function"),
}


class _SimulatedDataParallel(nn.Module):
    """DataParallel over the virtual cards: what a step function gets as ``model``.

    ``forward`` splits the batch with the probe's chunk sizes (a batch of another size in the
    same proportions, as ``BalancedDataParallel`` does), replicates the weights, runs each
    replica on its card and gathers the outputs onto card 0.
    """

    def __init__(self, module: nn.Module, ledger: _Ledger, sizes: Sequence[int], source: int,
                 single: bool, output_device: int = 0, fn_mode: Any = None):
        super().__init__()
        self.module = module
        self._ledger, self._sizes, self._source, self._single = ledger, list(sizes), source, single
        self._out = output_device
        self._fn_mode = fn_mode
        self._hooks: list = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ledger = self._ledger
        found = _first_batch_size((args, kwargs))
        sizes = self._sizes
        if found is not None and found != sum(sizes):
            sizes = scale_split(sizes, found)
        cards = tuple(i for i, c in enumerate(sizes) if c > 0)
        used = [sizes[c] for c in cards]
        run = self._cards_to_run(sizes, cards)
        # the chunks stay referenced until the gather is done, as in DataParallel.forward
        inputs = _scatter(ledger, tuple(args), cards, used, self._source, "args", run)
        module_kwargs = _scatter(ledger, dict(kwargs), cards, used, self._source, "kwargs", run)
        replicas, hooks = _replicate(ledger, self.module, run, self._single)
        self._hooks += hooks
        outputs = []
        for k, card in enumerate(run):
            outputs.append(_run_replica(ledger, self.module, replicas.pop(card), card,
                                        inputs[k], module_kwargs[k], sizes))
        del replicas
        self._hooks += _backward_hooks(outputs, self._fn_mode, ledger)
        with ledger.on(self._out, "outputs"):
            return outputs[0] if self._single else _gather(ledger, cards, outputs, out=self._out, run=run)

    def _cards_to_run(self, sizes: Sequence[int], cards: tuple) -> tuple:
        """The busy cards whose replicas run: one per class of like cards where the ledger
        has a plan for this split (:mod:`dptune.backends.simulated.sharing`), else all."""
        plan = self._ledger.sharing
        if plan is None:
            return cards
        if plan.sizes != tuple(sizes):
            plan.diverge("the model ran on a batch of another size than the probe's")
            return cards
        return tuple(c for c in cards if plan.weight[c])

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
