"""dptune.solve.memory: fits and splits against brute force on synthetic affine cards."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune.errors import NoFeasibleSplitError
from dptune.solve.memory import Fit
from dptune.solve.memory import fit_affine, predict, shares_of, solve_balance
from oracles import max_even_batch, solve_max_batch
from dptune.split import even_split

# ---- helpers ------------------------------------------------------------------------------


def max_share(fits, budgets, split, batch_size=None):
    """The largest predicted share of budget over the cards in use (the objective the
    brute force below minimises; only tests need it, so it lives here, not in the solver)."""
    return max(shares_of(predict(fits, split, batch_size), budgets, split))


def splits(batch: int, n: int, m: int = 1, caps=None):
    """Every split of batch over n cards with chunks in {0} U [m, cap]."""
    allowed = [[0] + list(range(m, batch + 1)) for _ in range(n)]
    if caps is not None:
        allowed = [[c for c in a if caps[i] is None or c <= caps[i]] for i, a in enumerate(allowed)]
    for head in itertools.product(*allowed[:-1]):
        last = batch - sum(head)
        if last in allowed[-1]:
            yield list(head) + [last]


def brute_balance(fits, budgets, batch, m=1, caps=None):
    best = None
    for s in splits(batch, len(fits), m, caps):
        v = max_share(fits, budgets, s, batch)
        if best is None or v < best[0]:
            best = (v, s)
    return best


def brute_max_batch(fits, budgets, m=1, upto=40):
    best = 0
    for b in range(1, upto + 1):
        r = brute_balance(fits, budgets, b, m)
        if r is not None and r[0] <= 1.0:
            best = b
    return best


cards = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 10), st.integers(20, 120)),  # a, b, budget
    min_size=1, max_size=3)


def build(cs, g=0):
    fits = [Fit(float(a), float(b), float(g) if i == 0 else 0.0) for i, (a, b, _) in enumerate(cs)]
    return fits, [bud for _, _, bud in cs]


# ---- fits -----------------------------------------------------------------------------------


def test_fit_affine_two_points_is_exact():
    f = fit_affine([(10, 1000 + 10 * 7), (30, 1000 + 30 * 7)])
    assert f.intercept_bytes == pytest.approx(1000)
    assert f.slope_bytes == pytest.approx(7)
    assert f.batch_slope_bytes == 0
    assert f.points == 2 and f.max_error_bytes == pytest.approx(0, abs=1e-6)


def test_fit_affine_with_batch_term_recovers_card0():
    truth = lambda c, b: 5000 + 40 * c + 3 * b  # noqa: E731
    pts = [(16, 64, truth(16, 64)), (10, 64, truth(10, 64)), (5, 32, truth(5, 32))]
    f = fit_affine(pts, batch_term=True)
    assert (f.intercept_bytes, f.slope_bytes, f.batch_slope_bytes) == pytest.approx((5000, 40, 3))
    assert f.predict(100, 400) == pytest.approx(truth(100, 400))


def test_fit_affine_least_squares_and_errors():
    f = fit_affine([(0, 0), (1, 10), (2, 21), (3, 29)])
    assert f.points == 4 and f.max_error_bytes > 0
    with pytest.raises(ValueError):
        fit_affine([(4, 10), (4, 12)])           # one chunk: no slope
    with pytest.raises(ValueError):                # collinear in (chunk, batch)
        fit_affine([(16, 64, 1), (8, 32, 2), (4, 16, 3)], batch_term=True)


def test_predict_unused_cards_cost_nothing_but_card0_always_pays():
    fits = [Fit(100.0, 10.0, 1.0), Fit(50.0, 10.0)]
    assert predict(fits, [0, 4]) == [100 + 4.0, 90.0]
    assert predict(fits, [4, 0]) == [100 + 40 + 4.0, 0.0]


# ---- balance --------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(cs=cards, batch=st.integers(1, 12), g=st.integers(0, 3))
def test_balance_is_optimal_and_feasible_when_possible(cs, batch, g):
    fits, budgets = build(cs, g)
    opt = brute_balance(fits, budgets, batch)
    split = solve_balance(fits, budgets, batch, strict=False)
    assert sum(split) == batch and all(c >= 0 for c in split)
    assert max_share(fits, budgets, split, batch) <= opt[0] * (1 + 1e-9) + 1e-12
    if opt[0] <= 1.0:
        strict = solve_balance(fits, budgets, batch)
        assert max_share(fits, budgets, strict, batch) <= 1.0
    else:
        with pytest.raises(NoFeasibleSplitError) as e:
            solve_balance(fits, budgets, batch)
        assert e.value.shortfall_bytes is not None and e.value.shortfall_bytes > 0
        assert "card" in str(e.value) and "over its budget" in str(e.value)


@settings(max_examples=100, deadline=None)
@given(cs=cards, batch=st.integers(2, 12))
def test_balance_batchnorm_rule_gives_no_card_a_single_sample(cs, batch):
    fits, budgets = build(cs)
    opt = brute_balance(fits, budgets, batch, m=2)
    if opt is None:
        with pytest.raises(NoFeasibleSplitError):
            solve_balance(fits, budgets, batch, min_chunk_nonzero=2, strict=False)
        return
    split = solve_balance(fits, budgets, batch, min_chunk_nonzero=2, strict=False)
    assert 1 not in split and sum(split) == batch
    assert max_share(fits, budgets, split, batch) <= opt[0] * (1 + 1e-9) + 1e-12


@settings(max_examples=80, deadline=None)
@given(cs=cards, batch=st.integers(1, 10), data=st.data())
def test_balance_respects_caps(cs, batch, data):
    fits, budgets = build(cs)
    caps = [data.draw(st.one_of(st.none(), st.integers(0, batch))) for _ in cs]
    opt = brute_balance(fits, budgets, batch, caps=caps)
    if opt is None:
        with pytest.raises(NoFeasibleSplitError):
            solve_balance(fits, budgets, batch, caps=caps, strict=False)
        return
    split = solve_balance(fits, budgets, batch, caps=caps, strict=False)
    assert all(cap is None or c <= cap for c, cap in zip(split, caps))
    assert max_share(fits, budgets, split, batch) <= opt[0] * (1 + 1e-9) + 1e-12


def test_balance_identical_cards_gives_card0_less():
    G = 2**30
    fits = [Fit(6.0 * G, 0.1 * G, 0.01 * G)] + [Fit(2.0 * G, 0.1 * G)] * 3
    split = solve_balance(fits, [23 * G] * 4, 256)
    assert split == [15, 80, 80, 81]


def test_balance_larger_card0_gets_more():
    G = 2**30
    fits = [Fit(6.0 * G, 0.1 * G)] + [Fit(2.0 * G, 0.1 * G)] * 3
    split = solve_balance(fits, [47 * G, 23 * G, 23 * G, 23 * G], 256)
    assert split[0] > max(split[1:])


def test_balance_large_batch_is_fast_and_exact():
    fits = [Fit(1e9, 1e5, 10.0), Fit(5e8, 1.2e5), Fit(5e8, 0.9e5)]
    split = solve_balance(fits, [2e10, 2e10, 1.5e10], 100_000, strict=False)
    assert sum(split) == 100_000
    lvl = max_share(fits, [2e10, 2e10, 1.5e10], split)
    for i, j in itertools.permutations(range(3), 2):  # no one-sample move lowers the max
        if split[i] > 0:
            moved = list(split)
            moved[i] -= 1
            moved[j] += 1
            assert max_share(fits, [2e10, 2e10, 1.5e10], moved) >= lvl - 1e-12


def test_balance_card0_without_room_raises():
    with pytest.raises(NoFeasibleSplitError) as e:
        solve_balance([Fit(10.0, 1.0), Fit(1.0, 1.0)], [-5, 100], 4)
    assert e.value.shortfall_bytes == 15


# ---- max batch ------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(cs=cards, g=st.integers(0, 3), m=st.sampled_from([1, 2]))
def test_max_batch_matches_brute_force(cs, g, m):
    fits, budgets = build(cs, g)
    want = brute_max_batch(fits, budgets, m, upto=45)
    if want >= 45:  # beyond what brute force checks here
        return
    if want == 0:
        with pytest.raises(NoFeasibleSplitError):
            solve_max_batch(fits, budgets, min_chunk_nonzero=m)
        return
    b, split = solve_max_batch(fits, budgets, min_chunk_nonzero=m)
    assert b == want and sum(split) == b
    assert max_share(fits, budgets, split, b) <= 1.0
    if m == 2:
        assert 1 not in split


@settings(max_examples=80, deadline=None)
@given(cs=cards, g=st.integers(0, 3))
def test_max_even_batch_matches_brute_force(cs, g):
    fits, budgets = build(cs, g)
    n = len(fits)
    want = 0
    for b in range(1, 60):      # a user raising the batch until the first failure
        s = even_split(b, n)
        if max_share(fits, budgets, s, b) > 1.0:
            break
        want = b
    got = max_even_batch(fits, budgets)
    if want < 55:
        assert got == want


def test_max_batch_card0_batch_term_limits_the_batch():
    G = 2**30
    fits = [Fit(6.0 * G, 0.1 * G, 0.05 * G)] + [Fit(2.0 * G, 0.1 * G)] * 3
    b, split = solve_max_batch(fits, [23 * G] * 4)
    assert b == 340 and split[0] == 0  # card 0's room: 6 + 0.05*B <= 23
    assert max_even_batch(fits, [23 * G] * 4) < b
    assert math.isclose(predict(fits, split)[0], 6 * G + 0.05 * G * 340)
