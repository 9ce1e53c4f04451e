"""What both backends share to plan an FSDP2 rank: a fake process group (torch's "fake"
backend, whose collectives move nothing) over the job's real world size, and the user's
``shard(model, mesh)`` function applied and checked.

Used by both backends: the simulated FSDP2 rank (fake tensors on a virtual card) and the
real-card FSDP2 rank (real tensors on this process's CUDA card), so that a rank's memory is
what ``fully_shard`` allocates for its world size while no rank ever waits for another:
a probe that runs out of memory fails on its own rank only, never in a collective.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

from dptune._torch_private import fake_process_group_store, register_fake_backend
from dptune.errors import UsageError, UserCodeError

__all__ = ["FakeGroup", "apply_shard"]


class FakeGroup:
    """A fake process group of ``world_size`` ranks (this process is ``rank``) and its 1-D
    device mesh (``device_type``: "cpu" for the simulated cluster, "cuda" on real cards).

    Without a default process group one is initialised with torch's fake backend (and
    destroyed by :meth:`close`); inside a job (``gloo``/``nccl`` already initialised) a fake
    group over the job's ranks is made with ``new_group(backend="fake")``, which every rank
    must call in the same order, as for any ``new_group``.
    """

    def __init__(self, world_size: int, rank: int = 0, device_type: str = "cpu"):
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"world_size must be an int >= 1, got {world_size!r}")
        register_fake_backend()
        self.owns_default = False
        if dist.is_initialized():
            if dist.get_world_size() != world_size:
                raise UsageError(f"this job has {dist.get_world_size()} ranks but the FSDP "
                                 f"plan is for {world_size}; give one card per rank")
            self.group: Any = dist.new_group(backend="fake")
        else:
            dist.init_process_group("fake", store=fake_process_group_store(), rank=rank,
                                    world_size=world_size)
            self.group = dist.group.WORLD
            self.owns_default = True
        self.world_size = world_size
        self.mesh = DeviceMesh.from_group(self.group, device_type)

    def close(self) -> None:
        import torch.distributed as dist

        if self.group is None or not dist.is_initialized():
            self.group = None
            return
        if self.owns_default:
            dist.destroy_process_group()
        else:
            with contextlib.suppress(ValueError, RuntimeError):
                dist.destroy_process_group(self.group)
        self.group = None


def apply_shard(shard: Callable[[Any, Any], Any], module: Any, mesh: Any) -> Any:
    """``shard(module, mesh)``, checked: the sharded model (the function's result when it
    returns a module, else ``module``), which must be an FSDP module. The function's own
    errors are the user's (:class:`UserCodeError`, chained)."""
    import torch.nn as nn
    from torch.distributed.fsdp import FSDPModule

    try:
        out = shard(module, mesh)
    except Exception as e:
        raise UserCodeError(f"the shard function raised: {type(e).__name__}: {e}") from e
    if isinstance(out, nn.Module):
        module = out
    if not isinstance(module, FSDPModule):
        raise UsageError("after shard(model, mesh) the model is not an FSDP module: the shard "
                         "function must call fully_shard(model, mesh=mesh) on the root last")
    return module
