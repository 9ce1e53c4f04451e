"""The step a real-GPU probe runs: :class:`StepContext` (what a step function gets) and
:func:`default_step` (the workload's step through ``BalancedDataParallel``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dptune.step.workload import StepOutcome, StepRuntime, Workload, run_step


@dataclass
class StepContext:
    """What a step function gets: the placed model, the probe's optimizer, the cards."""

    workload: Workload
    model: Any
    optimizer: Any
    device_ids: list[int]
    devices: list[Any]               # torch.device per entry of device_ids
    runtime: Any
    batch_on_card0: bool = False
    wrapper: Any = None              # BalancedDataParallel for this probe (default step)
    output_device: int = 0           # position in device_ids where outputs are gathered
    stage: str = ""                  # what the step is doing, for error messages
    outcome: Optional[StepOutcome] = None   # what the last default step saw

    def zero_grad(self) -> None:
        """Drop every gradient (``set_to_none``), as ``zero_grad()`` does by default."""
        if self.model is not None:
            self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)


def _to_device(obj: Any, device: Any) -> Any:
    """Every tensor of a batch moved to ``device`` (:func:`dptune.step.tree.map_tensors`)."""
    from dptune.step import tree as _tree

    return _tree.map_tensors(lambda t: t.to(device), obj)


_STAGES = {"forward": "the forward", "loss": "the loss", "backward": "the backward",
           "clip": "clip_grad_norm_", "optimizer": "optimizer.step()", "step": "the step function"}


def default_step(ctx: StepContext, chunk_sizes: Sequence[int]) -> None:
    """One training step through ``BalancedDataParallel`` with ``chunk_sizes``: the workload's
    step (:func:`dptune.step.workload.run_step`: mixed precision, accumulation, clipping, or the
    user's own step function), after dropping the gradients. The outputs are gathered on
    ``ctx.devices[ctx.output_device]``, where the loss's targets are moved too."""
    wl = ctx.workload
    ctx.stage = "zero_grad"
    ctx.zero_grad()
    batch_size = sum(chunk_sizes)
    dev0 = ctx.devices[0]
    k = ctx.output_device
    dev_out = ctx.devices[k]
    wrapper = ctx.wrapper
    if wrapper is None:
        from dptune.parallel import BalancedDataParallel

        wrapper = BalancedDataParallel(ctx.model, device_ids=ctx.device_ids,
                                       output_device=ctx.device_ids[k], dim=0,
                                       chunk_sizes=list(chunk_sizes))

    def next_batch() -> Any:
        ctx.stage = f"sample({batch_size})"
        batch = wl.sample(batch_size)
        if ctx.batch_on_card0:
            ctx.stage = "moving the batch to card 0"
            batch = _to_device(batch, dev0)
        return batch

    def batch_for_loss(batch: Any) -> Any:
        if wl.loss_fn is not None and (not ctx.batch_on_card0 or k != 0):
            return _to_device(batch, dev_out)
        return batch

    @contextlib.contextmanager
    def phase(name: str) -> Any:
        ctx.stage = _STAGES[name]
        yield

    device_type = getattr(dev0, "type", "cuda")
    ctx.outcome = run_step(wl, StepRuntime(model=wrapper, optimizer=ctx.optimizer, next_batch=next_batch,
                                           batch_for_loss=batch_for_loss, phase=phase,
                                           device_type=device_type, scaler_device=device_type))
    ctx.stage = "done"
