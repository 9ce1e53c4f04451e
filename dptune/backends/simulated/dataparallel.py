"""DataParallel on the virtual cards: the scatter of the batch, the broadcast of the weights,
each replica's forward on its card, the gather of the outputs, and their backwards.

The copies are autograd functions that move storages between cards in the ledger
(:mod:`dptune.backends.simulated.ledger`): :class:`_Move` (a batch chunk, and its gradient
back), :class:`_Broadcast` (the weights to the replicas, the gradients reduced onto card 0)
and :class:`_Gather` (the outputs onto the output card, their gradient scattered back).
:class:`_SimulatedDataParallel` is what a step gets as its model; where the ledger has a
sharing plan (:mod:`dptune.backends.simulated.sharing`) it runs one replica per class of like
cards.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from dptune.step import tree as _tree
from dptune._torch_private import function_mode_active, no_function_modes, replica_module
from dptune.backends.simulated.device_rules import HOST
from dptune.backends.simulated.errors import _internal, _user_error
from dptune.backends.simulated.ledger import FOLLOW, _Ledger
from dptune.errors import DptuneError, UsageError
from dptune.split import scale_split

__all__: list[str] = []


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

    Every parameter is broadcast, frozen ones too, as torch's ``replicate`` does; the copies
    of the frozen ones are non-differentiable (``Broadcast`` marks them so). Card 0's replica
    uses the master weights themselves (aliases, no copy), as ``comm.broadcast_coalesced``
    does for the source device. The backward runs once every replica's gradients exist, as
    ``ReduceAddCoalesced`` does, and writes the sum into a new buffer on card 0 for every
    parameter. Autograd hands torch's ``Broadcast`` a zero gradient, made on the copy's card,
    for every copy that got none: a frozen parameter's, a parameter the forward did not use,
    and, where each segment of a reentrant checkpoint runs its own backward through it, every
    parameter the segment did not touch; ``ReduceAddCoalesced`` sums them onto card 0 as well
    (the frozen parameters' sums are then dropped).
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
                with ledger.forced(card, "weights"), ledger.unmirrored():
                    outs += [p.clone() for p in params]
        frozen = [o for i, o in enumerate(outs) if not params[i % len(params)].requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
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
            if g is None:           # autograd's zeros on the copy's card (VariableInfo::zeros)
                shape, dtype = ctx.meta[i % n]
                # below the device rules, which would take a factory without device= for the host's
                with no_function_modes(), ledger.forced(ctx.cards[i // n], "gradients"):
                    grads[i] = torch.zeros(shape, dtype=dtype)
        reduced: list[Optional[torch.Tensor]] = []
        with ledger.forced(0, "gradients"):
            for j in range(n):
                gs = [grads[k * n + j] for k in range(ctx.n_cards)]
                total = gs[0].clone()   # one op: what empty_like and copy_ make and read
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
        mirror = None
        if owners is not None:
            plan = ledger.sharing
            assert plan is not None
            by_card = dict(zip(owners, outs))
            outs = tuple(by_card[plan.replica_of(c)] for c in cards)
            if out_card == 0 == cards[0] and plan.mirror is not None:
                mirror = plan.mirror      # card 0's own output is another card's here
        scalar = outs[0].dim() == 0
        ctx.scalar = scalar
        ctx.sizes = [1 if scalar else o.shape[dim] for o in outs]
        ctx.dim = 0 if scalar else dim
        with ledger.forced(out_card, "outputs"):
            out = torch.stack(outs) if scalar else torch.cat(outs, dim)
        uncopy = getattr(ledger.observer, "uncopy", None)
        if mirror is not None and uncopy is not None:
            uncopy(mirror, 0, outs[0])    # card 0 reads its own output: no copy
        return out

    @staticmethod
    @_internal("the backward of the gather (the output's gradient scattered back)")
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        ledger, grads, start = ctx.ledger, [], 0
        owners = None if ctx.owners is None else set(ctx.owners)
        view0 = None                      # card 0's piece where its replica is mirrored
        for card, size in zip(ctx.cards, ctx.sizes):
            if owners is not None and card not in owners:
                if card == 0 == ctx.out_card:
                    view0 = _piece(g, ctx, start, size)
                start += size             # a card that the class's representative stands for
                continue
            piece = _piece(g, ctx, start, size)
            start += size
            if card == ctx.out_card:
                grads.append(piece)
            elif view0 is not None and ledger.mirrors(card):
                _mirror_view(ledger, card, piece, view0, g, grads)
            else:
                with ledger.forced(card, "activations"):
                    grads.append(piece.clone())
        return (None, None, None, None, None, *grads)


def _piece(g: torch.Tensor, ctx: Any, start: int, size: int) -> torch.Tensor:
    piece = g.narrow(ctx.dim, start, size)
    return piece.squeeze(0) if ctx.scalar else piece


def _mirror_view(ledger: _Ledger, card: int, piece: torch.Tensor, view0: torch.Tensor,
                 g: torch.Tensor, grads: list) -> None:
    """The gradient piece of the replica that stands for card 0's (sharing.mirror): a copy on
    ``card``, where card 0's replica gets a view of ``g`` (``view0``), which keeps ``g`` alive as
    long as the copy lives. A view laid out unlike the copy could make card 0's replica run
    other ops: the step is then simulated again without the mirror."""
    if not view0.is_contiguous():
        assert ledger.sharing is not None
        ledger.sharing.refuse_mirror("card 0's gradient piece is a strided view (an expanded gradient)")
    with ledger.forced(card, "activations"), ledger.unmirrored():
        copy = piece.clone()
    ledger.hold(copy, g)
    grads.append(copy)


def _gather(ledger: _Ledger, cards: tuple, outputs: list, dim: int = 0, out: int = 0,
            run: Optional[tuple] = None) -> Any:
    """DataParallel's ``gather`` onto card ``out`` (:func:`dptune.step.tree.gather`: torch's rules).

    ``outputs`` has one entry per card of ``run`` (default ``cards``); a card of ``cards``
    that was not run takes its representative's (``ledger.sharing``)."""
    if run is None or run == cards:
        return _tree.gather(outputs, lambda ts, path: _Gather.apply(ledger, cards, dim, out, None, *ts))
    plan = ledger.sharing
    assert plan is not None
    by_card = dict(zip(run, outputs))
    full = [by_card[plan.replica_of(c)] for c in cards]
    where = [cards.index(c) for c in run]
    return _tree.gather(full, lambda ts, path: _Gather.apply(
        ledger, cards, dim, out, run, *[ts[i] for i in where]))


def _scatter(ledger: _Ledger, obj: Any, cards: Sequence[int], sizes: Sequence[int], source: int,
             path: str, run: Optional[Sequence[int]] = None) -> list:
    """DataParallel's ``scatter`` from ``source`` (:func:`dptune.step.tree.scatter`: torch's rules):
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
    trainable = [n for n, p in named.items() if p.requires_grad]
    # torch's replicate broadcasts every parameter through Broadcast when autograd records it
    # (a parameter requires grad and grad mode is on); else every copy is a detached one
    names = list(named) if trainable and torch.is_grad_enabled() else trainable
    frozen = {n: p for n, p in named.items() if n not in names}

    @_internal("the gradient hook that tags the replicas' weight gradients")
    def tag(g: Optional[torch.Tensor]) -> None:
        if g is not None:
            ledger.retag(g, "gradients")

    if single:  # DataParallel on one device runs the module itself
        hooks = [named[n].register_hook(tag) for n in trainable]
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
            with ledger.forced(card, "weights"), ledger.unmirrored():
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
        return tuple(c for c in cards if plan.runs(c))

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
