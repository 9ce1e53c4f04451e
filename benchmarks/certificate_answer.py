"""The exhaustive answers of a certificate case (:class:`benchmarks.certificate_surface.Surface`):
each card's cap, the largest batch, the even split's largest batch, by scans and bisections on
the surface itself, never from dptune's search. Used by :mod:`benchmarks.certificate` and
:mod:`benchmarks.certificate_levels`, and by the search tests as their oracle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dptune.split import even_split

from benchmarks.certificate_surface import Surface, _valid

__all__ = ["Answer", "answer", "caps", "reachable", "card0_chunk", "best_batch", "best_even",
           "even_start"]


def _last_true(pred: Callable[[int], bool], lo: int, guess: Optional[int] = None) -> int:
    """Largest ``x >= lo`` with ``pred`` (true then false); ``lo - 1`` when ``pred(lo)`` is
    false. Gallops from ``guess`` (up or down), then bisects: few evaluations near a good
    guess (each may be a simulated step)."""
    if not pred(lo):
        return lo - 1
    good, bad = lo, None
    if guess is not None and guess > lo:
        if pred(guess):
            good = guess
        else:
            bad, step = guess, 1
            while bad - step > lo and not pred(bad - step):
                bad, step = bad - step, step * 2
            good = max(lo, bad - step)
    if bad is None:
        step = 1
        while pred(good + step):
            good, step = good + step, step * 2
        bad = good + step
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if pred(mid) else (good, mid)
    return good


def caps(s: Surface) -> list[int]:
    """Each card ``i >= 1``'s largest chunk within budget (0 under BatchNorm when < m)."""
    out = []
    for i in range(1, s.n):
        ok = s.f(i, s.m) <= s.budgets[i]
        c = _last_true(lambda c, i=i: s.f(i, c) <= s.budgets[i], s.m) if ok else 0
        out.append(c if c >= s.m else 0)
    return out


def reachable(caps_: Sequence[int], m: int) -> list[tuple[int, int]]:
    """The sums the cards ``i >= 1`` can take in all (each 0 or ``m..cap``), as intervals."""
    reach = [(0, 0)]
    for c in caps_:
        if c < m:
            continue
        merged: list[tuple[int, int]] = []
        for a, b in sorted(reach + [(a + m, b + c) for a, b in reach]):
            if merged and a <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        reach = merged
    return reach


def card0_chunk(batch: int, caps_: Sequence[int], m: int,
                reach: Optional[list[tuple[int, int]]] = None) -> Optional[int]:
    """The fewest samples card 0 can take of ``batch`` with the others at most at ``caps_``."""
    reach = reachable(caps_, m) if reach is None else reach
    for c0 in range(max(0, batch - sum(caps_)), batch + 1):
        if (c0 == 0 or c0 >= m) and any(a <= batch - c0 <= b for a, b in reach):
            return c0
    return None


def best_batch(s: Surface, caps_: Sequence[int]) -> int:
    reach = reachable(caps_, s.m)

    def ok(b: int) -> bool:
        c0 = card0_chunk(b, caps_, s.m, reach)
        return c0 is not None and s.g(c0, b) <= s.budgets[0]
    return max(0, _last_true(ok, s.m))


def even_start(s: Surface) -> int:
    return s.m * s.n if s.m > 1 else 1


def _first_over_even(s: Surface, i: int, cap: int, start: int, stop: int) -> int:
    """The first batch from ``start`` whose even split gives card ``i >= 1`` more than ``cap``."""
    b = start
    while b < stop and even_split(b, s.n)[i] <= cap:
        b += 1
    return b


def best_even(s: Surface, caps_: Sequence[int]) -> tuple[int, int]:
    """The even split's largest batch ``E`` as a user finds it (it fits at ``E``, not at the
    next valid even batch; BatchNorm: batches with a chunk of 1 are skipped), and that next
    batch. Card 0 gets the largest chunk and it grows with the batch (bisection); the other
    cards' chunks do not grow monotonically (``torch.chunk``), so they are scanned."""
    start = even_start(s)

    def card0_ok(b: int) -> bool:
        return s.g(even_split(b, s.n)[0], b) <= s.budgets[0]
    stop = _last_true(card0_ok, start) + 1
    for i in range(1, s.n):
        stop = min(stop, _first_over_even(s, i, caps_[i - 1], start, stop))
    def fits(b: int) -> bool:
        sp = even_split(b, s.n)
        return card0_ok(b) and all(c <= cap for c, cap in zip(sp[1:], caps_))
    nxt = stop
    while not _valid(even_split(nxt, s.n), s.m) or fits(nxt):
        nxt += 1
    valid = [b for b in range(start, nxt) if _valid(even_split(b, s.n), s.m)]
    return (valid[-1] if valid else 0), nxt



@dataclass(frozen=True)
class Answer:
    """What is to be proven: the largest batch, the caps, the even split's largest batch."""

    best: int
    caps: tuple[int, ...]
    even: int
    even_next: tuple[int, ...]       # the even split just above ``even`` (to be shown over)


def answer(s: Surface) -> Answer:
    cp = caps(s)
    e, nxt = best_even(s, cp)
    return Answer(best_batch(s, cp), tuple(cp), e, tuple(even_split(nxt, s.n)))
