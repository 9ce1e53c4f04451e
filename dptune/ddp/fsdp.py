"""FSDP2 (``fully_shard``) in the per-rank plan: the default sharding and the simulated rank.

``dptune.ddp.plan(..., strategy="fsdp")`` plans per-rank batches for a model sharded with
FSDP2 exactly as for DDP (the same rounds, fits, certification, plan object, sampler and
loss scaling); only a rank's memory differs: each probe runs one FSDP2 rank under fake
tensors with a fake process group of the job's world size
(:class:`dptune.backends.simulated.fsdp.SimulatedFSDPRank`).

**Why the loss scaling is the same.** FSDP2's reduce-scatter averages the ranks' gradients
with equal weights (it divides the sum by the world size), as DDP's all-reduce does. Every
rank must run the same number of forward/backward passes per step so that the collectives
line up; the local batches may differ. So rank r's loss times ``W·b_r/B``
(:meth:`DDPPlan.scale_loss`) makes each sharded gradient the mean over the global batch.

**The sharding.** ``shard(model, mesh)`` is the user's function (it calls ``fully_shard``
on the parts and then on the root, with the arguments the training script uses). Without
one, :func:`default_shard` shards every block of the model's outermost ``ModuleList``\\ s
(a transformer's layers), then the root, with the ``reshard_after_forward`` and
``mp_policy`` given to ``plan``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dptune.budget import Collectives, FixedCosts
from dptune.budget import at_level
from dptune.ddp.ranks import SimulatedRank
from dptune.errors import UsageError

__all__ = ["FSDPOptions", "default_shard", "repeated_blocks", "mixed_precision", "SimulatedFSDPProber",
           "CudaFSDPProber"]


def repeated_blocks(model: Any) -> list:
    """The children of the model's outermost ``ModuleList``\\ s, in module order (a
    ``ModuleList`` inside one of them is part of that block)."""
    import torch.nn as nn

    lists: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and mod is not model \
                and not any(name.startswith(f"{outer}.") for outer in lists):
            lists.append(name)
    return [child for name in lists for child in model.get_submodule(name).children()]


def default_shard(model: Any, mesh: Any, *, reshard_after_forward: bool = True,
                  mp_policy: Any = None) -> Any:
    """``fully_shard`` each block of the model's outermost ``ModuleList``\\ s, then the root
    (torchtitan's and torch's examples shard a transformer this way)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = dict(mesh=mesh, reshard_after_forward=reshard_after_forward,
                                  mp_policy=mp_policy if mp_policy is not None else MixedPrecisionPolicy())
    for block in repeated_blocks(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


@dataclass(frozen=True)
class FSDPOptions:
    """How the model is sharded: the user's ``shard(model, mesh)`` function, or the default
    (:func:`default_shard`) with ``reshard_after_forward`` and ``mp_policy`` (a
    ``torch.distributed.fsdp.MixedPrecisionPolicy``)."""

    shard: Optional[Callable[[Any, Any], Any]] = None
    reshard_after_forward: bool = True
    mp_policy: Any = None

    def __post_init__(self) -> None:
        if self.shard is not None and not callable(self.shard):
            raise UsageError(f"shard must be a function shard(model, mesh) that calls fully_shard, "
                             f"got {type(self.shard).__name__}")
        if not isinstance(self.reshard_after_forward, bool):
            raise UsageError(f"reshard_after_forward must be True or False, got "
                             f"{self.reshard_after_forward!r}")
        if self.shard is not None and (self.mp_policy is not None or not self.reshard_after_forward):
            raise UsageError("with your own shard function, give reshard_after_forward and "
                             "mp_policy to fully_shard inside it (they set the default sharding only)")
        if self.mp_policy is not None:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            if not isinstance(self.mp_policy, MixedPrecisionPolicy):
                raise UsageError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, "
                                 f"got {type(self.mp_policy).__name__}")

    def shard_fn(self) -> Callable[[Any, Any], Any]:
        if self.shard is not None:
            return self.shard
        raf, mp = self.reshard_after_forward, self.mp_policy
        return lambda model, mesh: default_shard(model, mesh, reshard_after_forward=raf, mp_policy=mp)

    def describe(self) -> str:
        if self.shard is not None:
            return f"FSDP2 sharded by {getattr(self.shard, '__name__', 'your shard function')}"
        mp = ""
        if self.mp_policy is not None:
            p, r = self.mp_policy.param_dtype, self.mp_policy.reduce_dtype
            mp = f", params in {str(p).replace('torch.', '') if p else 'their dtype'}, " \
                 f"gradients reduced in {str(r).replace('torch.', '') if r else 'the param dtype'}"
        return (f"FSDP2: fully_shard on each ModuleList block then the root, reshard_after_forward="
                f"{self.reshard_after_forward}{mp}")


class SimulatedFSDPProber(SimulatedRank):
    """Rank ``rank`` on card ``rank`` of a simulated cluster, as one FSDP2 rank of
    ``len(cluster)`` (the planner's prober interface, as ``_SimulatedProber`` for DDP).

    Ranks simulated in one process share one fake process group and one simulator per card
    type, each rank simulated as rank 0, whose shards are the largest (so its peak bounds
    the others', see :mod:`dptune.backends.simulated.fsdp`); inside a job the rank simulates
    its own shards. ``shared`` holds them."""

    _GROUP = "fsdp-group"

    def __init__(self, workload: Any, cluster: Any, rank: int, options: FSDPOptions,
                 headroom_bytes: int, host: Optional[str], shared: dict, reserved: Any = None):
        import torch.distributed as dist

        from dptune.backends.simulated.ddp import card_of
        from dptune.backends.fsdp import FakeGroup
        from dptune.backends.simulated.fsdp import SimulatedFSDPRank
        from dptune.step.workload import model_name

        self.device = cluster.devices[rank]
        if self._GROUP not in shared:
            # inside a job this process is rank `rank` of it; offline one process plays them all
            shared[self._GROUP] = [FakeGroup(len(cluster), rank if dist.is_initialized() else 0), 0]
        shared[self._GROUP][1] += 1
        self._shared = shared
        card = ("fsdp", cluster.names[rank])
        try:
            if card not in shared:
                # at the reserved level NCCL's buffers as for a world of all the ranks
                model = None if reserved is None else dataclasses.replace(
                    reserved, fixed=FixedCosts(reserved.fixed.nccl_for(len(cluster), Collectives.FSDP)))
                shared[card] = (SimulatedFSDPRank(workload, card_of(cluster, rank), len(cluster),
                                                  options.shard_fn(), group=shared[self._GROUP][0],
                                                  reserved=model), {})
        except BaseException:
            self._release()
            raise
        self.backend, self._memo = shared[card]
        self.workload, self.headroom, self.host = workload, headroom_bytes, host
        self.name = model_name(workload.model)

    def info(self) -> Any:
        from dptune.ddp.ranks import RankInfo, min_batch, step_settings

        self.backend._setup()     # builds and shards the model now: its errors belong to round 0
        return RankInfo(device=self.device, host=self.host,
                         budget_bytes=self.device.budget_bytes(self.headroom), ddp_bytes=0,
                        min_batch=min_batch(self.workload.model), model_name=self.name,
                        settings=step_settings(self.workload))

    def close(self) -> None:
        self.backend.close()
        self._release()

    def _release(self) -> None:
        """The fake process group is closed with the last prober that uses it."""
        entry = self._shared.get(self._GROUP)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].close()
                del self._shared[self._GROUP]


class CudaFSDPProber:
    """This rank's own CUDA card inside a job, as one FSDP2 rank of the job's world size (the
    planner's prober interface): a copy of the model sharded over a fake process group and
    the step measured on the card (:class:`dptune.backends.cuda.fsdp.CudaFSDPRank`), so a
    probe that runs out of memory fails here only; the ranks meet between probes.
    ``runtime`` (a class attribute): the CUDA runtime, ``None`` for the real one (tests set
    another)."""

    runtime: Any = None

    def __init__(self, workload: Any, device: Optional[int], world_size: int, rank: int,
                 options: FSDPOptions, headroom_bytes: int, host: Optional[str], level: Any):
        from dptune.backends.cuda.fsdp import CudaFSDPRank
        from dptune.hardware.runtime import CudaRuntime
        from dptune.errors import BackendUnavailableError
        from dptune.step.workload import model_name

        from dptune.ddp.ranks import local_card

        runtime = self.runtime if self.runtime is not None else CudaRuntime()
        if not runtime.is_available():
            raise BackendUnavailableError(
                "plan(strategy='fsdp') inside a torch.distributed job probes each rank's CUDA "
                "card, but this rank sees none; pass simulate='...' (one card per rank) to plan "
                "on virtual cards")
        self.backend = CudaFSDPRank(workload, local_card(device, runtime), world_size,
                                    options.shard_fn(), rank=rank, runtime=runtime)
        self.workload, self.headroom, self.host, self.level = workload, headroom_bytes, host, level
        self.name = model_name(workload.model)

    def info(self) -> Any:
        from dptune.ddp.ranks import RankInfo, min_batch, step_settings

        device = self.backend.devices[0]
        self.backend._prepare()   # copies and shards the model now: its errors belong to round 0
        return RankInfo(device=device, host=self.host, budget_bytes=device.budget_bytes(self.headroom),
                        ddp_bytes=0, min_batch=min_batch(self.workload.model), model_name=self.name,
                        settings=step_settings(self.workload))

    def probe(self, batch_size: int) -> Optional[int]:

        res = at_level(self.backend.probe([batch_size]), self.backend.devices, self.level)
        return res.peak_bytes[0] if res.feasible else None

    def close(self) -> None:
        self.backend.close()


def mixed_precision(param_dtype: Optional[str]) -> Any:
    """``MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32)`` for "bf16" or "fp16";
    ``None`` for ``None``."""
    if param_dtype is None:
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if param_dtype not in dtypes:
        raise UsageError(f"the parameters' dtype must be bf16 or fp16, got {param_dtype!r}")
    return MixedPrecisionPolicy(param_dtype=dtypes[param_dtype], reduce_dtype=torch.float32)
