"""Split arithmetic (dptune.split): pure integers, no torch."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dptune.split import even_split, scale_split, validate_chunk_sizes

sizes_st = st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=16).filter(
    lambda s: sum(s) > 0)


# ---- even_split ------------------------------------------------------------------------

@pytest.mark.parametrize("batch, n, expected", [
    (8, 4, [2, 2, 2, 2]),
    (10, 4, [3, 3, 3, 1]),
    (5, 4, [2, 2, 1, 0]),
    (1, 3, [1, 0, 0]),
    (0, 2, [0, 0]),
    (7, 1, [7]),
])
def test_even_split_matches_torch_chunk(batch, n, expected):
    assert even_split(batch, n) == expected


@settings(deadline=None)  # the first example imports torch
@given(st.integers(0, 2000), st.integers(1, 16))
def test_even_split_like_torch_chunk_property(batch, n):
    import torch

    out = even_split(batch, n)
    assert sum(out) == batch and len(out) == n
    chunks = [c.numel() for c in torch.arange(batch).chunk(n)] if batch else []
    assert out[:len(chunks)] == chunks
    assert all(c == 0 for c in out[len(chunks):])


@pytest.mark.parametrize("batch, n", [(4, 0), (-1, 2)])
def test_even_split_rejects_bad_arguments(batch, n):
    with pytest.raises(ValueError):
        even_split(batch, n)


# ---- validate_chunk_sizes ------------------------------------------------------------

@pytest.mark.parametrize("bad", [[], [1, -1], [1.5, 2], [True, 2], [0, 0], ["3"]])
def test_validate_rejects(bad):
    with pytest.raises(ValueError):
        validate_chunk_sizes(bad)


def test_validate_checks_device_count_and_returns_list():
    assert validate_chunk_sizes((3, 0, 2)) == [3, 0, 2]
    with pytest.raises(ValueError, match="3 entries for 4 devices"):
        validate_chunk_sizes([1, 2, 3], n_devices=4)


# ---- scale_split ---------------------------------------------------------------------

def test_scale_split_examples():
    assert scale_split([6, 10, 10, 10], 36) == [6, 10, 10, 10]
    assert scale_split([6, 10, 10, 10], 18) == [3, 5, 5, 5]
    assert scale_split([0, 4, 4], 5) == [0, 3, 2]          # tie goes to the earlier card
    assert scale_split([1, 1, 1], 0) == [0, 0, 0]


def test_scale_split_rejects_negative_batch_and_bad_sizes():
    with pytest.raises(ValueError):
        scale_split([1, 2], -1)
    with pytest.raises(ValueError):
        scale_split([0, 0], 4)


@settings(max_examples=300)
@given(sizes_st, st.integers(0, 5000))
def test_scale_split_properties(sizes, batch):
    out = scale_split(sizes, batch)
    total = sum(sizes)
    assert len(out) == len(sizes)
    assert sum(out) == batch                                   # sum exact
    assert all(isinstance(c, int) and c >= 0 for c in out)
    assert all(o == 0 for o, c in zip(out, sizes) if c == 0)   # zeros stay zero
    for o, c in zip(out, sizes):                               # within 1 of the exact share
        assert abs(Fraction(o) - Fraction(c * batch, total)) < 1


@given(sizes_st)
def test_scale_split_same_size_is_identity(sizes):
    assert scale_split(sizes, sum(sizes)) == sizes


@given(sizes_st, st.integers(1, 20))
def test_scale_split_exact_multiple(sizes, k):
    assert scale_split(sizes, k * sum(sizes)) == [k * c for c in sizes]


def test_fill_within_adds_in_order_up_to_each_cap_and_says_what_is_left():
    from dptune.split import fill_within
    out, left = fill_within([5, 5, 5], 7, [6, 8, 9], [2, 0, 1])
    assert (out, left) == ([6, 7, 9], 0)          # card 2 first (to 9), then card 0 (to 6), card 1 the rest
    assert fill_within([0, 0], 10, [3, 4], [0, 1]) == ([3, 4], 3)     # the caps hold 7 of 10
    assert fill_within([1, 2], 5, [None, 0], [1, 0]) == ([6, 2], 0)   # no cap takes the rest; over-cap stays
