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
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Iterator, Optional

from torch.utils.data import Sampler

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
                 batch_sizes: Optional[list[int]] = None) -> None:
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

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order to draw (as ``DistributedSampler.set_epoch``)."""
        self.epoch = int(epoch)

    def batches(self) -> list[tuple[int, list[int]]]:
        """This epoch's batches, in order, each with its bucket's index."""
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
        return out

    def __iter__(self) -> Iterator[list[int]]:
        for _, batch in self.batches():
            yield batch

    def __len__(self) -> int:
        n = 0
        for members, size in zip(self.members, self.batch_sizes):
            n += len(members) // size if self.drop_last else -(-len(members) // size)
        return n
