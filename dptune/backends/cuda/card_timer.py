"""Each card's forward and backward time in a real step: events on that card's stream.

A :class:`CardTimer` is attached to the model for the measured steps of a probe
(:class:`~dptune.backends.cuda.backend.CudaBackend`). DataParallel's replicas share the
model's hook dictionaries (``replicate`` copies the module's ``__dict__``), so hooks on the
model run in every replica's thread (``parallel_apply`` sets each thread's card and stream),
and on a single card in the caller's thread:

- a forward pre-hook records the **forward start** on the card's current stream, the forward
  hook the **forward end** (the card is found from the replica's input tensors, else the
  thread's current card);
- a gradient hook on each output of the replica records the **backward start** (the first
  gradient that reaches the replica, in autograd's thread for that card);
- the **backward end** is recorded after each autograd node that hands a gradient to a
  parameter sink (DataParallel's ``Broadcast`` or dptune's ``_JoinReplicas``, whose backward
  reduces the gradients onto card 0, or a leaf's ``AccumulateGrad``): the last such node of
  the card is the end of its share of the backward. Finding these nodes walks the replica's
  autograd graph once per forward (host work the timed step includes).

A card's time is the sum over its forwards (one per micro-batch) of ``forward end - forward
start`` plus ``backward end - backward start``: its own work, without the scatter, the
broadcast of the weights, the gather, the loss, the reduction of the gradients and the
optimizer's step (the rest of the step's wall time). Events come from the runtime's clock
(:meth:`dptune.hardware.runtime.CudaRuntime.event_clock`; a test passes a fake one) and
are read after the step's synchronisation.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Protocol, Sequence

from dptune.types import StepTime, TimeSource

__all__ = ["EventClock", "CardTimer", "SINKS", "measured_time"]

#: Autograd nodes that take the parameters' gradients away from a card (their backward runs
#: once for every card, or accumulates into a leaf): a card's backward ends where it feeds them.
SINKS = frozenset({"AccumulateGrad", "BroadcastBackward", "_JoinReplicasBackward", "ScatterBackward"})


class EventClock(Protocol):
    """Timing events on a card's current stream."""

    def record(self, device: int) -> Any: ...

    def elapsed(self, start: Any, end: Any) -> float:
        """Seconds between two recorded events of the same card (after a synchronisation)."""
        ...

    def current_device(self) -> Optional[int]: ...


@dataclass
class _Pass:
    """One forward of the model on one card and its backward."""

    card: int
    fwd_start: Any
    fwd_end: Any = None
    bwd_start: Any = None
    bwd_end: Any = None


def _tensors(obj: Any) -> Iterator[Any]:
    from dptune.step import tree as _tree

    return iter(_tree.leaves(obj))


class CardTimer:
    """Times each card's share of a step (see the module docstring)."""

    def __init__(self, clock: EventClock, device_ids: Sequence[int]):
        self.clock = clock
        self.device_ids = list(device_ids)
        self.passes: list[_Pass] = []
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- which card ----------------------------------------------------------------------
    def _card(self, args: Any, kwargs: Any) -> Optional[int]:
        for t in _tensors((args, kwargs)):
            dev = t.device
            if dev.type == "cuda" and dev.index in self.device_ids:
                return self.device_ids.index(dev.index)
        current = self.clock.current_device()
        if current is not None and current in self.device_ids:
            return self.device_ids.index(current)
        return 0 if len(self.device_ids) == 1 else None

    def _record(self, card: int) -> Any:
        return self.clock.record(self.device_ids[card])

    def _on_card(self, card: int) -> bool:
        """Whether this thread works for ``card`` (autograd runs one thread per card)."""
        current = self.clock.current_device()
        return current is None or current == self.device_ids[card]

    # -- hooks -----------------------------------------------------------------------------
    def _pre(self, module: Any, args: Any, kwargs: Any) -> None:
        card = self._card(args, kwargs)
        self._local.open = None if card is None else _Pass(card, self._record(card))

    def _post(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        p: Optional[_Pass] = getattr(self._local, "open", None)
        self._local.open = None
        if p is None:
            return
        p.fwd_end = self._record(p.card)
        with self._lock:
            self.passes.append(p)
        roots = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None]
        for t in roots:
            t.register_hook(self._starter(p))
        for node in _feeding_sinks([t.grad_fn for t in roots]):
            node.register_hook(self._ender(p))

    def _starter(self, p: _Pass) -> Any:
        def hook(grad: Any) -> None:
            if p.bwd_start is None:
                p.bwd_start = self._record(p.card)
        return hook

    def _ender(self, p: _Pass) -> Any:
        def hook(grad_inputs: Any, grad_outputs: Any) -> None:
            if p.bwd_start is not None and self._on_card(p.card):
                p.bwd_end = self._record(p.card)
        return hook

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator["CardTimer"]:
        """The hooks on ``model`` while the block runs (removed after, also on error)."""
        handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                   model.register_forward_hook(self._post, with_kwargs=True)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    # -- reading ---------------------------------------------------------------------------
    def card_seconds(self, chunk_sizes: Sequence[int]) -> Optional[tuple[float, ...]]:
        """Each card's time in the step just run (0.0 for a card without samples), then the
        record is cleared; ``None`` when a card with samples was not seen (a step that does not
        call the model, or calls it in a way the hooks do not see)."""
        passes, self.passes = self.passes, []
        out = []
        for card, chunk in enumerate(chunk_sizes):
            mine = [p for p in passes if p.card == card]
            if chunk > 0 and not mine:
                return None
            total = 0.0
            for p in mine:
                total += self.clock.elapsed(p.fwd_start, p.fwd_end)
                if p.bwd_start is not None and p.bwd_end is not None:
                    total += self.clock.elapsed(p.bwd_start, p.bwd_end)
            out.append(total if chunk > 0 else 0.0)
        return tuple(out)


def _feeding_sinks(roots: Sequence[Any]) -> list[Any]:
    """The autograd nodes reachable from ``roots`` (not through a sink) that feed a sink."""
    seen: set[int] = set()
    stack = [n for n in roots if n is not None]
    out = []
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        feeds = False
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if type(nxt).__name__ in SINKS:
                feeds = True
            else:
                stack.append(nxt)
        if feeds:
            out.append(node)
    return out


def _median(xs: Sequence[float]) -> float:
    ordered = sorted(xs)
    return ordered[len(ordered) // 2]


def measured_time(step_seconds: Sequence[float],
                  card_seconds: Sequence[Optional[tuple[float, ...]]], ok: bool) -> Optional[StepTime]:
    """The step's time, measured: the median of the measured steps' wall times (each between
    synchronisations of every card, after the warm-up) and, when every measured step timed
    every card with samples (:class:`CardTimer`), each card's median forward and backward
    time; ``serial_seconds`` is then the rest of the step (the step's median minus the slowest
    card's: the scatter, the copies between cards, the loss, the optimizer's step)."""
    if not ok or not step_seconds:
        return None
    step = _median(step_seconds)
    if not card_seconds or any(c is None for c in card_seconds):
        return StepTime(card_seconds=(), step_seconds=step, source=TimeSource.MEASURED)
    runs = [c for c in card_seconds if c is not None]
    cards = tuple(_median([r[i] for r in runs]) for i in range(len(runs[0])))
    return StepTime(card_seconds=cards, step_seconds=step, source=TimeSource.MEASURED,
                    serial_seconds=max(0.0, step - max(cards, default=0.0)))
