"""Batches drawn within buckets of lengths, each of its bucket's planned size.

:class:`BucketBatchSampler` is a ``batch_sampler`` for ``torch.utils.data.DataLoader``: it
puts every sample in its bucket (its padded length, as the plan buckets it), cuts each
bucket into batches of the bucket's planned batch size, and yields them in a random order
(or shortest bucket first with ``shuffle=False``). An epoch yields every sample exactly once.

The tail: a bucket whose samples are not a multiple of its batch size ends with one smaller
batch (its split is the planned one scaled down, never above it on any card: see
:meth:`dptune.lengths.LengthPlan.chunk_sizes_for`); ``drop_last=True`` drops those
smaller batches instead (at most one per bucket), so an epoch then covers every sample but
those. ``set_epoch(e)`` reshuffles reproducibly: the same ``seed`` and epoch give the same
batches in the same order.

**DDP** (a plan made with ``ddp=True``): every rank draws the same global batches in the
same order (same ``seed``, same lengths), so every rank runs the same number of steps over
the same buckets, and takes its own slice of each: rank ``r`` its planned batch of that
bucket, at offset ``b_0 + ... + b_{r-1}``. A tail batch is split over the ranks in
proportion to their batches (:func:`dptune.ddp.sampler.tail_split`: every rank gets a
sample while the tail has one for each; with fewer, the last ranks get an *empty* batch, and
must still run the step: ``loss = model(empty).sum() * 0``, so DDP's all-reduce lines up).
:meth:`BucketBatchSampler.loss_scale` is step ``k``'s factor ``W * b_r / B_k``: with each
rank's loss the mean over its own samples, DDP's average of the ranks' gradients is then the
gradient of the mean over the global batch. For a loss that is a mean over *tokens*, scale
by ``W * t_r / T`` instead, ``t_r`` this rank's loss tokens and ``T`` their sum over the
ranks (an ``all_reduce`` of ``t_r``), as the Trainer's ``num_items_in_batch`` does.
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator, Optional

from torch.utils.data import Sampler

from dptune.ddp.result import loss_scales
from dptune.errors import UsageError
from dptune.lengths.buckets import assign, check_lengths
from dptune.lengths.plan import LengthPlan

__all__ = ["BucketBatchSampler"]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of sample indices, each from one bucket and of that bucket's planned size.

    ``lengths``: every sample's length (the dataset's order); ``plan``: a
    :class:`LengthPlan`; ``batch_sizes`` (optional): a batch size per bucket to use instead
    of the plan's (e.g. a DDP rank's share times the ranks), never above it.
    """

    def __init__(self, lengths: Iterable[Any], plan: LengthPlan, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False,
                 batch_sizes: Optional[list[int]] = None, rank: Optional[int] = None) -> None:
        if not isinstance(plan, LengthPlan):
            raise UsageError(f"plan must be a dptune LengthPlan, got {type(plan).__name__}")
        self.lengths = check_lengths(lengths)
        self.plan = plan
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        sizes = [b.batch_size for b in plan.buckets] if batch_sizes is None else list(batch_sizes)
        if len(sizes) != len(plan.buckets) or any(s < 1 for s in sizes):
            raise UsageError(f"batch_sizes must give one size >= 1 per bucket ({len(plan.buckets)})")
        self.batch_sizes = sizes
        self.bucket_of = assign(self.lengths, plan.edges, plan.pad_to_multiple_of)
        self.members: list[list[int]] = [[] for _ in plan.buckets]
        for i, k in enumerate(self.bucket_of):
            self.members[k].append(i)
        self.rank: Optional[int] = None
        if plan.ddp:
            if batch_sizes is not None:
                raise UsageError("a DDP plan gives each rank its batch per bucket; drop batch_sizes")
            self.rank = _rank(rank, len(plan.devices))
        elif rank is not None:
            raise UsageError("rank= is for a DDP plan (plan_lengths(..., ddp=True))")

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order to draw (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    def batches(self) -> list[tuple[int, list[int]]]:
        """This epoch's batches, in order, each with its bucket's index."""
        cached = getattr(self, "_cached", None)
        if cached is not None and cached[0] == (self.seed, self.epoch):
            return cached[1]
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        out: list[tuple[int, list[int]]] = []
        for k, members in enumerate(self.members):
            idx = list(members)
            if self.shuffle:
                rng.shuffle(idx)
            size = self.batch_sizes[k]
            for start in range(0, len(idx), size):
                batch = idx[start:start + size]
                if len(batch) < size and self.drop_last:
                    continue
                out.append((k, batch))
        if self.shuffle:
            rng.shuffle(out)
        self._cached = ((self.seed, self.epoch), out)
        return out

    def rank_sizes(self, bucket: int, size: int) -> list[int]:
        """Every DDP rank's share of a global batch of ``size`` samples of ``bucket``."""
        from dptune.ddp.sampler import tail_split

        planned = list(self.plan.buckets[bucket].chunk_sizes)
        return planned if size == sum(planned) else tail_split(planned, size)

    def loss_scale(self, step: int, rank: Optional[int] = None) -> float:
        """DDP: ``W * b_r / B`` at step ``step`` of this epoch (see the module docstring)."""
        k, batch = self.batches()[step]
        sizes = self.rank_sizes(k, len(batch))
        r = self.rank if rank is None else rank
        assert r is not None, "loss_scale is for a DDP plan"
        return loss_scales(sizes)[r]

    def __iter__(self) -> Iterator[list[int]]:
        for k, batch in self.batches():
            if self.rank is None:
                yield batch
                continue
            sizes = self.rank_sizes(k, len(batch))
            start = sum(sizes[:self.rank])
            yield batch[start:start + sizes[self.rank]]

    def __len__(self) -> int:
        n = 0
        for members, size in zip(self.members, self.batch_sizes):
            n += len(members) // size if self.drop_last else -(-len(members) // size)
        return n


def _rank(rank: Optional[int], world: int) -> int:
    """This process's rank in a plan for ``world`` ranks: ``rank`` or torch.distributed's; the
    plan's world size is checked whenever torch.distributed is initialised, whatever ``rank``
    says (:func:`dptune.ddp.result.check_world_size`, the DDP sampler's own check)."""
    from dptune.ddp.result import check_world_size

    running = check_world_size(world, "BucketBatchSampler")
    if rank is None:
        if not running:
            raise UsageError("a DDP plan's sampler needs rank= (or an initialised process group)")
        import torch.distributed as dist

        rank = dist.get_rank()
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is not in 0..{world - 1}")
    return rank
