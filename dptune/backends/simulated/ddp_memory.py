"""What ``DistributedDataParallel`` adds to one rank's memory: the Reducer's gradient buckets.

- :class:`DDPOptions`: The ``DistributedDataParallel`` arguments that change a rank's memory.
- :class:`Bucket`: One of the Reducer's flat gradient buffers: which parameters (positions in the list given to :func:`bucket_layout`), its dtype and its size.
- :func:`bucket_layout`: The buckets DDP settles on after its first iteration.
- :func:`bucket_bytes`: Bytes the buckets take on a card (the sum of their rounded allocations).
- :class:`ParamInfo`: What bucketing needs of one parameter: its element count, element size and dtype.
- :func:`params_of`: The parameters DDP buckets, in gradient-ready order: ``module.parameters()`` (deduplicated, so tied weights count once) that require grad, reversed.

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/ddp_memory.py".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

from dptune.errors import UsageError

__all__ = ["DDPOptions", "Bucket", "bucket_layout", "bucket_bytes", "ParamInfo", "params_of",
           "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_BYTES"]

DEFAULT_BUCKET_CAP_MB = 25                 # torch.nn.parallel.distributed._DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024   # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
_MB = 1024 * 1024                          # DDP's "MB" is MiB
ROUND_BYTES = 512                          # the caching allocator's block rounding


@dataclass(frozen=True)
class DDPOptions:
    """The ``DistributedDataParallel`` arguments that change a rank's memory."""

    bucket_cap_mb: Optional[float] = None    # None: torch's default (25 MiB, first bucket 1 MiB)
    gradient_as_bucket_view: bool = False

    def __post_init__(self) -> None:
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
            raise UsageError(f"bucket_cap_mb must be a positive number of MiB (or None for torch's "
                             f"default {DEFAULT_BUCKET_CAP_MB}), got {cap!r}")
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise UsageError("gradient_as_bucket_view must be True or False, got "
                             f"{self.gradient_as_bucket_view!r}")

    def limits(self) -> tuple[int, int]:
        """(first bucket's limit, every other bucket's limit) in bytes, as DDP derives them."""
        if self.bucket_cap_mb is None:
            return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_CAP_MB * _MB
        cap = int(self.bucket_cap_mb * _MB)
        return cap, cap

    def describe(self) -> str:
        cap = DEFAULT_BUCKET_CAP_MB if self.bucket_cap_mb is None else self.bucket_cap_mb
        view = ", gradient_as_bucket_view" if self.gradient_as_bucket_view else ""
        return f"buckets of {cap:g} MiB{view}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DDPOptions":
        return cls(**{k: d[k] for k in ("bucket_cap_mb", "gradient_as_bucket_view") if k in d})


@dataclass(frozen=True)
class ParamInfo:
    """What bucketing needs of one parameter: its element count, element size and dtype."""

    numel: int
    element_size: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class Bucket:
    """One of the Reducer's flat gradient buffers: which parameters (positions in the list
    given to :func:`bucket_layout`), its dtype and its size."""

    params: tuple[int, ...]
    dtype: str
    numel: int
    nbytes: int

    @property
    def allocated_bytes(self) -> int:
        """What the caching allocator charges for it (rounded up to 512 bytes)."""
        return -(-self.nbytes // ROUND_BYTES) * ROUND_BYTES


def bucket_layout(params: Sequence[ParamInfo], options: Optional[DDPOptions] = None) -> list[Bucket]:
    """The buckets DDP settles on after its first iteration.

    ``params`` are in the order their gradients become ready (for most models the reverse of
    ``module.parameters()``, deduplicated, only those that require grad). Follows
    ``compute_bucket_assignment_by_size``: one open bucket per dtype, closed as soon as it
    holds at least its limit; the first closed bucket of a dtype has the first limit.
    """
    first, cap = (options or DDPOptions()).limits()
    open_: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    closed_count: dict[str, int] = {}
    out: list[Bucket] = []

    def close(dtype: str) -> None:
        idx = open_.pop(dtype)
        numel = sum(params[i].numel for i in idx)
        out.append(Bucket(params=tuple(idx), dtype=dtype, numel=numel, nbytes=size.pop(dtype)))
        closed_count[dtype] = closed_count.get(dtype, 0) + 1

    for i, p in enumerate(params):
        open_.setdefault(p.dtype, []).append(i)
        size[p.dtype] = size.get(p.dtype, 0) + p.nbytes
        limit = first if closed_count.get(p.dtype, 0) == 0 else cap
        if size[p.dtype] >= limit:
            close(p.dtype)
    for dtype in list(open_):
        close(dtype)
    return out


def bucket_bytes(params: Sequence[ParamInfo], options: Optional[DDPOptions] = None) -> int:
    """Bytes the buckets take on a card (the sum of their rounded allocations)."""
    return sum(b.allocated_bytes for b in bucket_layout(params, options))


def params_of(module: Any) -> list[ParamInfo]:
    """The parameters DDP buckets, in gradient-ready order: ``module.parameters()``
    (deduplicated, so tied weights count once) that require grad, reversed."""
    out = [ParamInfo(numel=int(p.numel()), element_size=int(p.element_size()),
                     dtype=str(p.dtype).replace("torch.", ""))
           for p in module.parameters() if p.requires_grad]
    return out[::-1]

