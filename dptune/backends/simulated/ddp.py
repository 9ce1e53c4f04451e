"""The simulated cluster in "ddp" mode: one ``DistributedDataParallel`` rank per virtual card.

A rank runs the simulator's single-card step (the model, its batch of ``b`` samples moved
from the host to the card, the loss, the backward and the optimizer step, all on its own
card: nothing is gathered) with DDP's own memory added as the Reducer allocates it (see
:mod:`dptune.backends.simulated.ddp_memory`):

- the gradient buckets, one flat tensor per bucket, allocated before the step and kept
  (category ``gradients``);
- with ``gradient_as_bucket_view=True``, each gradient is copied into its bucket as soon
  as autograd has accumulated it and ``param.grad`` becomes a view of the bucket, so the
  fresh gradient is freed at once (the Reducer does this in a post-hook of the gradient
  accumulator; here ``register_post_accumulate_grad_hook``).

The step starts from ``grad = None`` (``zero_grad(set_to_none=True)``, torch's default).
Ranks are independent: a rank's peak depends only on its own batch and its card (the cuBLAS
workspace is larger on Hopper cards), so :class:`SimulatedDDP` builds one single-card
simulator per card type and reuses it. Everything the single-card simulator does not model
(see :mod:`dptune.backends.simulated`) is not modelled here either, nor are NCCL's buffers
and the per-forward broadcast of buffers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from dptune.backends.base import Capabilities, Device, ProbeResult
from dptune.backends.simulated.ddp_memory import Bucket, DDPOptions, bucket_layout, params_of
from dptune.budget import Collectives, FixedCosts
from dptune.backends.simulated.reserved import ReservedModel, merge_rank_probes
from dptune.hardware.cluster import DEFAULT_CLUSTER, Cluster, parse_cluster
from dptune.backends.simulated.backend import MemoryEstimate, SimulatedBackend
from dptune.errors import UsageError
from dptune.types import BackendKind
from dptune.step.workload import StepOutcome, Workload

DEFAULT_OPTIONS = DDPOptions()

__all__ = ["SimulatedDDPRank", "SimulatedDDP", "estimate_ddp_memory", "card_of", "make_workload"]


def card_of(cluster: Cluster, rank: int) -> Cluster:
    """The one-card cluster of ``cluster``'s card ``rank`` (same size, memory taken, context)."""
    return Cluster(names=(cluster.names[rank],), total_bytes=(cluster.total_bytes[rank],),
                   used_bytes=(cluster.used_bytes[rank],), context_bytes=cluster.context_bytes,
                   spec=cluster.names[rank])


class SimulatedDDPRank(SimulatedBackend):
    """One DDP rank on one virtual card: the single-card step plus the Reducer's buckets.

    ``estimate([b])`` and ``probe([b])`` work as for a one-card :class:`SimulatedBackend`;
    ``buckets`` is the bucket layout (after the first :meth:`estimate`).
    """

    def __init__(self, workload: Workload, card: Union[str, Cluster], options: DDPOptions = DEFAULT_OPTIONS,
                 reserved: Optional[ReservedModel] = None):
        cluster = parse_cluster(card)
        if len(cluster) != 1:
            raise UsageError(f"a DDP rank runs on one card; {cluster.describe()!r} has {len(cluster)}")
        super().__init__(workload, cluster, reserved=reserved)
        self.options = options
        self.buckets: list[Bucket] = []
        self._bucket_tensors: list[torch.Tensor] = []
        self._views: dict[int, torch.Tensor] = {}      # id(param) -> its slice of a bucket

    def describe(self) -> str:
        return f"{self.cluster.describe()} (simulated DDP rank)"

    def _setup(self) -> None:
        if self._ledger is not None:
            return
        super()._setup()
        ledger, module = self._ledger, self._module
        assert ledger is not None and module is not None
        params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.buckets = bucket_layout(params_of(module), self.options)
        with self._modes(ledger), ledger.forced(0, "gradients"):
            for b in self.buckets:
                dtype = params[b.params[0]].dtype
                flat = torch.empty(b.numel, dtype=dtype)
                self._bucket_tensors.append(flat)
                offset = 0
                for i in b.params:
                    p = params[i]
                    self._views[id(p)] = flat.narrow(0, offset, p.numel()).view(p.shape)
                    offset += p.numel()
        self._setup_bytes = list(ledger.live)

    def ddp_bytes(self) -> int:
        """Bytes of the Reducer's buckets on this card (builds the fake model if needed)."""
        self._setup()
        return sum(b.allocated_bytes for b in self.buckets)

    def _to_bucket(self, p: torch.Tensor) -> None:
        view = self._views[id(p)]
        if p.grad is not None and p.grad is not view:
            view.copy_(p.grad)
            p.grad = view

    def _step(self, sizes: list[int], output_device: int = 0) -> StepOutcome:
        hooks = []
        if self.options.gradient_as_bucket_view:
            assert self._module is not None
            hooks = [p.register_post_accumulate_grad_hook(self._to_bucket)
                     for p in self._module.parameters() if p.requires_grad]
        try:
            return super()._step(sizes, output_device)
        finally:
            for h in hooks:
                h.remove()

    def close(self) -> None:
        self._bucket_tensors, self._views = [], {}
        super().close()


class SimulatedDDP:
    """A simulated cluster in "ddp" mode: rank ``r`` runs on card ``r``.

    ``estimate(batch_sizes)`` gives one peak per rank (each rank's own step, see the module
    docstring); ``probe(batch_sizes)`` the same as a :class:`ProbeResult`, with the rank most
    over its card's memory as ``oom_device``.
    """

    kind = BackendKind.SIMULATED
    capabilities = Capabilities.simulated(output_device=False)

    def __init__(self, workload: Workload, cluster: Union[str, Cluster] = DEFAULT_CLUSTER,
                 options: DDPOptions = DEFAULT_OPTIONS, reserved: Optional[ReservedModel] = None):
        self.workload = workload
        self.cluster = parse_cluster(cluster)
        self.devices: list[Device] = self.cluster.devices
        self.options = options
        # the allocator model per rank; NCCL's buffers as for a world of all the ranks
        self.reserved = None if reserved is None else dataclasses.replace(
            reserved, fixed=FixedCosts(reserved.fixed.nccl_for(len(self.cluster), Collectives.DDP)))
        self._by_name: dict[str, SimulatedDDPRank] = {}

    def describe(self) -> str:
        return f"{self.cluster.describe()} (simulated, DDP)"

    def rank(self, r: int) -> SimulatedDDPRank:
        """The single-card simulator of rank ``r``'s card (shared by cards of one type)."""
        if not 0 <= r < len(self.cluster):
            raise UsageError(f"rank {r} is not in 0..{len(self.cluster) - 1} for {self.cluster.describe()}")
        name = self.cluster.names[r]
        if name not in self._by_name:
            self._by_name[name] = SimulatedDDPRank(self.workload, card_of(self.cluster, r), self.options,
                                                   self.reserved)
        return self._by_name[name]

    def estimate(self, batch_sizes: Sequence[int]) -> MemoryEstimate:
        sizes = list(batch_sizes)
        if len(sizes) != len(self.cluster) or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                                  for b in sizes):
            raise UsageError(f"batch_sizes must be one int >= 1 per rank ({len(self.cluster)} ranks), "
                             f"got {sizes!r}")
        ests = [self.rank(r).estimate([b]) for r, b in enumerate(sizes)]
        return MemoryEstimate(chunk_sizes=tuple(sizes), peak_bytes=[e.peak_bytes[0] for e in ests],
                              breakdown=[e.breakdown[0] for e in ests],
                              baseline_bytes=[e.baseline_bytes[0] for e in ests],
                              cluster=self.cluster, seconds=sum(e.seconds for e in ests))

    def probe(self, batch_sizes: Sequence[int]) -> ProbeResult:
        if self.reserved is not None:    # each rank's own probe: its trace is replayed at once
            self.estimate(batch_sizes)   # (checks the sizes)
            return merge_rank_probes([self.rank(r).probe([b]) for r, b in enumerate(batch_sizes)],
                                     self.devices)
        est = self.estimate(batch_sizes)
        over = [(p - d.available_bytes) / d.available_bytes for p, d in zip(est.peak_bytes, self.devices)]
        worst = max(range(len(over)), key=lambda i: over[i])
        return ProbeResult(chunk_sizes=est.chunk_sizes, peak_bytes=tuple(est.peak_bytes),
                           oom_device=worst if over[worst] > 0 else None,
                           breakdown=tuple(est.breakdown), seconds=est.seconds, note="simulated DDP")

    def close(self) -> None:
        for r in self._by_name.values():
            r.close()
        self._by_name = {}


def estimate_ddp_memory(model: Union[nn.Module, Callable[[], nn.Module]], sample: Callable[[int], Any],
                        batch_sizes: Sequence[int], cluster: Union[str, Cluster] = DEFAULT_CLUSTER, *,
                        loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                        optimizer: Optional[Callable[..., Any]] = None,
                        bucket_cap_mb: Optional[float] = None, gradient_as_bucket_view: bool = False,
                        **step_options: Any) -> MemoryEstimate:
    """Per-rank peak memory (bytes) of one DDP training step on a simulated cluster.

    Rank ``r`` runs on card ``r`` of ``cluster`` with a local batch of ``batch_sizes[r]``.
    ``bucket_cap_mb`` and ``gradient_as_bucket_view`` are DDP's arguments; ``step_options``
    (``amp``, ``accumulate``, ...) describe the step as for :func:`dptune.estimate_memory`.
    The model, its weights and buffers are left untouched.
    """
    workload = make_workload(model, sample, loss_fn, optimizer, step_options)
    sim = SimulatedDDP(workload, cluster, DDPOptions(bucket_cap_mb, gradient_as_bucket_view))
    try:
        return sim.estimate(batch_sizes)
    finally:
        sim.close()


def make_workload(model: Any, sample: Any, loss_fn: Any, optimizer: Any,
                  step_options: dict[str, Any]) -> Workload:
    """``Workload(model, sample, loss_fn, optimizer, **step_options)``, with an unknown step
    option reported as a usage error rather than a ``TypeError``."""
    try:
        return Workload(model, sample, loss_fn, optimizer, **step_options)
    except TypeError as e:
        if step_options:
            raise UsageError(f"unknown step option among {sorted(step_options)} ({e}); the step "
                             "options are those of dptune.Workload (amp, accumulate, "
                             "clip_grad_norm, step)") from None
        raise

