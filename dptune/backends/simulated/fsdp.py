"""The simulated cluster in "fsdp" mode: one FSDP2 (``fully_shard``) rank on one virtual card.

- :class:`SimulatedFSDPRank`: One FSDP2 rank of ``world_size`` on one virtual card (the model: docs/concepts/design-notes.md).

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/fsdp.py".
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Union

import torch.nn as nn

from dptune._torch_private import dispatch_mode_base, dtensor_meta_aside, storage_resize_hook
from dptune.hardware.cluster import Cluster, parse_cluster
from dptune.backends.fsdp import FakeGroup, apply_shard
from dptune.backends.simulated.backend import SimulatedBackend
from dptune.backends.simulated.device_rules import HOST
from dptune.backends.simulated.fake_model import _eager, _fake_module, warmed_optimizer
from dptune.backends.simulated.ledger import _Ledger, _rounded
from dptune.errors import UsageError
from dptune.step.workload import Workload, gradient_checkpointing, has_batchnorm

__all__ = ["SimulatedFSDPRank", "FakeGroup", "ShardFn"]

#: ``shard(model, mesh)``: calls ``fully_shard`` on the model's parts and its root; may
#: return the model (or ``None``)
ShardFn = Callable[[nn.Module, Any], Any]


class _FSDPLedger(_Ledger):
    """The simulator's ledger, also following storages resized in place."""

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Ops that are no part of the rank's step (DTensor's sharding propagation runs each
        op on fake tensors of the global shapes, for its output's metadata; a real card
        does that under a fake mode of its own): their storages on the host, not timed."""
        observer, self.observer = self.observer, None
        try:
            with self.forced(HOST):
                yield
        finally:
            self.observer = observer

    def resized(self, st: Any, old_nbytes: int) -> None:
        rec = self._records.get(id(st))
        if rec is None or rec.ref() is not st:
            return
        raw = int(st.nbytes())
        new = _rounded(raw)
        old, delta = rec.nbytes, new - rec.nbytes
        card = rec.card
        if card == HOST or not delta:
            rec.nbytes, rec.raw = new, raw or new
            return
        # for the allocator trace a resize is a free and a new allocation
        if self.on_event is not None and old:
            self.on_event(card, -rec.raw, rec.seq, 0)
        self._seq += 1
        rec.nbytes, rec.raw, rec.seq = new, raw or new, self._seq
        if self.on_event is not None and new:
            self.on_event(card, rec.raw, rec.seq, self.stream)
        self.live[card] += delta
        self.by_cat[card][rec.category] += delta
        if self.live[card] > self.peak[card]:
            self.peak[card] = self.live[card]
            self.peak_breakdown[card] = dict(self.by_cat[card])
            self._peak_seq[card] = self._seq


def _dtensor_local_mode() -> Any:
    """A dispatch mode that lets ``DTensor`` unwrap an op to its local shards before the
    simulator's ledger sees it (the ledger charges storages, which only local tensors have)."""
    from torch.distributed.tensor import DTensor

    class _Local(dispatch_mode_base()):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))

    return _Local()


class SimulatedFSDPRank(SimulatedBackend):
    """One FSDP2 rank of ``world_size`` on one virtual card (the model: docs/concepts/design-notes.md).

    ``shard(model, mesh)`` applies ``fully_shard`` (:func:`dptune.ddp.fsdp.default_shard`
    shards each block of a ``ModuleList`` then the root). ``estimate([b])`` and
    ``probe([b])`` work as for a one-card :class:`SimulatedBackend`, ``b`` being this
    rank's local batch. ``group`` is a :class:`FakeGroup` to use (default: one made on
    first use and closed by :meth:`close`). ``reserved`` (a
    :class:`~dptune.backends.simulated.reserved.ReservedModel`): ``probe`` also replays the rank's trace
    through the allocator model (a storage FSDP2 resizes is a free and a new block there);
    FSDP2's all-gather and reduce-scatter streams are not modelled (every block on stream 0).
    """

    supports_output_device = False

    def __init__(self, workload: Workload, card: Union[str, Cluster], world_size: int,
                 shard: ShardFn, *, rank: int = 0, group: Optional[FakeGroup] = None,
                 reserved: Any = None):
        cluster = parse_cluster(card)
        if len(cluster) != 1:
            raise UsageError(f"an FSDP rank runs on one card; {cluster.describe()!r} has {len(cluster)}")
        if not callable(shard):
            raise UsageError(f"shard must be a function shard(model, mesh), got {type(shard).__name__}")
        super().__init__(workload, cluster, reserved=reserved)   # reserved: a ReservedModel
        self.world_size, self.rank, self.shard = world_size, rank, shard
        self._group, self._owns_group = group, group is None

    def describe(self) -> str:
        return f"{self.cluster.describe()} (simulated FSDP2 rank of {self.world_size})"

    @contextlib.contextmanager
    def _modes(self, ledger: _Ledger) -> Iterator[None]:
        assert isinstance(ledger, _FSDPLedger)
        with super()._modes(ledger), storage_resize_hook(ledger.resized), \
                dtensor_meta_aside(ledger.aside), _dtensor_local_mode():
            yield

    def _setup(self) -> None:
        if self._ledger is not None:
            return
        if self._group is None:
            self._group = FakeGroup(self.world_size, self.rank)
        ledger = _FSDPLedger(1)
        if self.reserved is not None:    # the allocator model, wired as the base class does
            from dptune.backends.simulated.reserved import TraceRecorder

            ledger.on_event = self._recorder = TraceRecorder(1)
        with self._modes(ledger):
            with ledger.on(0, "weights"):
                module, self._compiled = _eager(_fake_module(self.workload.model))
                module.train(self.workload.model.training
                             if isinstance(self.workload.model, nn.Module) else True)
                self.has_batchnorm = has_batchnorm(module)
                self.gradient_checkpointing = gradient_checkpointing(module)
                for t in list(module.parameters()) + list(module.buffers()):
                    ledger.charge(t, 0, "weights")
                module = self._apply_shard(module)
            optimizer = self._make_optimizer(ledger, [p for p in module.parameters() if p.requires_grad])
        self._ledger, self._module, self._optimizer = ledger, module, optimizer
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._setup_bytes = list(ledger.live)

    def _apply_shard(self, module: nn.Module) -> nn.Module:
        assert self._group is not None
        return apply_shard(self.shard, module, self._group.mesh)

    def _make_optimizer(self, ledger: _Ledger, params: list) -> Any:
        """The optimizer over the sharded parameters, its state created as by a warm-up step."""
        return warmed_optimizer(self.workload.optimizer, ledger, params)

    def close(self) -> None:
        super().close()
        if self._owns_group and self._group is not None:
            self._group.close()
            self._group = None
