"""The per-bucket plan: for every bucket of lengths, the largest batch and its split.

A :class:`LengthPlan` is what :func:`dptune.lengths.plan_lengths` returns and what the
bucket sampler, ``BalancedDataParallel(plan=...)`` and the reports read. It is plain data
(no torch), saved as ``lengths.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from dptune.errors import ReportError, UsageError
from dptune.lengths.buckets import bucket_index, padded
from dptune.split import scale_split

__all__ = ["BucketPlan", "LengthPlan", "PLAN_FILE"]

#: The file a plan is saved to in a report folder.
PLAN_FILE = "lengths.json"
_AGAIN = "re-run `dptune search ... --lengths FILE` to write it again"


@dataclass(frozen=True)
class BucketPlan:
    """One bucket: padded lengths in ``(lo, length]``, planned at ``length``.

    ``chunk_sizes``: the largest batch measured within every card's budget at ``length``,
    per card (DataParallel: card 0 also gathers the whole batch); ``peak_bytes``: that
    probe's peaks; ``binding_card``: the card with the least room left in it (its largest
    share of the budget); ``certified``: one more sample was measured not to fit (at this
    length, or at a shorter one, which only uses less memory); ``probes``: the probes this
    bucket's search ran.
    """

    lo: int
    length: int
    samples: int
    chunk_sizes: tuple[int, ...]
    peak_bytes: tuple[int, ...]
    binding_card: int
    certified: bool
    probes: int = 0

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def tokens_per_step(self) -> int:
        """Padded tokens in a full batch: batch x length."""
        return self.batch_size * self.length

    def describe(self) -> str:
        """``length <= 512: batch 96 = [10, 29, 29, 28], 49,152 tokens/step``."""
        mark = "" if self.certified else " (not certified)"
        return (f"length <= {self.length}: batch {self.batch_size} = {list(self.chunk_sizes)}, "
                f"{self.tokens_per_step:,} tokens/step{mark}")

    def to_dict(self) -> dict[str, Any]:
        return dict(lo=self.lo, length=self.length, samples=self.samples,
                    batch_size=self.batch_size, chunk_sizes=list(self.chunk_sizes),
                    peak_bytes=list(self.peak_bytes), binding_card=self.binding_card,
                    certified=self.certified, probes=self.probes,
                    tokens_per_step=self.tokens_per_step)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BucketPlan":
        return cls(lo=int(d["lo"]), length=int(d["length"]), samples=int(d["samples"]),
                   chunk_sizes=tuple(int(c) for c in d["chunk_sizes"]),
                   peak_bytes=tuple(int(p) for p in d["peak_bytes"]),
                   binding_card=int(d["binding_card"]), certified=bool(d["certified"]),
                   probes=int(d.get("probes", 0)))


@dataclass(frozen=True)
class LengthPlan:
    """The plan for every bucket, shortest first.

    ``devices``: the cards' names; ``budget_bytes``: each card's budget; ``length_axis``:
    the batch's length dimension (1 for token ids ``(batch, length)``);
    ``pad_to_multiple_of``: how lengths are padded before they are bucketed; ``ddp``: the
    per-card figures are DDP ranks' own batches (each rank one card, nothing gathered), else
    a DataParallel split of one batch.
    """

    buckets: tuple[BucketPlan, ...]
    devices: tuple[str, ...]
    budget_bytes: tuple[int, ...]
    length_axis: int = 1
    pad_to_multiple_of: Optional[int] = None
    cluster: str = ""
    model_name: str = ""
    headroom_bytes: int = 0
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    ddp: bool = False      # True: chunk_sizes are DDP ranks' own batches (no card gathers)

    def __post_init__(self) -> None:
        if not self.buckets:
            raise UsageError("a length plan needs at least one bucket")
        edges = self.edges
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise UsageError(f"the buckets' lengths {edges} must increase")

    @property
    def edges(self) -> list[int]:
        return [b.length for b in self.buckets]

    @property
    def probes(self) -> int:
        return sum(b.probes for b in self.buckets)

    @property
    def certified(self) -> bool:
        return all(b.certified for b in self.buckets)

    def bucket_for(self, length: int) -> BucketPlan:
        """The bucket a batch of padded (or raw) ``length`` belongs to."""
        return self.buckets[bucket_index(self.edges, padded(int(length), self.pad_to_multiple_of))]

    def chunk_sizes_for(self, length: int, batch_size: Optional[int] = None) -> list[int]:
        """Each card's chunk of a batch whose longest (padded) length is ``length``: the
        bucket's planned split, or for a smaller batch that split scaled down (never above it
        on any card). A batch larger than the bucket's is a :class:`UsageError`."""
        b = self.bucket_for(length)
        if batch_size is None or batch_size == b.batch_size:
            return list(b.chunk_sizes)
        if batch_size > b.batch_size:
            raise UsageError(f"a batch of {batch_size} at length {length} is larger than the "
                             f"{b.batch_size} planned for lengths <= {b.length}; draw batches "
                             "with dptune.lengths.BucketBatchSampler(lengths, plan)")
        return scale_split(list(b.chunk_sizes), batch_size)

    def batch_length(self, args: Any, kwargs: Any = None) -> int:
        """A batch's padded length: the longest size along :attr:`length_axis` of its
        tensors (:class:`UsageError` when none has that axis)."""
        from dptune.step import tree as _tree

        sizes = [t.shape[self.length_axis] for t in _tree.leaves((args, kwargs or {}))
                 if t.dim() > self.length_axis]
        if not sizes:
            raise UsageError(f"the batch has no tensor with a length axis {self.length_axis}: "
                             "the plan cannot tell its length (set length_axis when planning)")
        return int(max(sizes))

    def split_for_batch(self, args: Any, kwargs: Any, batch_size: int) -> list[int]:
        """Each card's chunk of this batch, from its padded length (:meth:`chunk_sizes_for`)."""
        return self.chunk_sizes_for(self.batch_length(args, kwargs), batch_size)

    def lines(self) -> list[str]:
        return [b.describe() for b in self.buckets]

    def to_dict(self) -> dict[str, Any]:
        return dict(kind="length_plan", devices=list(self.devices),
                    budget_bytes=list(self.budget_bytes), length_axis=self.length_axis,
                    pad_to_multiple_of=self.pad_to_multiple_of, cluster=self.cluster,
                    model_name=self.model_name, headroom_bytes=self.headroom_bytes,
                    seconds=self.seconds, notes=list(self.notes), probes=self.probes,
                    certified=self.certified, ddp=self.ddp,
                    buckets=[b.to_dict() for b in self.buckets])

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LengthPlan":
        try:
            plan = cls(buckets=tuple(BucketPlan.from_dict(b) for b in d["buckets"]),
                       devices=tuple(str(x) for x in d["devices"]),
                       budget_bytes=tuple(int(x) for x in d["budget_bytes"]),
                       length_axis=int(d.get("length_axis", 1)),
                       pad_to_multiple_of=d.get("pad_to_multiple_of"),
                       cluster=str(d.get("cluster", "")), model_name=str(d.get("model_name", "")),
                       headroom_bytes=int(d.get("headroom_bytes", 0)),
                       seconds=float(d.get("seconds", 0.0)),
                       notes=tuple(str(x) for x in d.get("notes", ())),
                       ddp=bool(d.get("ddp", False)))
        except (KeyError, TypeError, ValueError, UsageError) as e:
            raise ReportError(f"not a dptune length plan ({type(e).__name__}: {e}); write one "
                              "with `dptune search ... --lengths FILE`") from None
        plan.check()
        return plan

    def check(self) -> None:
        """Raise :class:`ReportError` naming the first figure a plan cannot hold (a negative
        chunk, a card count that is not the cards', ...): an edited file is refused, not shown."""
        n = len(self.devices)
        if len(self.budget_bytes) != n or any(b < 0 for b in self.budget_bytes):
            raise ReportError(f"budget_bytes {list(self.budget_bytes)} must be {n} figures >= 0 "
                              "(one per card); " + _AGAIN)
        for k, b in enumerate(self.buckets):
            where = f"buckets[{k}]"
            for key, values in (("chunk_sizes", b.chunk_sizes), ("peak_bytes", b.peak_bytes)):
                if len(values) != n or any(v < 0 for v in values):
                    raise ReportError(f"{where}.{key} {list(values)} must be {n} integers >= 0 "
                                      "(one per card); " + _AGAIN)
            if b.batch_size < 1 or b.samples < 0 or b.probes < 0 or not 0 <= b.lo < b.length \
                    or not 0 <= b.binding_card < n:
                raise ReportError(f"{where} is not a bucket a search writes (lengths ({b.lo}, "
                                  f"{b.length}], batch {b.batch_size}, {b.samples} samples, "
                                  f"binding card {b.binding_card}); " + _AGAIN)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "LengthPlan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise ReportError(f"a length plan must be JSON: {e}") from None

    def save(self, path: str) -> None:
        """Write the plan as JSON (``path``: a file, or a folder to write ``lengths.json`` in)."""
        import os

        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "LengthPlan":
        """A plan saved by :meth:`save` (a file, or a report folder holding ``lengths.json``)."""
        import os

        if os.path.isdir(path):
            path = os.path.join(path, PLAN_FILE)
        if not os.path.isfile(path):
            raise ReportError(f"{path}: no length plan there (write one with `dptune search ... "
                              "--lengths FILE`)")
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read())

