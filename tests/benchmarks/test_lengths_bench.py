"""benchmarks/lengths.py: the token-budget epoch and the replay's shapes, by hand."""

from __future__ import annotations

import random

from benchmarks import lengths as bench


def test_token_budget_packs_the_sorted_epoch_by_count_times_longest():
    # sorted 1..5 at budget 6: [1, 2] (2 x 2 = 4), then 3 x 3 = 9 > 6 closes it; 3, 4, 5 alone
    batches = bench.epoch_token_budget([5, 3, 1, 4, 2], 6)
    assert sorted(sorted(b) for b in batches) == [[0], [1], [2, 4], [3]]


def test_token_budget_covers_every_sample_once_within_the_budget():
    rng = random.Random(3)
    lengths = [rng.randint(1, 50) for _ in range(500)]
    batches = bench.epoch_token_budget(lengths, 400, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 400 for b in batches)


def test_replay_runs_each_split_once_at_its_longest_length():
    sim = bench.Sim.__new__(bench.Sim)
    ran = []
    sim.fits = lambda length, split: ran.append((length, split)) or length < 40
    lengths = [10, 30, 20, 40, 5]
    batches = [[0, 1], [2, 4], [3]]            # longest 30, 20, 40; counts 2, 2, 1
    shapes, over = sim.replay(lengths, batches, lambda L, k: [k, 0])
    assert sorted(ran) == [(30, [2, 0]), (40, [1, 0])]
    assert (shapes, over) == (2, 1)
