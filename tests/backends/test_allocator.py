"""The caching-allocator model (dptune.backends.simulated.allocator) on small hand-computed traces.

Each test names the constant or the branch of c10/cuda/CUDACachingAllocator.cpp it pins; the
expected figures are worked out by hand in the comments, not taken from the code's output.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from dptune.backends.simulated.allocator import (AllocatorConfig, CachingAllocator, Event, replay,
                                       round_size)
from dptune.errors import SpecError

KiB, MiB = 1024, 1024 * 1024
BIG = 1 << 40          # a card that never runs out


def alloc(conf: str = "", capacity: int = BIG) -> CachingAllocator:
    return CachingAllocator(capacity, AllocatorConfig.parse(conf))


# -- round_size: kMinBlockSize and roundup_power2_divisions ----------------------------------
def test_round_size_kMinBlockSize():
    assert round_size(1) == 512              # below kMinBlockSize -> kMinBlockSize
    assert round_size(512) == 512
    assert round_size(513) == 1024           # up to a multiple of 512
    assert round_size(3 * MiB + 1) == 3 * MiB + 512


def test_round_size_power2_divisions():
    # [4096, 8192) in 4 divisions: 4096, 5120, 6144, 7168 -> 5000 goes to 5120
    assert round_size(5000, 4) == 5120
    # [1 MiB, 2 MiB) in 4: 1 MiB, 1.25 MiB, ... -> 1 MiB + 1 goes to 1.25 MiB
    assert round_size(MiB + 1, 4) == MiB + 256 * KiB
    assert round_size(4096, 4) == 4096       # a power of 2 stays
    # only above kMinBlockSize * divisions = 2048: 1200 is rounded to 512s (1536)
    assert round_size(1200, 4) == 1536


def test_roundup_power2_divisions_reaches_allocated_bytes():
    a = alloc("roundup_power2_divisions:4")
    a.malloc("x", 5000)
    assert a.allocated == 5120
    assert alloc("roundup_power2_divisions:[64:4]").config.divisions(5000) == 4


# -- get_pool (kSmallSize) and get_allocation_size (kSmallBuffer, kLargeBuffer, kRoundLarge) -
def test_small_pool_up_to_kSmallSize_in_kSmallBuffer_segments():
    a = alloc()
    a.malloc("x", MiB)                       # <= kSmallSize: small pool, a 2 MiB segment
    assert (a.reserved, a.segments) == (2 * MiB, 1)
    a.malloc("y", 512 * KiB)                 # fits the rest of that 2 MiB segment (split)
    assert (a.reserved, a.segments) == (2 * MiB, 1)


def test_large_pool_segment_sizes():
    a = alloc()
    a.malloc("a", MiB + 1)                   # > kSmallSize, < kMinLargeAlloc: kLargeBuffer
    assert a.reserved == 20 * MiB
    b = alloc()
    b.malloc("a", 10 * MiB)                  # >= kMinLargeAlloc: rounded to kRoundLarge
    assert b.reserved == 10 * MiB
    c = alloc()
    c.malloc("a", 11 * MiB + 1)              # -> 12 MiB (2 MiB multiple)
    assert c.reserved == 12 * MiB


def test_pools_do_not_share_segments():
    a = alloc()
    a.malloc("s", 4 * KiB)                   # small pool: 2 MiB
    a.free("s")
    a.malloc("l", MiB + 512)                 # large pool: cannot use the free 2 MiB
    assert a.reserved == 2 * MiB + 20 * MiB


# -- get_free_block: best fit by size, then address ------------------------------------------
def test_best_fit_smallest_block_that_fits():
    a = alloc()
    for name, size in (("12", 12 * MiB), ("16", 16 * MiB), ("14", 14 * MiB)):
        a.malloc(name, size)
    for name in ("12", "16", "14"):
        a.free(name)
    assert a.reserved == 42 * MiB
    a.malloc("x", 13 * MiB)                  # 12 too small, 14 is the best fit, 16 left
    assert a.reserved == 42 * MiB
    # remainder 1 MiB is not > kSmallSize: no split, the whole 14 MiB block is allocated
    assert a.allocated == 14 * MiB


def test_best_fit_lowest_address_among_equal_sizes():
    a = alloc()
    a.malloc("first", 12 * MiB)
    a.malloc("second", 12 * MiB)
    low = min(a.live["first"].ptr, a.live["second"].ptr)
    a.free("second")
    a.free("first")
    a.malloc("x", 12 * MiB)
    assert a.live["x"].ptr == low


# -- should_split ------------------------------------------------------------------------------
def test_large_pool_split_when_remainder_over_kSmallSize():
    a = alloc()
    a.malloc("a", 2 * MiB)                   # 20 MiB segment, split: 18 MiB cached
    assert (a.reserved, a.allocated) == (20 * MiB, 2 * MiB)
    a.malloc("b", 3 * MiB)                   # from the cached 18 MiB, no new segment
    assert (a.reserved, a.allocated, a.segments) == (20 * MiB, 5 * MiB, 1)


def test_large_pool_no_split_when_remainder_at_most_kSmallSize():
    a = alloc()
    a.malloc("a", 12 * MiB)
    a.free("a")
    a.malloc("b", 11 * MiB + 1)              # rounds to 11 MiB + 512; remainder < 1 MiB
    assert a.allocated == 12 * MiB           # the whole block: allocated_bytes counts it


def test_small_pool_split_down_to_kMinBlockSize():
    a = alloc()
    a.malloc("a", 2 * MiB - 512)             # > kSmallSize? no: 2 MiB - 512 > 1 MiB -> large
    assert a.reserved == 20 * MiB
    b = alloc()
    b.malloc("a", MiB)                       # small pool; remainder 1 MiB >= 512: split
    b.malloc("b", MiB - 512)                 # remainder 512 >= kMinBlockSize: split again
    b.malloc("c", 512)                       # exactly the last 512 bytes of the segment
    assert (b.reserved, b.allocated, b.segments) == (2 * MiB, 2 * MiB, 1)


def test_free_merges_neighbours_of_the_segment():
    a = alloc()
    a.malloc("a", 2 * MiB)
    a.malloc("b", 2 * MiB)                   # both inside one 20 MiB segment
    a.free("a")
    a.free("b")                              # a, b and the 16 MiB rest merge back to 20 MiB
    a.malloc("c", 20 * MiB)
    assert (a.reserved, a.segments) == (20 * MiB, 1)


# -- max_split_size_mb ---------------------------------------------------------------------------
def test_max_split_size_blocks_not_given_to_small_requests():
    a = alloc("max_split_size_mb:32")
    a.malloc("big", 40 * MiB)
    a.free("big")
    a.malloc("x", 10 * MiB)                  # < max_split: the 40 MiB block is refused
    assert a.reserved == 50 * MiB


def test_max_split_size_oversize_only_within_kLargeBuffer():
    a = alloc("max_split_size_mb:32")
    a.malloc("big", 64 * MiB)
    a.free("big")
    a.malloc("x", 40 * MiB)                  # 64 >= 40 + 20: refused, new segment
    assert a.reserved == 104 * MiB
    b = alloc("max_split_size_mb:32")
    b.malloc("big", 56 * MiB)
    b.free("big")
    b.malloc("x", 40 * MiB)                  # 56 < 60: used whole (oversize never splits)
    assert (b.reserved, b.allocated) == (56 * MiB, 56 * MiB)


def test_max_split_size_parse_limits():
    assert AllocatorConfig.parse("max_split_size_mb:128").max_split_size == 128 * MiB
    assert AllocatorConfig.parse("max_split_size_mb:20").max_split_size == 20 * MiB
    with pytest.raises(SpecError, match="max_split_size_mb"):
        AllocatorConfig.parse("max_split_size_mb:19")     # parseMaxSplitSize: >= kLargeBuffer
    with pytest.raises(SpecError, match="large_segment_size_mb"):
        AllocatorConfig.parse("max_split_size_mb:20,large_segment_size_mb:25")
    with pytest.raises(SpecError, match="key:value"):
        AllocatorConfig.parse("expandable_segments")
    with pytest.raises(SpecError, match="not an option"):
        AllocatorConfig.parse("foo:123")
    with pytest.raises(SpecError, match="native"):
        AllocatorConfig.parse("backend:cudaMallocAsync")
    assert AllocatorConfig.parse("release_lock_on_cudamalloc:True") == AllocatorConfig()


def test_roundup_power2_divisions_list_form():
    # c10/test/core/AllocatorConfig_test.cpp's cases: the first value fills the intervals
    # below it, '>' the intervals after the last one given; an interval not named stays 0
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    got = {mb: cfg.divisions(mb * MiB) for mb in (64, 128, 256, 512, 1024, 2048, 4096)}
    assert got == {64: 8, 128: 8, 256: 16, 512: 1, 1024: 0, 2048: 8, 4096: 2}
    cfg = AllocatorConfig.parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    got = {mb: cfg.divisions(mb * MiB) for mb in (32, 64, 128, 256, 512, 1024, 2048, 8192)}
    assert got == {32: 8, 64: 8, 128: 2, 256: 4, 512: 2, 1024: 4, 2048: 1, 8192: 1}
    assert AllocatorConfig.parse("roundup_power2_divisions:4").divisions(2048 * MiB) == 4
    with pytest.raises(SpecError, match="power of 2"):
        AllocatorConfig.parse("roundup_power2_divisions:3")
    a = CachingAllocator(BIG, cfg)
    a.malloc("x", 150 * MiB)              # [128, 256) MB: 2 divisions, 128 and 192 MiB
    assert a.allocated == 192 * MiB


def test_large_segment_size_mb_and_max_non_split_rounding_mb():
    a = alloc("large_segment_size_mb:40")
    a.malloc("x", 2 * MiB)                # 1..10 MiB: one large_segment_size segment
    assert a.reserved == 40 * MiB
    e = alloc("large_segment_size_mb:40,expandable_segments:True")
    e.malloc("x", 2 * MiB)                # the large pool's expandable page
    assert e.reserved == 40 * MiB
    b = alloc("max_split_size_mb:32,max_non_split_rounding_mb:30")
    b.malloc("big", 64 * MiB)
    b.free("big")
    b.malloc("x", 40 * MiB)               # 64 < 40 + 30: the oversize block is used whole
    assert (b.reserved, b.allocated) == (64 * MiB, 64 * MiB)


# -- the free-and-retry path and the OOM -------------------------------------------------------
def test_release_cached_blocks_and_retry_counts_num_alloc_retries():
    a = alloc(capacity=21 * MiB)
    a.malloc("s", 512)                       # small segment, 2 MiB
    a.free("s")
    # 2 + 20 > 21: cudaMalloc fails; no max_split_size so release_available does nothing;
    # release_cached_blocks frees the unsplit 2 MiB segment; retry succeeds
    assert a.malloc("l", 2 * MiB)
    assert (a.retries, a.reserved, a.ooms) == (1, 20 * MiB, 0)


def test_oom_after_retry():
    a = alloc(capacity=19 * MiB)
    assert not a.malloc("l", 2 * MiB)        # needs a 20 MiB segment: OOM after one retry
    assert (a.retries, a.ooms, a.reserved) == (1, 1, 0)


def test_split_segment_in_use_is_not_released():
    a = alloc(capacity=39 * MiB)
    a.malloc("a", 2 * MiB)                   # 20 MiB segment, 18 MiB free inside it
    assert not a.malloc("b", 19 * MiB)       # 18 free < 19; 20 + 19 > 39 even after release
    assert (a.retries, a.reserved) == (1, 20 * MiB)


def test_release_available_cached_blocks_frees_one_oversize_block_without_retry():
    cap = 40 * MiB + 48 * MiB + 30 * MiB - 1
    a = alloc("max_split_size_mb:32", capacity=cap)
    a.malloc("p", 40 * MiB)
    a.malloc("q", 48 * MiB)
    a.free("p")
    a.free("q")
    # 30 MiB < max_split: both cached blocks are refused; cudaMalloc(30) does not fit; the
    # smallest oversize block >= max(30, 32) MiB (40 MiB) is freed; not counted as a retry
    assert a.malloc("x", 30 * MiB)
    assert (a.retries, a.reserved) == (0, 48 * MiB + 30 * MiB)


# -- expandable segments -------------------------------------------------------------------------
def test_expandable_segments_pages():
    a = alloc("expandable_segments:True")
    a.malloc("s", 512)                       # small pool page: 2 MiB
    a.malloc("l", 5 * MiB)                   # large pool page: 20 MiB
    a.malloc("m", 30 * MiB)                  # 35 MiB in the large segment: 2 pages
    assert a.reserved == 2 * MiB + 40 * MiB
    assert a.allocated == 512 + 35 * MiB     # splits down to kMinBlockSize


def test_expandable_segments_reuse_freed_memory_a_slightly_larger_request():
    d = alloc()
    d.malloc("a", 30 * MiB)
    d.free("a")
    d.malloc("b", 32 * MiB)                  # default: 30 MiB cached block too small
    assert d.reserved == 62 * MiB
    e = alloc("expandable_segments:True")
    e.malloc("a", 30 * MiB)                  # 2 pages (40 MiB) mapped
    e.free("a")
    e.malloc("b", 32 * MiB)                  # fits the 40 MiB mapped run
    assert e.reserved == 40 * MiB


def test_expandable_segments_unmap_on_oom_then_retry():
    e = alloc("expandable_segments:True", capacity=60 * MiB)
    e.malloc("a", 40 * MiB)                  # pages 0-1
    e.malloc("b", 10 * MiB)                  # page 2 (partly)
    e.free("a")                              # pages 0-1 free, still mapped
    # 30 MiB fits the free 40 MiB run: no new pages
    assert e.malloc("c", 30 * MiB) and e.reserved == 60 * MiB
    assert e.retries == 0
    # 25 MiB: 10 free MiB left at the start; the segment's end needs 2 more pages (100 > 60),
    # release_cached unmaps no whole free page (the free runs are parts of pages) -> OOM
    assert not e.malloc("d", 25 * MiB)
    assert (e.retries, e.ooms) == (1, 1)


# -- the allocator's note: a batch size that changes slightly each step ----------------------------
def _deep_model_step(n: int, layers: int = 40) -> list[Event]:
    """Forward of a deep model at batch n: per layer an (n*A) and an (n*A*B) activation kept
    for the backward, freed in reverse order."""
    a_bytes, b = 2 * MiB, 6
    ev, ids = [], []
    for layer in range(layers):
        for k, size in ((0, n * a_bytes), (1, n * a_bytes * b)):
            ev.append(Event((layer, k), size))
            ids.append((layer, k))
    ev.extend(Event(i, -1) for i in reversed(ids))
    return ev


def test_fragmentation_note_default_grows_expandable_does_not():
    rng = random.Random(0)
    batches = [8] + [8 + rng.choice((-1, 0, 1, 2)) for _ in range(11)]   # slight changes
    steps = [_deep_model_step(n) for n in batches]
    peak_alloc = max(replay([s], BIG).allocated_peak for s in steps)

    grown = [replay(steps[:k], BIG).reserved_peak for k in (1, len(steps))]
    assert grown[1] > grown[0] * 1.5         # default mode: cached slivers, new segments
    assert grown[1] > peak_alloc * 1.5

    es = replay(steps, BIG, AllocatorConfig(expandable_segments=True)).reserved_peak
    # the largest step rounded up to one 20 MiB page: nothing stranded
    assert peak_alloc <= es <= peak_alloc + 20 * MiB


# -- properties on random traces -------------------------------------------------------------------
_sizes = st.one_of(st.integers(1, 4 * KiB), st.integers(MiB - 4 * KiB, MiB + 4 * KiB),
                   st.integers(2 * MiB, 40 * MiB))


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), _sizes), min_size=1, max_size=60),
       conf=st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:24",
                             "roundup_power2_divisions:4"]),
       cap=st.sampled_from([BIG, 120 * MiB]))
def test_reserved_covers_allocated_at_every_point(ops, conf, cap):
    a = alloc(conf, cap)
    live: dict[int, int] = {}
    for i, (do_free, size) in enumerate(ops):
        if do_free and live:
            k = sorted(live)[size % len(live)]
            a.free(k)
            del live[k]
        elif a.malloc(i, size):
            live[i] = round_size(size, a.config.divisions(size))
        assert a.reserved >= a.allocated >= sum(live.values())
        assert a.reserved <= cap
        assert a.reserved_peak >= a.reserved and a.allocated_peak >= a.allocated


def test_replay_deterministic_and_resets_peaks():
    steps = [_deep_model_step(n, layers=10) for n in (9, 8)]
    one, two = replay(steps, BIG, measure_from=1), replay(steps, BIG, measure_from=1)
    assert one == two
    # measured over the second (smaller) step only: its own allocated peak
    assert one.allocated_peak == replay([steps[1]], BIG).allocated_peak


def test_config_round_trip_and_env(monkeypatch):
    text = "max_split_size_mb:128,roundup_power2_divisions:4,garbage_collection_threshold:0.6," \
           "expandable_segments:True"
    cfg = AllocatorConfig.parse(text)
    assert cfg == AllocatorConfig(128 * MiB, (4,) * 16, 0.6, True)
    assert AllocatorConfig.parse(cfg.to_conf()) == cfg
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert AllocatorConfig.from_env().expandable_segments
    listed = AllocatorConfig.parse("roundup_power2_divisions:[64:8,>:2],max_non_split_rounding_mb:30")
    assert AllocatorConfig.parse(listed.to_conf()) == listed


def test_garbage_collection_threshold_frees_old_cached_segments():
    # only with a memory fraction set (set_fraction in the source); threshold 0.5 of 100 MiB
    cfg = AllocatorConfig(garbage_collection_threshold=0.5, memory_fraction=1.0)
    a = CachingAllocator(100 * MiB, cfg)
    a.malloc("old", 40 * MiB)
    a.free("old")                            # cached 40 MiB, reserved 40 <= 50: no GC
    a.malloc("x", 12 * MiB)                  # 40 MiB block is a fit: split, no new segment
    a.free("x")
    a.malloc("y", 42 * MiB)                  # no fit: GC (40 <= 50, nothing), new 42 MiB
    assert a.reserved == 82 * MiB
    a.free("y")
    # z: no fit; 82 > 50, so GC reclaims 32 MiB: ages (get_free_block calls since cached)
    # are 40 MiB: 4 - 2 = 2, 42 MiB: 4 - 3 = 1, average 1.5: the 40 MiB block goes (enough)
    a.malloc("z", 44 * MiB)
    assert (a.reserved, a.retries) == (42 * MiB + 44 * MiB, 0)
    plain = alloc(capacity=100 * MiB)
    for k, s in (("old", 40), ("y", 42), ("z", 44)):
        if not plain.malloc(k, s * MiB):
            break
        plain.free(k)
    assert plain.retries == 1                # without GC the third needs the retry path


def test_blocks_belong_to_their_stream():
    # get_free_block: the search key starts with the stream; a block freed on the copy
    # stream is not reused by the default stream
    a = alloc()
    a.malloc("in", 12 * MiB, stream=1)
    a.free("in")
    a.malloc("x", 12 * MiB, stream=0)
    assert a.reserved == 24 * MiB
    a.malloc("in2", 12 * MiB, stream=1)                 # the copy stream's own block
    assert a.reserved == 24 * MiB


def test_least_capacity_against_every_capacity():
    """``least_capacity``: the first capacity (in 2 MiB steps) at which the replay runs
    without running out, found by scanning every capacity from the allocated peak up; at
    most the reserved peak without a limit: a step that needs a 20 MiB block no cached one
    holds runs in less than that peak by freeing them."""
    from dptune.backends.simulated.reserved import least_capacity

    # two 12 MiB blocks (each its own segment: over kMinLargeAlloc, a multiple of 2 MiB),
    # freed, then one of 20 MiB: without a limit a third segment (12 + 12 + 20 MiB); with 24
    # MiB the cache is freed and the 20 MiB cut from the room left (one retry); 22 MiB cannot
    # hold the two 12 MiB blocks live together
    trace = [Event(0, 12 * MiB), Event(1, 12 * MiB), Event(0, -1), Event(1, -1), Event(2, 20 * MiB)]
    free = replay([trace], BIG)
    assert free.reserved_peak == 44 * MiB and free.allocated_peak == 24 * MiB
    need = least_capacity([trace])
    scan = next(c for c in range(0, 64 * MiB, 2 * MiB) if not replay([trace], c).num_ooms)
    assert need == scan == 24 * MiB
    assert replay([trace], need).num_alloc_retries == 1
    rng = random.Random(7)
    for _ in range(30):                     # random traces: the bisection finds the scan's answer
        live: list[int] = []
        events = []
        for k in range(40):
            if live and rng.random() < 0.4:
                events.append(Event(live.pop(rng.randrange(len(live))), -1))
            else:
                events.append(Event(k, rng.choice([1, 3, 9, 21, 40]) * MiB + rng.randint(0, MiB)))
                live.append(k)
        free = replay([events], BIG)
        scan = next(c for c in range(0, free.reserved_peak + 4 * MiB, 2 * MiB)
                    if not replay([events], c).num_ooms)
        got = least_capacity([events])
        assert free.allocated_peak <= got <= free.reserved_peak + 2 * MiB
        assert not replay([events], got).num_ooms and got == scan
