"""An independent per-card accounting of a DataParallel training step, from torch's own code.

The reference for the simulator's DataParallel (``dptune.backends.simulated.dataparallel``):
it runs PyTorch's own pieces, not dptune's:

- ``torch.nn.parallel.replicate`` itself, so the replicas get their weights from torch's
  ``Broadcast`` autograd function (``torch/nn/parallel/_functions.py``), which marks the copies
  of frozen parameters non-differentiable, and whose backward is ``ReduceAddCoalesced``, with
  ``comm.reduce_add_coalesced`` (its 10 MiB buckets flattened on every card) run as it is;
- torch's autograd engine, which materializes a zero gradient (``VariableInfo::zeros``: the
  output's shape and device) for every output of a custom function that got none, whether the
  output was never used (an unused parameter, a segment of a reentrant checkpoint that did not
  touch it) or is non-differentiable (a frozen parameter's copy);
- the user's model, optimizer (``foreach=True``, as on CUDA) and ``torch.utils.checkpoint``.

The cards are the ``meta`` device (Broadcast refuses CPU tensors; the engine runs meta work on
the calling thread), the host is the CPU: the batch is made on the CPU and each chunk copied to
its card. Which card holds a storage is kept by a dispatch mode, by CUDA's rules: an op's new
storages are on the card of its first card tensor; a factory call (no tensor argument) is on
the card that runs (the replica's, in the forward; in the backward the card of the node's first
gradient, as the engine's device guard); the zeros the engine materializes for a
``Broadcast`` are on the card of the output they stand for (``VariableInfo::zeros`` takes the
output's device). Only the device-specific primitives of ``torch.nn.parallel.comm`` are
replaced, with what they do on CUDA cards: ``broadcast_coalesced`` (the source card's outputs
are its inputs, every other card gets a copy), ``reduce_add`` (NCCL's reduce into an
``empty_like`` on the destination). Every storage is rounded up to 512 bytes (the caching
allocator's block).

Left out, as in the simulator: cuBLAS/cuBLASLt workspaces (the caller subtracts dptune's) and
the kernels' scratch; ``broadcast_coalesced``'s flat buckets for small parameters (each copy is
its own storage here: the bucket's views free together on a card, a difference of the size of
the small parameters at most).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.parallel import comm, replicate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

HOST = -1
_BLOCK = 512


def _rounded(n: int) -> int:
    return math.ceil(n / _BLOCK) * _BLOCK


class CardTracker(TorchDispatchMode):
    """Live and peak bytes per card of the meta tensors made under it (module docstring)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.live = [0] * n
        self.peak = [0] * n
        self._card: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current: Optional[int] = None      # the card that runs (factories land there)
        self.forced: Optional[int] = None       # a copy to this card (comm's primitives)
        self.zeros_for: list[int] = []          # the cards of a Broadcast's missing gradients

    # -- storages ---------------------------------------------------------------------------
    def add(self, t: torch.Tensor, card: int) -> None:
        """Charge ``t``'s storage to ``card`` (a tensor made before the tracker)."""
        st = t.untyped_storage()
        if st in self._card:
            return
        nbytes = _rounded(st.nbytes())
        self._card[st] = card
        self.live[card] += nbytes
        self.peak[card] = max(self.peak[card], self.live[card])
        weakref.finalize(st, self._free, card, nbytes)

    def _free(self, card: int, nbytes: int) -> None:
        self.live[card] -= nbytes

    def card_of(self, t: torch.Tensor) -> int:
        if t.device.type != "meta":
            return HOST
        st = t.untyped_storage()
        if st not in self._card:
            raise AssertionError(f"a meta tensor of unknown card: {tuple(t.shape)}")
        return self._card[st]

    def reset_peaks(self) -> None:
        self.peak = list(self.live)

    @contextlib.contextmanager
    def on(self, card: Optional[int]) -> Iterator[None]:
        prev, self.current = self.current, card
        try:
            yield
        finally:
            self.current = prev

    @contextlib.contextmanager
    def to(self, card: int) -> Iterator[None]:
        prev, self.forced = self.forced, card
        try:
            yield
        finally:
            self.forced = prev

    # -- every op ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        new = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "meta"
               and t.untyped_storage() not in self._card]
        if new:
            self._charge(func, inputs, new)
        return out

    def _charge(self, func: Any, inputs: list, new: list) -> None:
        if self.forced is not None:
            card = self.forced
        else:
            cards = [self.card_of(t) for t in inputs if t.device.type == "meta"]
            if cards:
                card = cards[0]
            elif self.zeros_for:
                assert func is torch.ops.aten.zeros.default, func
                card = self.zeros_for.pop(0)
            elif self.current is not None:
                card = self.current
            else:
                raise AssertionError(f"{func} makes a card tensor outside any card's work")
        for t in new:
            self.add(t, card)


def _patched_comm(tracker: CardTracker) -> contextlib.ExitStack:
    """``comm``'s device primitives as they act on CUDA cards (module docstring)."""
    stack = contextlib.ExitStack()

    def broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                            buffer_size: int = 10485760) -> list:
        src = tracker.card_of(tensors[0])
        outs = []
        for d in devices:
            if d == src:
                outs.append(list(tensors))
            else:
                with tracker.to(d):
                    outs.append([t.detach().clone() for t in tensors])
        return outs

    def reduce_add(inputs: Sequence[torch.Tensor], destination: Optional[int] = None) -> torch.Tensor:
        dest = 0 if destination is None or destination < 0 else destination
        with tracker.to(dest):                # nccl.reduce into empty_like on the destination
            result = torch.empty_like(inputs[0])
        for t in inputs:                       # (values are not computed on meta tensors)
            assert t.shape == result.shape
        return result

    for name, fn in (("broadcast_coalesced", broadcast_coalesced), ("reduce_add", reduce_add)):
        old = getattr(comm, name)
        setattr(comm, name, fn)
        stack.callback(setattr, comm, name, old)
    return stack


def _watch_broadcasts(tracker: CardTracker, replicas: list, cards: Sequence[int]) -> None:
    """A pre-hook on each ``BroadcastBackward`` node: the cards of the gradients it will get
    as materialized zeros (the outputs with none, in order); the engine's device guard (the
    card of a node's first gradient) on every other node is set by :func:`_device_guard`."""
    nodes = {}
    for rep in replicas:
        for m in rep.modules():               # replicate sets the copies as plain attributes
            for t in m.__dict__.values():
                if isinstance(t, torch.Tensor) and type(t.grad_fn).__name__ == "BroadcastBackward":
                    nodes[id(t.grad_fn)] = t.grad_fn
    for node in nodes.values():
        def pre(grads: tuple, node: Any = node) -> None:
            per_card = len(grads) // len(cards)
            tracker.zeros_for = [cards[i // per_card] for i, g in enumerate(grads) if g is None]

        def post(_gi: tuple, _go: tuple) -> None:
            assert not tracker.zeros_for, "a materialized zero gradient not seen"

        node.register_prehook(pre)
        node.register_hook(post)


def _device_guard(tracker: CardTracker, roots: Sequence[torch.Tensor]) -> list:
    """Every node behind ``roots`` runs on the card of its first gradient (the engine's device
    guard), so a factory call in a recomputed segment lands there."""
    handles, seen, todo = [], set(), [t.grad_fn for t in roots]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))

        def pre(grads: tuple) -> None:
            for g in grads:
                if isinstance(g, torch.Tensor) and g.device.type == "meta":
                    tracker.current = tracker.card_of(g)
                    return

        if type(node).__name__ != "BroadcastBackward":
            handles.append(node.register_prehook(pre))
        todo.extend(n for n, _ in node.next_functions)
    return handles


class _Gather(torch.autograd.Function):
    """``comm.gather`` onto card 0 (a new tensor there); the backward is ``Scatter``: each
    card's piece of the gradient copied to it (card 0's a view, ``Tensor.to`` of the same
    device)."""

    @staticmethod
    def forward(ctx: Any, tracker: CardTracker, cards: tuple, *outs: torch.Tensor) -> torch.Tensor:
        ctx.tracker, ctx.cards, ctx.sizes = tracker, cards, [o.shape[0] for o in outs]
        with tracker.to(0):
            return torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        pieces, start = [], 0
        for card, size in zip(ctx.cards, ctx.sizes):
            piece = g.narrow(0, start, size)
            start += size
            if card == 0:
                pieces.append(piece)
            else:
                with ctx.tracker.to(card):
                    pieces.append(piece.clone())
        return (None, None, *pieces)


def _scatter(tracker: CardTracker, batch: Any, sizes: Sequence[int]) -> list:
    """The host batch's chunks copied onto their cards (``Scatter`` from the CPU)."""
    def chunks(t: torch.Tensor) -> list:
        out, start = [], 0
        for card, size in enumerate(sizes):
            with tracker.to(card):
                out.append(t.narrow(0, start, size).to("meta"))
            start += size
        return out

    if isinstance(batch, dict):
        per_key = {k: chunks(v) for k, v in batch.items()}
        return [{k: v[i] for k, v in per_key.items()} for i in range(len(sizes))]
    return [chunks(batch)[i] for i in range(len(sizes))]


def _gather(tracker: CardTracker, cards: tuple, outs: list) -> Any:
    """``gather`` of the replicas' outputs onto card 0: every tensor (a dict's entries each;
    0-dim ones as 1-element vectors, as torch's ``Gather`` unsqueezes them)."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        with tracker.on(0):
            return _Gather.apply(tracker, cards, *[o.reshape(1) if o.dim() == 0 else o for o in outs])
    if isinstance(first, dict):
        return {k: _gather(tracker, cards, [o[k] for o in outs]) for k in first
                if isinstance(first[k], torch.Tensor)}
    raise TypeError(f"no gather for {type(first).__name__}")


def dataparallel_peaks(make_model: Callable[[], nn.Module], make_batch: Callable[[int], Any],
                       split: Sequence[int], *, optimizer: Optional[Callable[[Any], Any]] = None,
                       model_loss: bool = False) -> list[int]:
    """Each card's peak (bytes) over one steady-state DataParallel step of ``split``.

    Before the step (not counted in the rise, but live): the master weights and buffers on
    card 0, the optimizer's state after a warm-up step, gradients ``None``. The step: the host
    batch scattered, ``replicate``, each replica's forward on its card, the outputs gathered
    onto card 0, the loss (the model's own ``loss``, averaged over the replicas, with
    ``model_loss``; else the sum of the gathered output), backward, ``optimizer.step()``.
    """
    assert all(c > 0 for c in split)
    n = len(split)
    cards = tuple(range(n))
    with torch.device("meta"):
        model = make_model()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params) if optimizer is not None else None
    if opt is not None:                       # the warm-up step creates the optimizer's state
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    tracker = CardTracker(n)
    for t in list(model.parameters()) + list(model.buffers()):
        tracker.add(t, 0)
    if opt is not None:
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.device.type == "meta":
                    tracker.add(t, 0)
    batch = make_batch(sum(split))
    with _patched_comm(tracker), tracker:
        tracker.reset_peaks()
        inputs = _scatter(tracker, batch, split)
        replicas = replicate(model, list(cards))
        _watch_broadcasts(tracker, replicas, cards)
        outs = []
        for card, (rep, chunk) in enumerate(zip(replicas, inputs)):
            with tracker.on(card):
                outs.append(rep(**chunk) if isinstance(chunk, dict) else rep(chunk))
        del replicas, inputs, rep, chunk
        gathered = _gather(tracker, cards, outs)
        del outs
        with tracker.on(0):
            loss = gathered["loss"].mean() if model_loss else gathered.sum()
        handles = _device_guard(tracker, [loss])
        loss.backward()
        for h in handles:
            h.remove()
        if opt is not None:
            with tracker.on(0):
                opt.step()
        del gathered, loss
    return tracker.peak
