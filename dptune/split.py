"""Pure arithmetic on per-device chunk sizes (no torch)."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

__all__ = ["even_split", "valid_split", "scale_split", "validate_chunk_sizes", "fill_within", "spread_within", "MAX_BATCH_SIZE"]

#: The largest total batch dptune takes: far beyond any cluster's memory, well inside what a
#: tensor's size can count (a larger one is a typo, not a workload).
MAX_BATCH_SIZE = 2**40


def even_split(batch_size: int, n: int) -> list[int]:
    """Split like ``torch.chunk`` does in DataParallel's scatter.

    ``torch.chunk`` gives ``ceil(B/n)`` to each device until the batch runs out, so the
    last devices may get less, or nothing (B=5 on 4 devices: 2, 2, 1, 0).
    """
    if n < 1:
        raise ValueError("need at least one device")
    if batch_size < 0:
        raise ValueError(f"batch size must be >= 0, got {batch_size}")
    if batch_size == 0:
        return [0] * n
    step = -(-batch_size // n)
    out, left = [], batch_size
    for _ in range(n):
        c = min(step, left)
        out.append(c)
        left -= c
    return out


def validate_chunk_sizes(chunk_sizes: Sequence[int], n_devices: int | None = None) -> list[int]:
    """Check chunk sizes are non-negative ints (one per device) and return them as a list."""
    sizes = list(chunk_sizes)
    if not sizes:
        raise ValueError("chunk_sizes is empty; give one non-negative int per device")
    for c in sizes:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"chunk_sizes must be non-negative ints, got {sizes!r}")
    if n_devices is not None and len(sizes) != n_devices:
        raise ValueError(f"chunk_sizes has {len(sizes)} entries for {n_devices} devices: {sizes!r}")
    if sum(sizes) == 0:
        raise ValueError(f"chunk_sizes sum to 0: {sizes!r}; give at least one device a sample")
    return sizes


def scale_split(chunk_sizes: Sequence[int], batch_size: int) -> list[int]:
    """Scale a split to another batch size in proportion (largest-remainder rounding).

    Zeros stay zero and the result sums exactly to ``batch_size``. Ties in the remainders
    go to the earlier device.
    """
    sizes = validate_chunk_sizes(chunk_sizes)
    if batch_size < 0:
        raise ValueError(f"batch size must be >= 0, got {batch_size}")
    total = sum(sizes)
    if batch_size == total:
        return sizes
    quotas = [c * batch_size for c in sizes]  # exact, as numerators over `total`
    out = [q // total for q in quotas]
    left = batch_size - sum(out)
    order = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] % total), i))
    for i in order[:left]:
        out[i] += 1
    return out


def fill_within(chunks: Sequence[int], more: int, caps: Sequence[Optional[int]],
                order: Iterable[int]) -> tuple[list[int], int]:
    """``chunks`` with ``more`` samples added, card by card in ``order`` (positions in
    ``chunks``), each up to its cap (``None``: no cap); returns the chunks and the samples
    left over where the caps could not hold them all."""
    out = list(chunks)
    for i in order:
        cap = caps[i]
        take = more if cap is None else min(more, max(0, cap - out[i]))
        out[i] += take
        more -= take
    return out, more


def spread_within(total: int, caps: Sequence[int]) -> Optional[list[int]]:
    """``total`` samples spread over the cards of ``caps`` as evenly as the caps allow
    (water-filling: every card at the same level or at its cap, the lower-numbered ones
    taking the odd samples); ``None`` where the caps cannot hold them."""
    if total < 0 or total > sum(caps):
        return None
    lo, hi = 0, max(caps, default=0)          # the least level L with sum(min(c, L)) >= total
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if sum(min(c, mid) for c in caps) < total else (lo, mid)
    out = [min(c, max(lo - 1, 0)) for c in caps]
    left = total - sum(out)
    for i, c in enumerate(caps):
        if left and out[i] < c:
            out[i] += 1
            left -= 1
    return out


def valid_split(split: Sequence[int], min_chunk: int) -> bool:
    """Non-negative chunks, at least one sample, none between 1 and ``min_chunk - 1`` (under
    BatchNorm a card cannot run a single sample)."""
    return sum(split) > 0 and all(c == 0 or c >= min_chunk for c in split) and min(split) >= 0
