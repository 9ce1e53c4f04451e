"""``UnevenBatchSampler``: each rank's local batches of a :class:`~dptune.ddp.DDPPlan`.

Every rank draws the same permutation of the dataset each epoch (seeded with
``seed + epoch``; call :meth:`UnevenBatchSampler.set_epoch` at the start of every epoch, as
with ``DistributedSampler``). Global step ``k`` takes positions ``[kB, (k+1)B)`` of the
permutation, ``B`` the plan's global batch, and rank r takes its own slice of it: positions
``kB + o_r`` to ``kB + o_r + b_r``, where ``o_r = b_0 + ... + b_{r-1}``. So within an epoch
the ranks' batches never overlap and every rank runs the same number of steps.

**The tail** (the last ``t = N mod B`` samples, when ``B`` does not divide the dataset size
``N``):

- ``drop_last=True``: dropped; ``N // B`` steps per epoch (the dropped samples change from
  epoch to epoch with the permutation).
- ``drop_last=False`` (default): one more, smaller step. Its ``t`` samples are split over
  the ranks in proportion to their planned batches (largest remainders, ties to the lower
  rank: :func:`dptune.split.scale_split`), then a rank whose share rounded to 0 takes one
  sample from the rank holding the most, as long as some rank holds more than one
  (:func:`tail_split`). So every sample is used exactly once per epoch, none repeated
  (``DistributedSampler`` pads by repeating samples instead), and no rank gets more than its
  planned batch.
- **No rank is ever empty** (nor, with ``min_batch=2``, the plan's setting for a model with
  BatchNorm, left with one sample). When ``t < m · world_size`` (``m`` = ``min_batch``) the
  step before the tail lends it ``m · world_size - t`` samples, one at a time from the rank
  holding the most (ties to the lower rank, never below ``m``): that step is a little
  smaller and the tail gives every rank exactly ``m`` (:func:`last_steps`). Where the plan's
  batches are too small to lend that many (``B - m · world_size < m · world_size - t``, e.g.
  a dataset smaller than the world size), the sampler refuses with a
  :class:`~dptune.errors.UsageError` on every rank: pass ``drop_last=True``.

Those steps' batches are not the planned ones, so their loss needs its own scale:
``plan.scale_loss(loss, batch_size=len(batch))`` uses the sizes of the step the ranks
actually got (see :meth:`~dptune.ddp.DDPPlan.scale_loss`); :meth:`UnevenBatchSampler.sizes_at`
gives them all. While such a sampler lives, ``plan.scale_loss(loss)`` without the step's
sizes (which would scale the tail by the planned batches) raises, saying what to pass.

Whenever ``torch.distributed`` is initialised the plan's world size must be the job's,
whatever ``rank=`` says (a plan for 4 ranks in a 3-rank job would leave samples out of
every epoch and weigh the gradient wrongly): otherwise every rank raises a ``UsageError``.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional, Sequence, Union

from dptune.ddp.result import DDPPlan, check_world_size, note_unplanned_steps
from dptune.errors import UsageError
from dptune.split import scale_split

__all__ = ["UnevenBatchSampler", "tail_split", "last_steps", "LastSteps"]


def tail_split(batch_sizes: Sequence[int], tail: int, least: int = 1) -> list[int]:
    """The tail's batch per rank, before any lending (see the module docstring):
    proportional, then every rank below ``least``, lowest first, takes samples one at a time
    from the fullest while that one holds more than ``least``. With
    ``tail < least * len(batch_sizes)`` some ranks stay below ``least``."""
    out = scale_split(batch_sizes, tail)
    for r in range(len(out)):
        while out[r] < least:
            donor = max(range(len(out)), key=lambda i: (out[i], -i))
            if out[donor] <= least:
                return out
            out[donor] -= 1
            out[r] += 1
    return out


class LastSteps(NamedTuple):
    """The irregular end of an epoch with ``drop_last=False``: ``before`` the sizes of the
    step before the tail (the plan's unless it lent samples), ``tail`` the tail step's."""

    before: list[int]
    tail: list[int]


def last_steps(batch_sizes: Sequence[int], tail: int, least: int = 1) -> Optional[LastSteps]:
    """The sizes of the last two steps for a tail of ``tail`` samples (``0 < tail``), with no
    rank below ``least`` (1; 2 under BatchNorm): the tail's :func:`tail_split`, and when that
    leaves ranks below it (``tail < least * world_size``), the tail gives every rank
    ``least`` and the step before lends what that takes, one sample at a time from its
    fullest rank (ties to the lower rank), never taking a rank below ``least``. ``None`` when
    it cannot (the plan's batches hold too few samples above ``least`` each)."""
    sizes, world = list(batch_sizes), len(batch_sizes)
    split = tail_split(sizes, tail, least)
    if min(split) >= least:
        return LastSteps(sizes, split)
    lend = least * world - tail
    if sum(sizes) - least * world < lend:
        return None
    before = list(sizes)
    for _ in range(lend):
        donor = max(range(world), key=lambda i: (before[i], -i))
        before[donor] -= 1
    return LastSteps(before, [least] * world)


class UnevenBatchSampler:
    """A batch sampler for a ``DataLoader`` (``DataLoader(ds, batch_sampler=sampler)``):
    iterating it yields this rank's lists of dataset indices, one list per global step,
    never an empty one.

    ``dataset`` is the dataset (anything with ``len``) or its length; ``plan`` a
    :class:`DDPPlan` or the per-rank batch sizes; ``rank`` defaults to this process's rank
    in ``torch.distributed``; ``min_batch`` the fewest samples a rank may get on a step
    (default: the plan's, 2 for a model with BatchNorm). See the module docstring for the
    order, the tail and the world-size check.
    """

    def __init__(self, dataset: Any, plan: Union[DDPPlan, Sequence[int]], rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 min_batch: Optional[int] = None):
        self.plan = plan if isinstance(plan, DDPPlan) else DDPPlan.from_batch_sizes(list(plan))
        least = self.plan.min_batch if min_batch is None else min_batch
        if isinstance(least, bool) or not isinstance(least, int) or \
                not 1 <= least <= min(self.plan.batch_sizes):
            raise UsageError(f"min_batch must be an int from 1 to the plan's smallest batch "
                             f"({min(self.plan.batch_sizes)}); got {least!r}")
        self.min_batch = least
        check_world_size(self.plan.world_size, "UnevenBatchSampler")
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
        self._last = self._last_steps()
        if self._last is not None:      # plan.scale_loss(loss) cannot tell these steps apart
            note_unplanned_steps(self)

    def _last_steps(self) -> Optional[LastSteps]:
        full, tail = divmod(self.num_samples, self.plan.global_batch)
        if self.drop_last or not tail:
            return None
        world, least = self.plan.world_size, self.min_batch
        need = least * world
        last = last_steps(self.plan.batch_sizes, tail, least) if full or tail >= need else None
        each = "one" if least == 1 else f"{least} (BatchNorm)"
        if last is None and not full:
            raise UsageError(f"the dataset has {self.num_samples} samples, fewer than the {need} "
                             f"that give each of the {world} ranks {each} on every step; use at "
                             f"least {need} samples")
        if last is None:
            raise UsageError(
                f"{self.num_samples} samples in global batches of {self.plan.global_batch} leave "
                f"a last step of {tail} for {world} ranks, and no earlier step can lend the "
                f"{need - tail} more that would give every rank {each}; pass drop_last=True "
                f"(those {tail} samples are left out of each epoch, a different {tail} each time)")
        return last

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of this epoch (call it on every rank at each epoch's start)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        """Steps per epoch, the same on every rank."""
        full, tail = divmod(self.num_samples, self.plan.global_batch)
        return full + (1 if tail and not self.drop_last else 0)

    def sizes_at(self, step: int) -> list[int]:
        """Every rank's batch size at global step ``step`` of an epoch: the plan's, except on
        the tail step and, when it lends the tail samples, the step before."""
        steps = len(self)
        if not 0 <= step < steps:
            raise IndexError(f"step {step} is not in 0..{steps - 1}")
        if self._last is not None:
            if step == steps - 1:
                return list(self._last.tail)
            if step == steps - 2:
                return list(self._last.before)
        return self.plan.batch_sizes

    def _start(self, step: int) -> int:
        """The step's first position in the epoch's permutation."""
        start = step * self.plan.global_batch
        if self._last is not None and step == len(self) - 1:
            start -= self.plan.global_batch - sum(self._last.before)   # what the step before lent
        return start

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        import torch

        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples, generator=g).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        check_world_size(self.plan.world_size, "UnevenBatchSampler")   # made before the group
        order = self._order()
        r = self.rank
        for step in range(len(self)):
            sizes = self.sizes_at(step)
            start = self._start(step) + sum(sizes[:r])
            yield order[start:start + sizes[r]]
