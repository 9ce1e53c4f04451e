"""The exact balance on a map (:func:`dptune.solve.discrete.least_largest_share`) against
brute force: every split of small batches over random maps whose figures fall and rise as a
card's chunk grows (no monotone surface assumed), some chunks not allowed at all."""

from __future__ import annotations

import itertools
import random

import pytest

from dptune.solve.discrete import least_largest_share


def splits(batch: int, n: int):  # type: ignore[no-untyped-def]
    for cut in itertools.combinations(range(batch + n - 1), n - 1):
        edges = (-1, *cut, batch + n - 1)
        yield tuple(edges[k + 1] - edges[k] - 1 for k in range(n))


def brute(shares, batch, groups=()):  # type: ignore[no-untyped-def]
    """The least largest share over every split (alike cards within one sample where
    ``groups``), and every split reaching it."""
    best, at = None, []
    for s in splits(batch, len(shares)):
        if any(c not in sh for c, sh in zip(s, shares)):
            continue
        if any(max(s[i] for i in g) - min(s[i] for i in g) > 1 for g in groups):
            continue
        top = max(sh[c] for c, sh in zip(s, shares))
        if best is None or top < best:
            best, at = top, [s]
        elif top == best:
            at.append(s)
    return best, at


def random_map(rng: random.Random, n: int, batch: int, alike: bool):  # type: ignore[no-untyped-def]
    """Per card, a share at each chunk: a rising line with falls (cached blocks that come and
    go), a few chunks missing; cards 1 and 2 the same card where ``alike``."""
    out = []
    for i in range(n):
        if alike and i == 2:
            out.append(dict(out[1]))
            continue
        slope, base = rng.uniform(0.01, 0.05), rng.uniform(0.05, 0.3)
        sh = {}
        for c in range(batch + 1):
            if rng.random() < 0.1 and c:
                continue
            sh[c] = round(base + slope * c + rng.choice([0, 0, 0, 0.08, -0.05]), 3)
        out.append(sh)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_least_largest_share_is_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, batch = rng.choice([(2, 14), (3, 12), (4, 9)])
    shares = random_map(rng, n, batch, alike=False)
    got = least_largest_share(shares, batch)
    best, at = brute(shares, batch)
    if best is None:
        assert got is None
        return
    assert got is not None
    assert got.level == best == got.least
    assert got.split in at                      # a split that reaches it, every chunk allowed
    # a preferred split only breaks ties: the share is the same, and where the preferred split
    # reaches it itself, it is the one returned
    for prefer in (rng.choice(at), next(splits(batch, n))):
        near = least_largest_share(shares, batch, prefer=prefer)
        assert near is not None and near.level == best and near.split in at
        if prefer in at:
            assert near.split == prefer


@pytest.mark.parametrize("seed", range(40))
def test_alike_cards_kept_within_one_sample(seed: int) -> None:
    rng = random.Random(1000 + seed)
    n, batch = rng.choice([(3, 13), (4, 10)])
    shares = random_map(rng, n, batch, alike=True)
    got = least_largest_share(shares, batch, [(1, 2)])
    free, _ = brute(shares, batch)
    together, at = brute(shares, batch, [(1, 2)])
    if free is None:
        assert got is None
        return
    assert got is not None and got.least == free
    if together is None:                        # no split keeps them together: the least one
        assert not got.alike and got.level == free
    else:
        assert got.alike and got.level == together and got.split in at
