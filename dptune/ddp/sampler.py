"""``UnevenBatchSampler``: each rank's local batches of a :class:`~dptune.ddp.DDPPlan`.

Every rank draws the same permutation of the dataset each epoch (seeded with
``seed + epoch``; call :meth:`UnevenBatchSampler.set_epoch` at the start of every epoch, as
with ``DistributedSampler``). Global step ``k`` takes positions ``[kB, (k+1)B)`` of the
permutation, ``B`` the plan's global batch, and rank r takes its own slice of it: positions
``kB + o_r`` to ``kB + o_r + b_r``, where ``o_r = b_0 + ... + b_{r-1}``. So within an epoch
the ranks' batches never overlap and every rank runs the same number of steps.

**The tail** (the last ``N mod B`` samples, when ``B`` does not divide the dataset size ``N``):

- ``drop_last=True``: dropped; ``N // B`` steps per epoch (the dropped samples change from
  epoch to epoch with the permutation).
- ``drop_last=False`` (default): one more, smaller step. Its ``t = N mod B`` samples are
  split over the ranks in proportion to their planned batches (largest remainders, ties to
  the lower rank: :func:`dptune.split.scale_split`), then a rank whose share rounded to 0
  takes one sample from the rank holding the most, as long as some rank holds more than
  one. So every sample is used exactly once per epoch, none repeated
  (``DistributedSampler`` pads by repeating samples instead), no rank gets more than its
  planned batch, and every rank gets at least one sample when ``t >= world_size``. When
  ``t < world_size`` the ranks ``t..world_size-1`` get an *empty* batch on that step; their
  loop must still run a backward (DDP's all-reduce needs every rank), see
  :meth:`UnevenBatchSampler.sizes_at` and the README for the loss of that step.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Union

from dptune.ddp.result import DDPPlan
from dptune.errors import UsageError
from dptune.split import scale_split

__all__ = ["UnevenBatchSampler", "tail_split"]


def tail_split(batch_sizes: Sequence[int], tail: int) -> list[int]:
    """The tail step's batch per rank (see the module docstring): proportional, then every
    empty rank, lowest first, takes one sample from the fullest while one holds more than 1."""
    out = scale_split(batch_sizes, tail)
    for r in range(len(out)):
        if out[r] == 0:
            donor = max(range(len(out)), key=lambda i: (out[i], -i))
            if out[donor] <= 1:
                break
            out[donor] -= 1
            out[r] = 1
    return out


class UnevenBatchSampler:
    """A batch sampler for a ``DataLoader`` (``DataLoader(ds, batch_sampler=sampler)``):
    iterating it yields this rank's lists of dataset indices, one list per global step.

    ``dataset`` is the dataset (anything with ``len``) or its length; ``plan`` a
    :class:`DDPPlan` or the per-rank batch sizes; ``rank`` defaults to this process's rank
    in ``torch.distributed``. See the module docstring for the order and the tail.
    """

    def __init__(self, dataset: Any, plan: Union[DDPPlan, Sequence[int]], rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        self.plan = plan if isinstance(plan, DDPPlan) else DDPPlan.from_batch_sizes(list(plan))
        n = dataset if isinstance(dataset, int) and not isinstance(dataset, bool) else None
        if n is None:
            try:
                n = len(dataset)
            except TypeError:
                raise UsageError("dataset must have a length (a map-style dataset) or be an int; "
                                 f"got {type(dataset).__name__}") from None
        if n < 0:
            raise UsageError(f"dataset length must be >= 0, got {n}")
        self.num_samples = n
        self.rank = self.plan._rank(rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        sizes = self.plan.batch_sizes
        self._offsets = [sum(sizes[:r]) for r in range(len(sizes))]

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of this epoch (call it on every rank at each epoch's start)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank."""
        full, tail = divmod(self.num_samples, self.plan.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def sizes_at(self, step: int) -> list[int]:
        """Every rank's batch size at global step ``step`` of an epoch (the plan's, except
        on the tail step)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} is not in 0..{len(self) - 1}")
        B = self.plan.global_batch
        left = self.num_samples - step * B
        if left >= B:
            return self.plan.batch_sizes
        return tail_split(self.plan.batch_sizes, left)

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        B, r = self.plan.global_batch, self.rank
        for step in range(len(self)):
            sizes = self.sizes_at(step)
            start = step * B + sum(sizes[:r])
            yield order[start:start + sizes[r]]
