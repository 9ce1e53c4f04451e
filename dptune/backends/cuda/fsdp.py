"""One FSDP2 rank probed on this process's real CUDA card.

Inside a ``torchrun`` job, ``dptune.ddp.plan(..., strategy="fsdp")`` without ``simulate``
probes each rank's own card: a copy of the user's model is placed on the card, sharded by
the user's ``shard(model, mesh)`` (or the default sharding) with torch's own
``fully_shard`` over a *fake* process group of the job's world size
(:class:`dptune.backends.fsdp.FakeGroup`), and the workload's step runs on the rank's local
batch; the peak is ``torch.cuda.max_memory_allocated`` of the card, as for any real probe
(:class:`dptune.backends.cuda.CudaBackend`'s measurement protocol: warm-up, repeats,
out of memory as a result).

**Why a fake group on real cards.** Every allocation FSDP2 makes is real (the rank's
shards of parameters, gradients and optimizer state, the all-gather and reduce-scatter
buffers, the unsharded parameters while a unit is unsharded, prefetching) and sized for the
job's world size, while the collectives move nothing. So a rank's probe never waits for
another rank: a probe that runs out of memory fails on its own rank only, never inside a
collective where the others would hang. The ranks meet only between probes, in the
planner's rounds (over the job's real process group).

**What this does not measure.** The communication library's buffers (NCCL allocates them
outside torch's allocator; the reserved level counts them as a fixed cost), and the values
of the gathered parameters (the fake all-gather leaves the buffers as they were, so the
forward computes on stale numbers; memory does not depend on them, but a step whose control
flow does, such as ``GradScaler`` skipping an optimizer step on an overflow, may differ).
The user's model is never sharded in place: the copy is, and it is dropped by
:meth:`close`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Optional, Sequence

from dptune.backends.cuda.backend import CudaBackend
from dptune.backends.cuda.step import StepContext, _to_device
from dptune.backends.fsdp import FakeGroup, apply_shard
from dptune.errors import DptuneError, UsageError, UserCodeError
from dptune.step.workload import StepRuntime, Workload, run_step

__all__ = ["CudaFSDPRank", "fsdp_step"]

_STAGES = {"forward": "the forward", "loss": "the loss", "backward": "the backward",
           "clip": "clip_grad_norm_", "optimizer": "optimizer.step()", "step": "the step function"}


def fsdp_step(ctx: StepContext, chunk_sizes: Sequence[int]) -> None:
    """One training step of the sharded model on its card, the local batch of
    ``chunk_sizes[0]`` samples moved there (no DataParallel: one rank, one card)."""
    wl = ctx.workload
    ctx.stage = "zero_grad"
    ctx.zero_grad()
    (batch_size,) = chunk_sizes
    dev = ctx.devices[0]

    def next_batch() -> Any:
        ctx.stage = f"sample({batch_size})"
        batch = wl.sample(batch_size)
        ctx.stage = "moving the batch to the card"
        return _to_device(batch, dev)

    @contextlib.contextmanager
    def phase(name: str) -> Any:
        ctx.stage = _STAGES[name]
        yield

    device_type = getattr(dev, "type", "cuda")
    ctx.outcome = run_step(wl, StepRuntime(model=ctx.model, optimizer=ctx.optimizer,
                                           next_batch=next_batch, batch_for_loss=lambda b: b,
                                           phase=phase, device_type=device_type,
                                           scaler_device=device_type))
    ctx.stage = "done"


class CudaFSDPRank(CudaBackend):
    """One FSDP2 rank of ``world_size`` on the CUDA card ``device_index`` (see the module
    docstring). ``probe([b])`` runs the step with a local batch of ``b``. ``group``: a
    :class:`FakeGroup` to use (default: one made on first use, over the job's ranks when a
    process group is initialised, and closed by :meth:`close`)."""

    def __init__(self, workload: Workload, device_index: int, world_size: int,
                 shard: Callable[[Any, Any], Any], *, rank: int = 0,
                 group: Optional[FakeGroup] = None, runtime: Any = None, repeats: int = 2):
        if not callable(shard):
            raise UsageError(f"shard must be a function shard(model, mesh), got {type(shard).__name__}")
        super().__init__(workload, device_ids=[device_index], runtime=runtime, repeats=repeats,
                         step_fn=fsdp_step)
        self.world_size, self.rank, self.shard = world_size, rank, shard
        self._group, self._owns_group = group, group is None

    def describe(self) -> str:
        return f"{super().describe()} (FSDP2 rank {self.rank} of {self.world_size})"

    def _prepare(self) -> StepContext:
        """A copy of the model on the card, sharded, and its optimizer (once)."""
        if self._ctx is not None:
            return self._ctx
        import torch

        wl = self.workload
        assert wl is not None
        dev = self.runtime.torch_device(self.device_ids[0])
        model = self._placed_copy(wl, dev)
        if self._group is None:
            self._group = FakeGroup(self.world_size, self.rank,
                                    device_type=getattr(dev, "type", "cuda"))
        model = apply_shard(self.shard, model, self._group.mesh)
        optimizer = None
        if wl.optimizer is not None:
            try:
                optimizer = wl.optimizer([p for p in model.parameters() if p.requires_grad])
            except Exception as exc:
                raise UserCodeError(f"the optimizer factory raised {type(exc).__name__}: {exc}") from exc
        torch.set_grad_enabled(True)
        self._ctx = StepContext(workload=wl, model=model, optimizer=optimizer,
                                device_ids=list(self.device_ids), devices=[dev],
                                runtime=self.runtime)
        return self._ctx

    @staticmethod
    def _placed_copy(wl: Workload, dev: Any) -> Any:
        import torch

        try:
            if wl.is_factory:
                with torch.device(dev):
                    model = wl.model()
                if not isinstance(model, torch.nn.Module):
                    raise UsageError(f"the model factory returned a {type(model).__name__}, "
                                     "not an nn.Module")
                return model
            return copy.deepcopy(wl.model).to(dev)  # type: ignore[union-attr]
        except DptuneError:
            raise
        except Exception as exc:
            what = "the model factory" if wl.is_factory else "copying the model"
            raise UserCodeError(f"{what} raised {type(exc).__name__} while placing the model on "
                                f"{dev}: {exc}") from exc

    def close(self) -> None:
        super().close()
        if self._owns_group and self._group is not None:
            self._group.close()
            self._group = None
