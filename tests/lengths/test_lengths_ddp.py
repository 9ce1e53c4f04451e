"""The bucket sampler and loss scaling under DDP: real gloo processes on the CPU, 2 and 3 ranks."""

from __future__ import annotations

import pytest

import lengths_ddp_workers as w
from dptune.lengths import BucketBatchSampler


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def job(request):
    world = request.param
    out = w.launch(world)
    for r in out:
        assert "error" not in r, r.get("traceback")
    return world, out


def _close(a, b, tol=1e-5):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.slow
def test_an_epoch_covers_every_sample_once_in_the_same_steps_and_buckets(job):
    world, out = job
    plan = w.plan_for(world)
    n = len(w.LENGTHS)
    for e in range(2):
        per_rank = [out[r]["epochs"][e] for r in range(world)]
        assert len({len(b) for b in per_rank}) == 1                 # same number of steps
        seen = [i for r in range(world) for b in per_rank[r] for i in b]
        assert sorted(seen) == list(range(n))                       # every sample, once
        for step in range(len(per_rank[0])):
            buckets = {plan.edges.index(plan.bucket_for(w.LENGTHS[i]).length)
                       for r in range(world) for i in per_rank[r][step]}
            assert len(buckets) == 1                                # one bucket per step
            k = buckets.pop()
            for r in range(world):
                assert len(per_rank[r][step]) <= plan.buckets[k].chunk_sizes[r]
    assert out[0]["epochs"][0] != out[0]["epochs"][1]               # set_epoch reshuffles


@pytest.mark.slow
def test_every_step_gradient_is_the_global_batch_mean(job):
    world, out = job
    steps = out[0]["epochs"][0]
    for step in range(len(steps)):
        global_batch = [i for r in range(world) for i in out[r]["epochs"][0][step]]
        full = w.full_batch_grads(global_batch)
        for r in range(world):
            got = out[r]["grads"][step]
            assert all(_close(g, f) for g, f in zip(got, full)), (r, step)


def test_rank_slices_on_one_process_partition_each_global_batch():
    for world in (2, 3):
        plan = w.plan_for(world)
        samplers = [BucketBatchSampler(w.LENGTHS, plan, seed=1, rank=r) for r in range(world)]
        whole = BucketBatchSampler(w.LENGTHS, plan, seed=1, rank=0).batches()
        per_rank = [list(s) for s in samplers]
        for step, (_k, batch) in enumerate(whole):
            assert sorted(i for r in range(world) for i in per_rank[r][step]) == sorted(batch)
            scales = [samplers[r].loss_scale(step) for r in range(world)]
            assert abs(sum(scales) - world) < 1e-9     # W * sum(b_r) / B = W
