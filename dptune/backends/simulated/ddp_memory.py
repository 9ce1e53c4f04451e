"""What ``DistributedDataParallel`` adds to one rank's memory: the Reducer's gradient buckets.

Read from ``torch/nn/parallel/distributed.py`` and the C++ ``Reducer``
(``torch/csrc/distributed/c10d/reducer.cpp``), and checked against a real DDP model on the
gloo backend (``tests/backends/test_ddp_memory.py`` compares with ``_get_ddp_logging_data()``):

- **Buckets.** The Reducer keeps one flat tensor per bucket (``bucket.gradients``) on the
  parameters' card, allocated when DDP is built and kept for its whole life. Every parameter
  that requires grad sits in exactly one bucket, so the buckets hold one whole copy of the
  gradients, whatever ``bucket_cap_mb`` is; the cap only decides how they are grouped, hence
  how many allocations there are (each rounded up to 512 bytes by the caching allocator).
- **Grouping.** Built once with every parameter in one bucket, then rebuilt after the first
  iteration in the order gradients became ready (about the reverse of ``parameters()``):
  parameters of one dtype are added to the open bucket until it holds at least its limit,
  the first bucket's limit being ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) when
  ``bucket_cap_mb`` is left at its default (25 MiB), ``bucket_cap_mb`` otherwise.
- **gradient_as_bucket_view=False** (the default). During the backward each gradient is
  copied into its bucket (``mul_out``, in place, dividing by the world size), the bucket is
  all-reduced in place, and copied back into ``param.grad`` (in place). So the step holds
  the gradients *and* their copy in the buckets: a rank's peak is the single-card step's peak
  plus the buckets' bytes.
- **gradient_as_bucket_view=True.** The copy is made, then ``param.grad`` is pointed at its
  slice of the bucket and the freshly computed gradient is freed. With
  ``zero_grad(set_to_none=True)`` (torch's default) each backward allocates one gradient at
  a time and drops it once copied; the buckets *are* the gradients. No second copy.
- Nothing is gathered: each rank's output, loss and inputs stay on its own card.
- ``broadcast_buffers=True`` (default) broadcasts the module's buffers from rank 0 at the
  start of every forward through a flattened copy of at most 250 MiB per chunk (a
  transient of the buffers' size). Not modelled: at the start of the forward a card holds
  its least, so it does not move a peak. NCCL's own buffers are allocated outside torch's
  caching allocator (they show in NVML's figures, not in ``max_memory_allocated``).

All sizes are ``int`` bytes. This module does not import torch.
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

