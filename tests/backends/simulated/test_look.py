""":mod:`dptune.backends.simulated.look` on handmade allocator traces (no torch): the drawing
between two steps, the scan past an over point, the windows a certificate rests on, against
every step replayed for real through the allocator model.

Card 1's step allocates ``s1 = 3c MiB`` and frees it, then ``s2 = (2c + 20) MiB``: below
20 samples ``s2`` does not fit in ``s1``'s cached block and takes a segment of its own, from
20 on it does, so the reserved peak falls (118 MiB at 19 samples, 62 at 20) while the
allocated one grows. Against a 90 MiB budget card 1 fits at 13, is over from 14 to 19, fits
again from 20 to 29, and from 31 its allocated peak alone is over."""

from __future__ import annotations

from typing import Optional, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig, Event
from dptune.backends.simulated.look import ScaledTraces, lines_of, look_past, step_stats

MiB = 2**20
BUDGETS = [2**30, 90 * MiB]
CFG = AllocatorConfig()


def card1(c: int, jump_at: Optional[int] = None) -> list[list[Event]]:
    """Set-up, warm-up step, measured step; ``jump_at``: from there ``s1`` takes 50 MiB more
    (a step that does not grow linearly, as a kernel changing its workspace)."""
    s1 = 3 * c * MiB + 1000 + (50 * MiB if jump_at is not None and c >= jump_at else 0)
    s2 = (2 * c + 20) * MiB + 1000
    step = [Event(1, s1, 0), Event(1, -s1, 0), Event(2, s2, 0), Event(2, -s2, 0)]
    return [[], step, step]


def card0(c: int, batch: int) -> list[list[Event]]:
    step = [Event(1, (c + batch) * MiB, 0), Event(1, -(c + batch) * MiB, 0)]
    return [[], step, step]


def traces_of(jump_at: Optional[int] = None, calls: Optional[list] = None):  # type: ignore[no-untyped-def]
    def of(split: Sequence[int]) -> list[list[list[Event]]]:
        if calls is not None:
            calls.append(tuple(split))
        return [card0(split[0], sum(split)), card1(split[1], jump_at)]
    return of


def fits(c: int) -> bool:
    return step_stats(card1(c), CFG).reserved_peak <= BUDGETS[1]


def test_the_drawing_is_the_real_step_where_sizes_grow_linearly() -> None:
    sc = ScaledTraces.of(card1(14), card1(30), 16)
    assert sc is not None
    for k in (0, 1, 5, 16, 40):
        assert sc.at(k) == card1(14 + k)


def test_a_fall_past_the_over_point_is_found_where_brute_force_finds_it() -> None:
    calls: list = []
    look = look_past(traces_of(calls=calls), [5, 13], [None, 14], BUDGETS, CFG, 0, 2048)
    (w,) = look.cards
    first_fit = next(c for c in range(14, 40) if fits(c))
    last_fit = max(c for c in range(14, w.end or 0) if fits(c))
    assert (w.card, w.start, w.fits, w.last_fits) == (1, 14, first_fit, last_fit) == (1, 14, 20, 29)
    assert (5, 20) in calls and (5, 29) in calls  # simulated for real before they are reported
    assert look.falls == (w,) and not look.closed


def test_a_window_over_throughout_ends_where_the_allocated_peak_alone_is_over() -> None:
    look = look_past(traces_of(), [5, 29], [None, 30], BUDGETS, CFG, 0, 2048)
    (w,) = look.cards
    end = next(c for c in range(30, 60)
               if step_stats(card1(c), CFG).allocated_peak > BUDGETS[1])
    # the end test allows a drawn size 512 bytes a malloc off, so it may end a step late
    assert w.start == 30 and w.fits is None and end <= (w.end or 0) <= end + 1 and look.closed
    assert not any(fits(c) for c in range(30, w.end or 0))


def test_a_step_that_does_not_grow_linearly_is_not_looked_at() -> None:
    look = look_past(traces_of(jump_at=17), [5, 13], [None, 14], BUDGETS, CFG, 0, 2048)
    (w,) = look.cards
    assert not w.scaled and w.fits is None and not look.closed and not look.falls
    assert "not looked at" in w.describe()


def test_card_0s_windows_follow_the_least_it_can_take_of_every_larger_batch() -> None:
    # the others at their caps: card 0 takes the batch's growth at once
    (c0,) = [w for w in lines_of([527, 536, 536], [528, 537, 537]) if w.card == 0]
    assert (c0.base, c0.mover, c0.label) == ((528, 536, 536), 0, 528)
    # room below the caps: no samples on card 0 while the caps hold the batch, then samples
    zero, one = [w for w in lines_of([0, 119, 118], [1, 324, 324], min_chunk=2) if w.card == 0]
    assert zero.no_samples and zero.base[0] == 0 and sum(zero.base) == 238 and zero.length == 646 - 238 + 1
    assert all(c <= 323 for c in zero.base[1:])
    assert (one.base, one.label) == ((2, 323, 323), 2)      # BatchNorm: never one sample
    # a card without a cap: card 0 keeps none however large the batch
    lines = lines_of([10, 5, 5], [11, None, 8])
    assert [(w.card, w.no_samples, w.length) for w in lines] == [(0, True, None), (2, False, None)]
    assert lines[0].mover == 1


def test_a_window_that_fits_at_its_base_is_looked_at_from_the_top(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An answer left open: card 1's window from 21 samples fits at its base. With the look's
    replays cut to 3 a window (a long window against ``LOOK_MAX_CHUNKS``), a scan from the base
    would stop at 23 and report that as the last chunk within budget; drawn to its end and
    scanned from the top down, the window gives brute force's last fit (29) and its end."""
    import dptune.backends.simulated.look as L
    monkeypatch.setattr(L, "LOOK_MAX_CHUNKS", 3)
    look = look_past(traces_of(), [5, 20], [None, 21], BUDGETS, CFG, 0, 3)
    (w,) = look.cards
    end = next(c for c in range(21, 60) if step_stats(card1(c), CFG).allocated_peak > BUDGETS[1])
    assert w.fits == 21 and w.last_fits == max(c for c in range(21, end) if fits(c)) == 29
    assert end <= (w.end or 0) <= end + 1
    # a window over at its base is scanned from the base, as before: cut at the replays
    over = look_past(traces_of(), [5, 13], [None, 14], BUDGETS, CFG, 0, 3)
    assert over.cards[0].end is None
