"""The ranks' search (DDP, FSDP): each rank's cap bracketed from its own probes, certified only
where the probes agree with the monotone surface the certificate rests on."""

from __future__ import annotations

import pytest

from dptune.search.ranks import RankObservations, bracket_ranks

GiB = 2**30


def _runner(obs: RankObservations, peak):  # type: ignore[no-untyped-def]
    def run(sizes):  # type: ignore[no-untyped-def]
        obs.run(lambda fn: [fn(r) for r in range(obs.n)], sizes, peak)
    return run


def test_each_rank_cap_bracketed_exactly_on_a_monotone_surface():
    budgets = [8 * GiB, 6 * GiB, 4 * GiB]

    def peak(r, b):  # type: ignore[no-untyped-def]
        return GiB + (r + 1) * 7 * 2**20 * b

    obs = RankObservations(budgets, 1)
    run = _runner(obs, peak)
    run([8, 8, 8])
    assert bracket_ranks(obs, run, 40, None)
    for r, budget in enumerate(budgets):     # brute force: the largest batch within budget
        want = max(b for b in range(1, 5000) if peak(r, b) <= budget)
        assert obs.lo(r) == want and obs.hi(r) == want + 1
    assert obs.not_monotone() is None


def test_a_rank_within_budget_above_a_batch_it_was_over_at_is_never_certified():
    """Fragmentation at the reserved level: rank 0 over at 50 samples, within budget at 100.
    Its bracket looks closed, but "one more sample is over" proves nothing there."""
    budgets = [4 * GiB]

    def peak(r, b):  # type: ignore[no-untyped-def]
        return GiB + 2**20 * b + (8 * GiB if b == 50 else 0)

    obs = RankObservations(budgets, 1)
    run = _runner(obs, peak)
    run([100])
    run([50])
    assert obs.not_monotone() == "rank 0 fits at 100 samples and is over at 50"
    assert not bracket_ranks(obs, run, 40, None)


def test_a_rank_whose_peak_falls_by_gigabytes_is_never_certified():
    """A rank reading 3 GiB less at a larger batch, both within budget (fragmentation: the
    caching allocator reused cached blocks there): no bracket of it is a proof."""
    budgets = [24 * GiB]

    def peak(r, b):  # type: ignore[no-untyped-def]
        return GiB + 2**20 * b + (3 * GiB if b == 100 else 0)

    obs = RankObservations(budgets, 1)
    run = _runner(obs, peak)
    run([100])
    run([101])
    assert obs.not_monotone() == "rank 0 reads 4.1 GiB at 100 samples and 1.1 GiB at 101: its figure falls as its batch grows"
    assert not bracket_ranks(obs, run, 40, None)


@pytest.mark.slow
def test_a_plan_stopped_by_its_round_cap_says_so():
    """DDP's largest batch per rank, stopped by the round cap before a bracket closed: the
    plan is not certified and its notes name the cap and the open brackets."""
    import torch

    from dptune import ddp
    from dptune.examples.models import MLP

    model = MLP(in_features=64, hidden=128, depth=2)
    plan = ddp.plan(model, model.sample, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    objective="max_batch", simulate="2x8GB", max_rounds=3)
    assert not plan.certified
    assert any("not certified: 3 of 3 rounds" in n and "still open" in n for n in plan.notes), plan.notes


@pytest.mark.parametrize("step_samples", [64, 128, 256])
def test_flat_steps_of_a_rank_staircase_close_at_the_cap(step_samples):
    """A rank's reserved figure on a wide MLP: every layer's activation a block rounded up to
    2 MiB, so the peak is flat for ``step_samples`` batches at a time and rises at their
    multiples. On a flat step the search asks the bracket's roundest batch (where such steps
    rise): every rank's bracket closes at its cap (brute force on the surface), certified,
    within 19 rounds (the middle of each bracket, as before, takes 20 on each of these)."""
    two = 2 * 2**20
    per_sample = two // step_samples
    budgets = [24 * GiB, 20 * GiB, 13 * GiB]

    def peak(r, b):  # type: ignore[no-untyped-def]
        return 2 * GiB + 8 * (-(-b * per_sample // two) * two)

    obs = RankObservations(budgets, 1)
    run = _runner(obs, peak)
    run([4096, 4096, 4096])
    assert bracket_ranks(obs, run, 19, None, staircase=True)
    for r, budget in enumerate(budgets):
        want = max(b for b in range(1, 400_000) if peak(r, b) <= budget)
        assert obs.lo(r) == want and obs.hi(r) == want + 1



@pytest.mark.parametrize("seed", range(40))
def test_rank_staircases_close_at_their_caps_from_one_sample(seed):
    """The reserved level's staircases from one probe at one sample per rank:
    every bracket closes at the rank's cap (bisection of the rising surface), certified,
    within 40 rounds (``benchmarks.rank_staircases`` counts them)."""
    from benchmarks.rank_staircases import exact_cap, layered_staircase

    peak, budgets = layered_staircase(seed)
    obs = RankObservations(budgets, 1)
    run = _runner(obs, peak)
    run([1] * len(budgets))
    assert bracket_ranks(obs, run, 40, None, staircase=True)
    for r, budget in enumerate(budgets):
        cap = exact_cap(peak, r, budget)
        assert obs.lo(r) == cap and obs.hi(r) == cap + 1


@pytest.mark.parametrize("seed", range(8))
def test_rank_staircases_under_batchnorm_never_probe_one_sample(seed):
    """The same staircases with BatchNorm's smallest batch of two, from the planner's first
    two rounds (2, then 16): every bracket closes at the cap, no probe below two."""
    from benchmarks.rank_staircases import exact_cap, layered_staircase

    peak, budgets = layered_staircase(seed)
    obs = RankObservations(budgets, 2)
    run = _runner(obs, peak)
    run([2] * len(budgets))
    run([16] * len(budgets))
    assert bracket_ranks(obs, run, 40, None, staircase=True)
    assert min(p.batch_size for p in obs.probes) >= 2
    for r, budget in enumerate(budgets):
        assert obs.lo(r) == exact_cap(peak, r, budget)


def test_a_step_start_below_the_smallest_batch_is_not_asked():
    """Under BatchNorm (smallest batch 2) a rank over budget at 3 and 5 samples with one
    figure: that step likely starts at 1 (``step_start``), a batch BatchNorm cannot train on;
    the next probe is 2."""
    obs = RankObservations([GiB], 2)
    run = _runner(obs, lambda r, b: 2 * GiB)    # over at every batch
    run([3])
    run([5])
    asked: list = []
    bracket_ranks(obs, lambda sizes: (asked.append(list(sizes)), run(sizes)), 3, None, staircase=True)
    assert asked and asked[0] == [2]
