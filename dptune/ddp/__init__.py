"""Per-rank batch sizes for ``DistributedDataParallel`` on unequal cards.

dptune plans, torchrun launches, DDP trains: nothing here runs the training.

- :func:`plan` makes a :class:`DDPPlan` (one local batch per rank) offline on a simulated
  cluster or inside a ``torchrun`` job on the real cards;
  :meth:`DDPPlan.from_batch_sizes` makes one by hand.
- :class:`UnevenBatchSampler` gives each rank its slice of every global batch.
- :meth:`DDPPlan.scale_loss` scales each rank's loss by ``world_size·b_r/B`` (the sizes of
  the step it runs, with ``batch_size=len(batch)``) so that DDP's average of the gradients is
  the mean over the step's global batch.
"""

from __future__ import annotations

from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.ddp.planner import OBJECTIVES, plan
from dptune.ddp.result import DDPPlan, RankPlan, RankProbe
from dptune.ddp.sampler import UnevenBatchSampler

__all__ = ["plan", "DDPPlan", "RankPlan", "RankProbe", "UnevenBatchSampler", "DDPOptions",
           "OBJECTIVES"]
