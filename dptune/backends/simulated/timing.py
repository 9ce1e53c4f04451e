"""The estimated time of a simulated step, from the step's own operations.

- :class:`OpCost`: What one op costs: FLOPs, bytes read and written, the dtype class of its FLOPs.
- :func:`op_cost`: The cost of one aten op: FLOPs by ``torch.utils.flop_counter``'s formula (0 when it has none: element-wise ops are bound by memory), bytes = its ...
- :class:`OpCounter`: Per-card FLOPs, bytes and seconds of one simulated step (the simulator's op observer).
- :class:`TimedBackend`: A simulated backend whose probes carry the step's estimated time (``ProbeResult.time``).
- :class:`RankStepOps`: One simulated DDP rank's step as :class:`OpCounter` saw it on its card: its kernels' costs, the bytes copied from the host, the ops the host ...
- :func:`counted_rank_step`: Run ``step()`` (a probe of ``backend``, a simulated rank on card r) with an op counter installed; its result and the step's ops (``None`` when no ...
- :class:`RankTimes`: The simulated DDP ranks' step times, the one timer of the DDP plans and the length plans' DDP ranks: each probe run through :meth:`counted` keeps ...
- :func:`count_ops`: Run ``fn`` under fake tensors and return each aten op it dispatched with its cost (for tests and for a quick look at a block).

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/timing.py".
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from dptune.step import tree as _tree
from dptune.backends.simulated.device_rules import HOST
from dptune.backends.base import ProbeResult
from dptune.hardware.speeds import CALIBRATION, Calibration, CardSpeed, ClusterSpeed
from dptune.types import StepTime, TimeSource

__all__ = ["OpCost", "op_cost", "OpCounter", "TimedBackend", "RankStepOps", "counted_rank_step", "RankTimes",
           "count_ops", "ddp_allreduce_seconds"]

_HALF = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_CONV = {"convolution", "convolution_backward", "cudnn_convolution", "_convolution"}
_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
         "_unsafe_view", "_reshape_alias", "alias",
         "lift_fresh", "set_", "resize_"}
_SERIAL = ("outputs", "optimizer", "other")   # categories of card 0's own phases (loss, step, clip)


class OpCost(NamedTuple):
    """What one op costs: FLOPs, bytes read and written, the dtype class of its FLOPs."""

    flops: int
    bytes: int
    kind: str           # fp32, tf32, fp16, bf16
    kernel: bool        # a kernel runs (not a view or an allocation)

    def seconds(self, speed: CardSpeed, cal: Calibration = CALIBRATION) -> float:
        """The op's time on the card: the roofline at ``cal``'s efficiencies, plus the
        kernel's fixed time (0 for a view or an allocation)."""
        if not self.kernel:
            return 0.0
        compute = self.flops / (speed.peak(self.kind) * cal.efficiency(self.kind)) if self.flops else 0.0
        return max(compute, self.bytes / (speed.bandwidth * cal.memory)) + cal.kernel_seconds


def _nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.numel()) * t.element_size()
    except Exception:   # a symbolic size with no hint: not counted
        return 0


def _kind(name: str, args: Any) -> str:
    for t in _tree.leaves(args):
        if t.is_floating_point():
            half = _HALF.get(t.dtype)
            if half is not None:
                return half
            if t.dtype == torch.float32 and name in _CONV and torch.backends.cudnn.allow_tf32:
                return "tf32"
            if t.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
                return "tf32"
            return "fp32"
    return "fp32"


def op_cost(func: Any, args: Any, kwargs: Any, out: Any) -> OpCost:
    """The cost of one aten op: FLOPs by ``torch.utils.flop_counter``'s formula (0 when it has
    none: element-wise ops are bound by memory), bytes = its tensor inputs plus outputs."""
    from torch.utils.flop_counter import flop_registry

    name = getattr(func, "__name__", "").split(".")[0]
    if getattr(func, "namespace", "aten") != "aten" or getattr(func, "is_view", False) or name in _FREE:
        return OpCost(0, 0, "fp32", False)
    packet = getattr(func, "_overloadpacket", None)
    formula = flop_registry.get(packet)
    flops = 0
    if formula is not None:
        try:
            flops = int(formula(*args, **(kwargs or {}), out_val=out))
        except Exception:   # a formula that cannot read these shapes: memory-bound then
            flops = 0
    moved = sum(_nbytes(t) for t in _tree.leaves((args, kwargs or {})))
    moved += sum(_nbytes(t) for t in _tree.leaves(out))
    return OpCost(flops, moved, _kind(name, args) if flops else "fp32", True)


class OpCounter:
    """Per-card FLOPs, bytes and seconds of one simulated step (the simulator's op observer).

    ``ledger`` is read at each op (``backend._ledger``): which card a copy goes to and from,
    and the step's phase. A new ledger (the simulator starting over with symbolic sizes)
    restarts the counts. The host's work: ``ops[i]``, the aten ops dispatched for card i's
    replica and the copies made for it (a copy counts for the card it goes to, the reduction
    of the gradients for the card they come from); ``serial_ops``, the others (card 0's own
    phases: loss, optimizer; the host's own ops).
    """

    def __init__(self, ledger_of: Callable[[], Any], speed: ClusterSpeed, keep: bool = False):
        self._ledger_of, self.speed, self.keep = ledger_of, speed, keep
        self._ledger_id: Optional[int] = None
        self._reset()

    def _reset(self) -> None:
        n = len(self.speed.cards)
        self.flops, self.bytes, self.kernels = [0] * n, [0] * n, [0] * n
        self.compute = [0.0] * n          # seconds of each card's own work
        self.serial = 0.0                 # card 0's own phases (loss, clip, optimizer)
        self.host_in = [0] * n            # bytes copied from the host to each card
        self.bcast = [0] * n              # weights broadcast to card k
        self.reduce = [0] * n             # gradients reduced from card k
        self.serial_copy = 0              # bytes of the gather and its backward
        self.serial_pairs: dict[tuple[int, int], int] = {}   # the same, by (from, to) card
        self.ops = [0] * n                # aten ops dispatched for each card's replica
        self.serial_ops = 0               # the others: card 0's own, the host's, most copies
        self.costs: list[tuple[int, OpCost]] = []   # (card, cost) of every kernel, if kept

    def __call__(self, func: Any, args: Any, kwargs: Any, out: Any, card: int) -> None:
        ledger = self._ledger_of()
        if id(ledger) != self._ledger_id:
            self._ledger_id = id(ledger)
            self._reset()
        dst = ledger.forced_card
        self._count_op(func, ledger, card if dst is None else self._copy_card(ledger, args, dst),
                       dst is not None)
        if dst is not None:
            self._copy(ledger, func, args, kwargs, dst)
            return
        if card == HOST:
            return
        cost = op_cost(func, args, kwargs, out)
        if not cost.kernel:
            return
        self.flops[card] += cost.flops
        self.bytes[card] += cost.bytes
        self.kernels[card] += 1
        if self.keep:
            self.costs.append((card, cost))
        seconds = cost.seconds(self.speed.cards[card])
        if ledger.category in _SERIAL:
            self.serial += seconds
        else:
            self.compute[card] += seconds

    @staticmethod
    def _copy_card(ledger: Any, args: Any, dst: int) -> int:
        """The card a DataParallel copy is made for: the card its data comes from for the
        reduction of the gradients onto card 0, else the card it goes to."""
        if ledger.category == "gradients":
            srcs = {ledger.card_of(t) for t in _tree.leaves(args)} - {dst, HOST}
            if len(srcs) == 1:
                return srcs.pop()
        return dst

    def _count_op(self, func: Any, ledger: Any, card: int, copy: bool) -> None:
        """One op the host dispatches, for card ``card``'s replica (its own ops, the copies
        made for it) or for the serial part (card 0's own phases, the host's ops)."""
        if getattr(func, "namespace", "") != "aten":        # prim.device queries, profiler marks
            return
        if card != HOST and (copy or ledger.category not in _SERIAL):
            self.ops[card] += 1
        else:
            self.serial_ops += 1

    def restart(self) -> None:
        """Forget the ops counted so far (the simulator runs the step again)."""
        self._reset()

    def uncopy(self, src: int, dst: int, t: torch.Tensor) -> None:
        """Take back a copy of ``t`` from ``src`` to ``dst`` counted in the gather, where the
        simulator read a like card's output for card 0's own (sharing.mirror)."""
        b = _nbytes(t)
        self.serial_copy -= b
        self.serial_pairs[(src, dst)] -= b

    def _copy(self, ledger: Any, func: Any, args: Any, kwargs: Any, dst: int) -> None:
        """A DataParallel copy onto card ``dst``: bytes read from other places."""
        if not op_cost(func, (), {}, ()).kernel:     # an allocation, a view: nothing copied
            return
        cat = ledger.category
        for t in _tree.leaves((args, kwargs or {})):
            src = ledger.card_of(t)
            if src == dst or dst == HOST:
                continue
            b = _nbytes(t)
            if src == HOST:
                self.host_in[dst] += b
            elif cat == "weights":
                self.bcast[dst] += b
            elif cat == "gradients":
                self.reduce[src] += b
            else:                          # the gather, its backward, the batch for the loss
                self.serial_copy += b
                self.serial_pairs[(src, dst)] = self.serial_pairs.get((src, dst), 0) + b

    def step_time(self, chunk_sizes: Sequence[int], replicas: Sequence[int] = ()) -> StepTime:
        """DataParallel's step: on the cards, the scatter and each replica in parallel, then
        card 0's serial work and the copies between cards; on the host, every replica's ops
        and card 0's one after another; the step is the longer (the model: docs/concepts/design-notes.md).
        ``replicas[i]``: the card whose replica the simulator ran for card i (cards of a class
        simulated once)."""
        if replicas and len(replicas) == len(chunk_sizes):
            for name in ("compute", "host_in", "bcast", "reduce", "flops", "bytes", "kernels", "ops"):
                per_card = getattr(self, name)
                setattr(self, name, [per_card[r] for r in replicas])
            # a card its class's replica stood for: the replica's copies out of it are repeated
            # for the card by the simulator's gather, those into it (the gather's backward) not
            for i, r in enumerate(replicas):
                if r != i:
                    self.serial_copy += sum(b for (src, dst), b in self.serial_pairs.items()
                                            if dst == r and src != r)
        link = self.speed.link
        cards = tuple((self.compute[i] + self.host_in[i] / link.host_bandwidth) if c > 0 else 0.0
                      for i, c in enumerate(chunk_sizes))
        transfer = (max(self.bcast) + max(self.reduce)) / link.bandwidth
        gather = self.serial_copy / link.bandwidth
        serial = self.serial + gather
        per_op = self.speed.host_seconds_per_op
        card_host = tuple(self.ops[i] * per_op if c > 0 else 0.0 for i, c in enumerate(chunk_sizes))
        host = sum(card_host) + self.serial_ops * per_op
        device = max(cards) + serial + transfer
        return StepTime(card_seconds=cards, step_seconds=max(host, device),
                        source=TimeSource.ESTIMATED, serial_seconds=serial,
                        transfer_seconds=transfer, gather_seconds=gather, flops=tuple(self.flops),
                        bytes_moved=tuple(self.bytes), host_seconds=host,
                        card_host_seconds=card_host)


def ddp_allreduce_seconds(grad_bytes: int, ranks: int, bandwidth: float) -> float:
    """A ring all-reduce of ``grad_bytes`` over ``ranks``: ``2 (n-1)/n`` times the bytes."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * grad_bytes / bandwidth


class TimedBackend:
    """A simulated backend whose probes carry the step's estimated time (``ProbeResult.time``).

    Everything else is the wrapped backend's (devices, ``describe``, ``close``...).
    """

    def __init__(self, backend: Any):
        self.backend = backend
        cluster = backend.cluster
        self.speed = ClusterSpeed.of(cluster.names, cluster.spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    @property
    def devices(self) -> Any:
        return self.backend.devices

    def describe(self) -> str:
        return str(self.backend.describe())

    def close(self) -> None:
        self.backend.close()

    def counter(self) -> OpCounter:
        return OpCounter(lambda: self.backend._ledger, self.speed)

    def probe(self, chunk_sizes: Sequence[int], output_device: int = 0) -> ProbeResult:
        counter = self.counter()
        self.backend.op_observer = counter
        try:
            if output_device:
                r = self.backend.probe(chunk_sizes, output_device=output_device)
            else:
                r = self.backend.probe(chunk_sizes)
        finally:
            self.backend.op_observer = None
        return dataclasses.replace(r, time=counter.step_time(
            r.chunk_sizes, getattr(self.backend, "last_replicas", ())))


@dataclasses.dataclass(frozen=True)
class RankStepOps:
    """One simulated DDP rank's step as :class:`OpCounter` saw it on its card: its kernels'
    costs, the bytes copied from the host, the ops the host dispatched. Timed against any
    card's speed, so ranks of one card type that share a simulator share it."""

    costs: tuple[OpCost, ...]
    host_in: int
    ops: int

    def card_seconds(self, speed: ClusterSpeed, r: int) -> float:
        """Rank r's card work: its kernels against its card's peaks, the batch's copy from
        the host over the host link."""
        return (sum(c.seconds(speed.cards[r]) for c in self.costs)
                + self.host_in / speed.link.host_bandwidth)

    def host_seconds(self, speed: ClusterSpeed) -> float:
        """The host's time to issue the step: its ops x the host's cost per op."""
        return self.ops * speed.host_seconds_per_op


def counted_rank_step(backend: Any, speed: ClusterSpeed, r: int,
                      step: Callable[[], Any]) -> tuple[Any, Optional[RankStepOps]]:
    """Run ``step()`` (a probe of ``backend``, a simulated rank on card r) with an op counter
    installed; its result and the step's ops (``None`` when no kernel ran)."""
    counter = OpCounter(lambda: backend._ledger, ClusterSpeed((speed.cards[r],), speed.link), keep=True)
    backend.op_observer = counter
    try:
        out = step()
    finally:
        backend.op_observer = None
    if not counter.kernels[0]:
        return out, None
    return out, RankStepOps(tuple(c for _, c in counter.costs), counter.host_in[0],
                            counter.ops[0] + counter.serial_ops)


class RankTimes:
    """The simulated DDP ranks' step times, the one timer of the DDP plans and the length
    plans' DDP ranks: each probe run through :meth:`counted` keeps its step's ops
    (:class:`RankStepOps`), per card type (ranks of one type share one simulator and its
    memo), ``key`` (the sample's length, or ``None``) and batch, and they are timed against
    each rank's own speed (two cards of one type may be given different speeds)."""

    def __init__(self, names: Sequence[str], speed: ClusterSpeed):
        self.names, self.speed = tuple(names), speed
        self.ops: dict[tuple[str, Any, int], RankStepOps] = {}

    def counted(self, backend: Any, r: int, b: int, step: Callable[[], Any], key: Any = None) -> Any:
        """``step()`` (rank r's probe at batch b on ``backend``) run with the op counter; its
        result. The step's ops are kept (none when no kernel ran)."""
        out, ops = counted_rank_step(backend, self.speed, r, step)
        if ops is not None:
            self.ops[(self.names[r], key, b)] = ops
        return out

    def seconds(self, r: int, b: int, key: Any = None) -> Optional[float]:
        """Rank r's card work at batch b (its ops against its card's peaks, the batch's copy
        from the host); ``None`` when not probed."""
        ops = self.ops.get((self.names[r], key, b))
        return None if ops is None else ops.card_seconds(self.speed, r)

    def host_seconds(self, r: int, b: int, key: Any = None) -> Optional[float]:
        """Rank r's host's time to issue its step at batch b (its ops x the host's cost per
        op); ``None`` when not probed."""
        ops = self.ops.get((self.names[r], key, b))
        return None if ops is None else ops.host_seconds(self.speed)


def count_ops(fn: Callable[[], Any]) -> list[tuple[str, OpCost]]:
    """Run ``fn`` under fake tensors and return each aten op it dispatched with its cost
    (for tests and for a quick look at a block)."""
    from dptune._torch_private import dispatch_mode_base, fake_tensor_mode

    seen: list[tuple[str, OpCost]] = []

    class _Count(dispatch_mode_base()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            seen.append((str(func), op_cost(func, args, kwargs, out)))
            return out

    with fake_tensor_mode(allow_non_fake_inputs=True), _Count():
        fn()
    return seen
