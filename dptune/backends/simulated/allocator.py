"""A model of PyTorch's CUDA caching allocator, replaying one card's mallocs and frees.

Pure Python (no torch). It follows ``c10/cuda/CUDACachingAllocator.cpp`` of torch 2.x
(``DeviceCachingAllocator``: ``malloc``, ``get_free_block``, ``should_split``,
``get_allocation_size``, ``round_size``, ``alloc_block``, ``release_available_cached_blocks``,
``release_cached_blocks``, ``garbage_collect_cached_blocks``, ``free_block``/``try_merge_blocks``,
and the expandable segments of ``Note [Expandable Segments]``), with ``CUDAAllocatorConfig``'s
options read from ``PYTORCH_CUDA_ALLOC_CONF`` syntax. Each rule's docstring names the function
it follows. What it leaves out or approximates:

- CUDA graphs' private pools, IPC, ``recordStream`` events (a block freed while another stream
  still uses it is reused at once here; the simulator records no cross-stream use), the
  free-memory callbacks, ``release_lock_on_cudamalloc``, the ``pinned_*`` options.
- ``cudaMalloc`` fails here exactly when the reserved bytes would pass ``capacity`` (the card's
  memory left to the allocator); on a card the driver's own granularity and other processes
  move that edge by a little.
- ``garbage_collection_threshold`` acts, as in the source, only when a per-process memory
  fraction is set (``torch.cuda.set_per_process_memory_fraction``: ``AllocatorConfig
  .memory_fraction``), and the fraction is taken of ``capacity`` (the source takes it of the
  card's total memory).
- Options are parsed as ``c10/core/AllocatorConfig.cpp`` does (:mod:`dptune.backends
  .allocator_config`), ``large_segment_size_mb`` and ``max_non_split_rounding_mb`` included.

A trace is a sequence of :class:`Event`: ``delta > 0`` allocates ``delta`` bytes under the id,
``delta < 0`` frees the block of that id (the size is not needed). Ids carry no address.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional, Sequence

from dptune.backends.simulated.allocator_config import AllocatorConfig, kLargeBuffer

__all__ = ["kMinBlockSize", "kSmallSize", "kSmallBuffer", "kLargeBuffer", "kMinLargeAlloc",
           "kRoundLarge", "AllocatorConfig", "Event", "AllocatorStats", "CachingAllocator",
           "replay", "round_size"]

# c10/cuda/CUDACachingAllocator.cpp, the constants at the top of the file
kMinBlockSize = 512              # all sizes are rounded to at least 512 bytes
kSmallSize = 1048576             # largest "small" allocation is 1 MiB
kSmallBuffer = 2097152           # "small" allocations are packed in 2 MiB blocks
# kLargeBuffer = 20 MiB: "large" allocations may be packed in 20 MiB blocks (the default of
# large_segment_size_mb, which replaces it where set)
kMinLargeAlloc = 10485760        # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2097152            # round up large allocations to 2 MiB


class Event(NamedTuple):
    """One allocator call: ``delta > 0`` mallocs ``delta`` bytes as ``id``, ``< 0`` frees ``id``."""

    id: object
    delta: int
    stream: int = 0


@dataclass(frozen=True)
class AllocatorStats:
    """What ``torch.cuda.memory_stats`` would say, for the figures modelled (bytes)."""

    allocated_peak: int
    reserved_peak: int
    num_alloc_retries: int
    num_ooms: int
    allocated_current: int
    reserved_current: int
    segments: int
    oom_event: Optional[int] = None     # index in the trace of the malloc that ran out

    def memory_stats(self) -> dict[str, int]:
        """The figures under ``torch.cuda.memory_stats()``'s own key names."""
        return {"allocated_bytes.all.peak": self.allocated_peak,
                "reserved_bytes.all.peak": self.reserved_peak,
                "allocated_bytes.all.current": self.allocated_current,
                "reserved_bytes.all.current": self.reserved_current,
                "segment.all.current": self.segments,
                "num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms}


def round_size(size: int, divisions: int = 0) -> int:
    """``DeviceCachingAllocator::round_size``: below kMinBlockSize -> kMinBlockSize; with
    ``roundup_power2_divisions`` > 1 and size > kMinBlockSize * divisions, up to the next of
    ``divisions`` equal steps between two powers of 2 (``roundup_power2_next_division``);
    otherwise up to a multiple of kMinBlockSize."""
    if size < kMinBlockSize:
        return kMinBlockSize
    if divisions > 1 and size > kMinBlockSize * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (divisions.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return kMinBlockSize * -(-size // kMinBlockSize)


def get_allocation_size(size: int, large_segment: int = kLargeBuffer) -> int:
    """``get_allocation_size``: a new segment for a request of ``size`` (rounded) bytes:
    kSmallBuffer for the small pool, kLargeBuffer (``large_segment_size_mb``) below
    kMinLargeAlloc, else up to a multiple of kRoundLarge."""
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return large_segment
    return kRoundLarge * -(-size // kRoundLarge)


class _Block:
    __slots__ = ("ptr", "size", "stream", "small", "allocated", "prev", "next", "mapped",
                 "expandable", "gc_base")

    def __init__(self, ptr: int, size: int, stream: int, small: bool, expandable: bool = False):
        self.ptr, self.size, self.stream, self.small = ptr, size, stream, small
        self.allocated = False
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None
        self.mapped = True
        self.expandable = expandable
        self.gc_base = 0

    def key(self) -> tuple[int, int, int]:
        return (self.stream, self.size, self.ptr)    # BlockComparatorSize: stream, size, ptr

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """A ``BlockPool``: free mapped blocks sorted by (stream, size, address), and (expandable
    segments) the unmapped ranges sorted by (stream, address)."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int, int]] = []
        self.by_key: dict[tuple[int, int, int], _Block] = {}
        self.unmapped: list[tuple[int, int]] = []
        self.unmapped_by: dict[tuple[int, int], _Block] = {}
        self.gc_calls = 0            # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:
        b.gc_base = self.gc_calls
        k = b.key()
        bisect.insort(self.keys, k)
        self.by_key[k] = b

    def erase(self, b: _Block) -> None:
        k = b.key()
        i = bisect.bisect_left(self.keys, k)
        assert self.keys[i] == k
        del self.keys[i]
        del self.by_key[k]

    def insert_unmapped(self, b: _Block) -> None:
        k = (b.stream, b.ptr)
        bisect.insort(self.unmapped, k)
        self.unmapped_by[k] = b

    def erase_unmapped(self, b: _Block) -> None:
        k = (b.stream, b.ptr)
        del self.unmapped[bisect.bisect_left(self.unmapped, k)]
        del self.unmapped_by[k]


@dataclass
class CachingAllocator:
    """One card's ``DeviceCachingAllocator``. ``capacity``: bytes the allocator may reserve
    (``cudaMalloc`` fails past it). ``malloc`` returns False on an OOM (after the retry)."""

    capacity: int
    config: AllocatorConfig = field(default_factory=AllocatorConfig)

    def __post_init__(self) -> None:
        self.pools = {True: _Pool(True), False: _Pool(False)}
        self.live: dict[object, _Block] = {}
        self.allocated = self.reserved = 0
        self.allocated_peak = self.reserved_peak = 0
        self.retries = self.ooms = self.segments = 0
        self._next_ptr = 1 << 40
        cfg = self.config
        self._gc = cfg.garbage_collection_threshold > 0 and cfg.memory_fraction is not None
        self._allowed = (int(cfg.memory_fraction * self.capacity)
                         if cfg.memory_fraction is not None else None)

    # -- public ------------------------------------------------------------------------
    def malloc(self, id: object, nbytes: int, stream: int = 0) -> bool:
        """``DeviceCachingAllocator::malloc``: find a cached block, else a new segment, else
        free cached blocks and retry (``num_alloc_retries``), else OOM (returns False)."""
        cfg = self.config
        size = round_size(nbytes, cfg.divisions(nbytes))
        pool = self.pools[size <= kSmallSize]                   # get_pool
        alloc_size = get_allocation_size(size, cfg.large_segment_size)
        block = self._get_free_block(pool, size, stream)
        if block is None:
            if self._gc:
                self._garbage_collect()
            block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None and self._release_available(pool, size, stream):
                block = self._alloc_block(pool, size, alloc_size, stream, False)
            if block is None:
                self._release_cached()
                block = self._alloc_block(pool, size, alloc_size, stream, True)
            if block is None:
                self.ooms += 1
                return False
        block = self._alloc_found(pool, block, size, self._should_split(block, size))
        self.live[id] = block
        return True

    def free(self, id: object) -> None:
        """``free`` -> ``free_block``: merge with free neighbours of the segment, cache it."""
        block = self.live.pop(id, None)
        if block is None:
            return
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            self._try_merge(block, other, pool)
        pool.insert(block)

    def reset_peak_stats(self) -> None:
        """``resetPeakStats``: peaks restart from the current figures."""
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved

    def stats(self, oom_event: Optional[int] = None) -> AllocatorStats:
        return AllocatorStats(self.allocated_peak, self.reserved_peak, self.retries, self.ooms,
                              self.allocated, self.reserved, self.segments, oom_event)

    # -- finding and splitting -----------------------------------------------------------
    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> Optional[_Block]:
        """``get_free_block``: the smallest free block of the pool and stream with size >=
        request, lowest address first; an oversize block (>= max_split_size) is refused to a
        request under max_split_size, and to a larger request unless within kLargeBuffer
        (``max_non_split_rounding_mb``)."""
        cfg = self.config
        if self._gc:
            pool.gc_calls += 1
        i = bisect.bisect_left(pool.keys, (stream, size, 0))
        if i == len(pool.keys) or pool.keys[i][0] != stream:
            return None
        b = pool.by_key[pool.keys[i]]
        if b.expandable:
            # best fit counts the unmapped room after the block (expandable_size)
            def room(x: _Block) -> int:
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)
            while (b.expandable and i + 1 < len(pool.keys) and pool.keys[i + 1][0] == stream
                   and room(pool.by_key[pool.keys[i + 1]]) < room(b)):
                i += 1
                b = pool.by_key[pool.keys[i]]
        if size < cfg.max_split and b.size >= cfg.max_split:
            return None
        if size >= cfg.max_split and b.size >= size + cfg.max_non_split_rounding:
            return None
        pool.erase(b)
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        """``should_split``: small pool (or expandable segments): remainder >= kMinBlockSize;
        large pool: request < max_split_size and remainder > kSmallSize."""
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self.config.max_split and remaining > kSmallSize

    def _alloc_found(self, pool: _Pool, b: _Block, size: int, split: bool) -> _Block:
        """``alloc_found_block``: the front of the block is handed out, the rest cached."""
        if split:
            rest = b
            b = _Block(rest.ptr, size, rest.stream, rest.small, rest.expandable)
            b.prev, b.next = rest.prev, rest
            if b.prev is not None:
                b.prev.next = b
            rest.prev = b
            rest.ptr += size
            rest.size -= size
            pool.insert(rest)
        b.allocated = True
        self.allocated += b.size
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        return b

    def _try_merge(self, dst: _Block, src: Optional[_Block], pool: _Pool) -> int:
        """``try_merge_blocks``: absorb a free neighbour of the same mapping state."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:
            dst.ptr, dst.prev = src.ptr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- new memory --------------------------------------------------------------------
    def _fits(self, nbytes: int) -> bool:
        if self._allowed is not None and self.reserved + nbytes > self._allowed:
            return False       # alloc_block's set_fraction check
        return self.reserved + nbytes <= self.capacity

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int,
                     retry: bool) -> Optional[_Block]:
        """``alloc_block``: a new segment of ``alloc_size`` (``cudaMalloc``), or with expandable
        segments pages mapped onto the pool's segment; a retry counts in num_alloc_retries."""
        if retry:
            self.retries += 1
        if self.config.expandable_segments:
            return self._alloc_expandable(pool, size, stream)
        if not self._fits(alloc_size):
            return None
        ptr = self._new_address(alloc_size)
        self._add_reserved(alloc_size)
        self.segments += 1
        return _Block(ptr, alloc_size, stream, pool.small)

    def _new_address(self, nbytes: int) -> int:
        """A fresh address range (aligned to both page sizes), apart from every other
        segment: segments are never adjacent, as separate cudaMallocs."""
        align = math.lcm(kSmallBuffer, self.config.large_segment_size)
        ptr = align * -(-self._next_ptr // align)
        self._next_ptr = ptr + nbytes + align
        return ptr

    def _add_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _release_block(self, b: _Block, pool: _Pool) -> None:
        """``release_block``: ``cudaFree`` a whole cached segment."""
        pool.erase(b)
        self.reserved -= b.size
        self.segments -= 1

    def _release_available(self, pool: _Pool, size: int, stream: int) -> bool:
        """``release_available_cached_blocks`` (only with max_split_size set): free the
        smallest oversize cached block >= max(request, max_split_size), else oversize blocks
        from the largest down until that much is freed."""
        cfg = self.config
        if cfg.max_split_size is None or cfg.expandable_segments:
            return False
        want = max(size, cfg.max_split)
        i = bisect.bisect_left(pool.keys, (stream, want, 0))
        if i < len(pool.keys) and pool.keys[i][0] == stream:
            self._release_block(pool.by_key[pool.keys[i]], pool)
            return True
        freed = 0
        i -= 1
        while i >= 0 and freed < want:
            b = pool.by_key[pool.keys[i]]
            if b.size < cfg.max_split or b.stream != stream:
                break
            freed += b.size
            self._release_block(b, pool)      # only unsplit blocks are oversize-cached here
            i -= 1
        return freed >= want

    def _release_cached(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks`` (large pool, then small): every free
        block that is a whole segment is freed; with expandable segments the free whole pages
        are unmapped (``unmap_block``)."""
        for small in (False, True):
            pool = self.pools[small]
            for k in list(pool.keys):
                b = pool.by_key[k]
                if b.expandable:
                    self._unmap(b, pool)
                    if not b.mapped and b.prev is None and b.next is None:
                        pool.erase_unmapped(b)      # release_expandable_segment
                        self.segments -= 1
                elif not b.is_split():
                    self._release_block(b, pool)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: above threshold * allowed memory, free unsplit
        cached large blocks whose age (get_free_block calls since cached) is at least the
        average, repeatedly, until the excess is reclaimed or none is left."""
        assert self._allowed is not None
        threshold = int(self.config.garbage_collection_threshold * self._allowed)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        pool = self.pools[False]
        ages = {k: pool.gc_calls - b.gc_base for k, b in pool.by_key.items()
                if not b.is_split() and not b.expandable}
        total, count = sum(ages.values()), len(ages)
        freed_one = True
        while reclaimed < target and freed_one and count > 0:
            avg = total / count
            freed_one = False
            for k in list(pool.keys):
                if k in ages and ages[k] >= avg and k in pool.by_key:
                    freed_one = True
                    reclaimed += k[1]
                    total -= ages.pop(k)
                    count -= 1
                    self._release_block(pool.by_key[k], pool)

    # -- expandable segments -----------------------------------------------------------
    def _page(self, pool: _Pool) -> int:
        # ExpandableSegment's pages: 2 MiB small pool, kLargeBuffer (large_segment_size) large
        return kSmallBuffer if pool.small else self.config.large_segment_size

    def _alloc_expandable(self, pool: _Pool, size: int, stream: int) -> Optional[_Block]:
        """``try_allocate_expandable_block``: from the lowest-address unmapped range with room
        (``find_expandable_block``; a new segment of address space if none), map whole pages
        (2 MiB small pool, 20 MiB large pool) until the free run covers ``size``."""
        found = self._find_expandable(pool, size, stream)
        c = found if found.mapped else self._map(found, min(found.size, size), pool)
        if c is None:
            return None
        while c.size < size:
            nxt = c.next
            assert nxt is not None and not nxt.mapped
            mapped = self._map(nxt, min(size - c.size, nxt.size), pool)
            if mapped is None:
                return None
            c = mapped
        pool.erase(c)
        return c

    def _find_expandable(self, pool: _Pool, size: int, stream: int) -> _Block:
        def free(b: Optional[_Block]) -> bool:
            return b is not None and not b.allocated

        def room(b: Optional[_Block]) -> bool:
            got = 0
            while got < size and b is not None and free(b):
                got += b.size
                b = b.next
            return got >= size

        i = bisect.bisect_left(pool.unmapped, (stream, 0))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = pool.unmapped_by[pool.unmapped[i]]
            if free(c.prev) and c.prev is not None and c.prev.mapped:
                c = c.prev
            if room(c):
                return c
            i += 1
        span = self._page(pool) * -(-(self.capacity + self.capacity // 8) // self._page(pool))
        ptr = self._new_address(span)
        c = _Block(ptr, span, stream, pool.small, expandable=True)
        c.mapped = False
        pool.insert_unmapped(c)
        self.segments += 1
        return c

    def _map(self, b: _Block, size: int, pool: _Pool) -> Optional[_Block]:
        """``map_block``: map whole pages from the start of unmapped ``b``; merge with the free
        mapped neighbours. None when the pages do not fit on the card."""
        page = self._page(pool)
        nbytes = min(b.size, page * -(-size // page))
        if not self._fits(nbytes):
            return None
        pool.erase_unmapped(b)
        b.mapped = True
        if nbytes < b.size:
            rest = _Block(b.ptr + nbytes, b.size - nbytes, b.stream, b.small, expandable=True)
            rest.mapped = False
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = nbytes
            pool.insert_unmapped(rest)
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        self._add_reserved(nbytes)
        return b

    def _unmap(self, b: _Block, pool: _Pool) -> None:
        """``unmap_block``: give back the whole pages inside free block ``b``."""
        page = self._page(pool)          # segments start page-aligned (_new_address)
        first = page * -(-b.ptr // page)
        last = page * ((b.ptr + b.size) // page)
        if last <= first:
            return
        pool.erase(b)
        for lo, hi, before in ((b.ptr, first, True), (last, b.ptr + b.size, False)):
            if hi > lo:
                part = _Block(lo, hi - lo, b.stream, b.small, expandable=True)
                if before:
                    part.prev, part.next = b.prev, b
                    if b.prev is not None:
                        b.prev.next = part
                    b.prev = part
                else:
                    part.prev, part.next = b, b.next
                    if b.next is not None:
                        b.next.prev = part
                    b.next = part
                pool.insert(part)
        b.ptr, b.size, b.mapped = first, last - first, False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self.reserved -= last - first


def replay(steps: Sequence[Iterable[Event]], capacity: int,
           config: Optional[AllocatorConfig] = None, measure_from: int = 0,
           allocator: Optional[CachingAllocator] = None) -> AllocatorStats:
    """Replay ``steps`` (traces, in order) through one card's allocator; peaks are reset
    before step ``measure_from`` (as ``reset_peak_memory_stats`` after warm-up steps). Ids of
    different steps are kept apart, so a step's blocks still live at its end stay allocated
    (a free of an id the step did not allocate frees the latest earlier step's). Stops at the first OOM (``oom_event``: its index within the step)."""
    a = allocator if allocator is not None else CachingAllocator(capacity, config or AllocatorConfig())
    for s, trace in enumerate(steps):
        if s == measure_from:
            a.reset_peak_stats()
        for i, ev in enumerate(trace):
            if ev.delta > 0:
                if not a.malloc((s, ev.id), ev.delta, ev.stream):
                    return a.stats(oom_event=i)
            elif (s, ev.id) in a.live:
                a.free((s, ev.id))
            else:
                for t in range(s - 1, -1, -1):
                    if (t, ev.id) in a.live:
                        a.free((t, ev.id))
                        break
    return a.stats()
