"""Test oracles over the solver's fits (moved out of the package: only tests call them).

:func:`solve_max_batch`: the largest batch some split fits into every budget, and its split;
:func:`max_even_batch`: the largest batch whose plain even split is predicted to fit. Both are
themselves checked against brute force in ``tests/test_solver.py``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dptune.solve.memory import (MIN_SLOPE_BYTES, Caps, Fit, _cap, _card_bytes, _choose_cards, _cmax_at,
                           bisect_last, over_budget, predict, shares_of, solve_balance)
from dptune.split import even_split


def _feasible_batch(fits: Sequence[Fit], budgets: Sequence[int], batch_size: int, caps: Caps,
                    m: int, every_card: bool = False) -> bool:
    c = _cmax_at(fits, budgets, 1.0, batch_size, caps, m, every_card)
    return c is not None and _choose_cards(c, batch_size, m) is not None


def solve_max_batch(fits: Sequence[Fit], budgets: Sequence[int], *, min_chunk_nonzero: int = 1,
                    caps: Caps = None, limit: Optional[int] = None, every_card: bool = False
                    ) -> tuple[int, list[int]]:
    """The largest batch some split fits into every budget, and its balanced split.

    Card 0's ``batch_slope_bytes`` makes its room shrink as the batch grows. The split
    returned is :func:`solve_balance`'s at that batch (the margin spread over the cards).
    ``limit`` bounds the search (``None``: none). Raises :class:`NoFeasibleSplitError` when
    not even the smallest batch (1, or ``min_chunk_nonzero``) fits; with ``every_card`` the
    smallest batch is ``min_chunk_nonzero`` on every card.
    """
    n = len(fits)
    m = max(1, int(min_chunk_nonzero))
    big = 1 << 62
    # room at batch 0 bounds every batch (card 0's room only shrinks with the batch)
    upper = 0
    for i, f in enumerate(fits):
        if budgets[i] <= 0:
            continue
        x = (budgets[i] - f.intercept_bytes) / max(f.slope_bytes, MIN_SLOPE_BYTES)
        c = big if x >= big else max(0, int(math.floor(x)))
        upper += _cap(caps, i, c)
    if limit is not None:
        upper = min(upper, limit)
    # largest B with sum(cmax(B)) >= B and card 0's fixed cost fitting: monotone
    def loose(b: int) -> bool:
        c = _cmax_at(fits, budgets, 1.0, b, caps, m if every_card else 1, every_card)
        return c is not None and sum(c) >= b

    smallest = m * n if every_card else m
    lo, hi = (smallest, upper) if every_card else (0, upper)
    if not loose(lo):
        hi = lo - 1
    lo = bisect_last(loose, lo, hi)
    best = 0
    b = lo
    while b >= smallest:  # exact check (the BatchNorm rule can leave gaps)
        if _feasible_batch(fits, budgets, b, caps, m, every_card):
            best = b
            break
        b -= 1
    if best == 0:
        solve_balance(fits, budgets, smallest, min_chunk_nonzero=m, caps=caps, strict=True,
                      every_card=every_card)
        raise over_budget(0, 0.0, smallest)  # pragma: no cover - the line above raises
    return best, solve_balance(fits, budgets, best, min_chunk_nonzero=m, caps=caps, strict=True,
                               every_card=every_card)


def _even_fits(fits: Sequence[Fit], budgets: Sequence[int], batch_size: int, caps: Caps,
               m: int) -> bool:
    split = even_split(batch_size, len(fits))
    if any(0 < c < m for c in split):
        return False
    if any(c > _cap(caps, i, c) for i, c in enumerate(split)):
        return False
    return all(s <= 1.0 for s in shares_of(predict(fits, split, batch_size), budgets, split))


def max_even_batch(fits: Sequence[Fit], budgets: Sequence[int], *, min_chunk_nonzero: int = 1,
                   caps: Caps = None, limit: Optional[int] = None) -> int:
    """The even split's largest batch as a user raising DataParallel's batch finds it: every
    plain even split (``torch.chunk``'s) up to it predicted to fit (BatchNorm: splits with a
    chunk of 1 skipped), the next one not; 0 if none. ``torch.chunk`` is not monotone per
    card, so a larger batch that fits again above the first failure does not count."""
    n = len(fits)
    m = max(1, int(min_chunk_nonzero))

    def every_card_full(b: int) -> bool:  # stricter, monotone: every card at ceil(b/n)
        step = -(-b // n)
        if 0 < step < m:
            return False
        for i, f in enumerate(fits):
            if step > _cap(caps, i, step):
                return False
            if budgets[i] <= 0 or _card_bytes(f, i, step, b) > budgets[i]:
                return False
        return True

    upper = solve_max_batch(fits, budgets, min_chunk_nonzero=m, caps=caps, limit=limit)[0] \
        if _feasible_batch(fits, budgets, m, caps, m) else 0
    lo, hi = 0, upper
    lo = bisect_last(every_card_full, lo, hi)
    best = lo
    for b in range(lo + 1, min(upper, lo + 2 * n + 2) + 1):  # last cards may get less
        if _even_fits(fits, budgets, b, caps, m):
            best = b
        elif not any(0 < c < m for c in even_split(b, n)):
            break                       # the first failure: a user stops here
    if best and not _even_fits(fits, budgets, best, caps, m):  # pragma: no cover
        best = 0
    return best
