"""DDP with per-rank batch sizes in real processes: gloo on the CPU, 2 and 3 ranks.

One job per world size runs every scenario (``tests/support/ddp_workers.py``), so torch is imported
once per rank. The NCCL versions need one GPU per rank (one card cannot run two NCCL ranks:
NCCL refuses two ranks on the same device), so they are marked ``cuda`` and run only where
several cards are visible.
"""

from __future__ import annotations

import pytest
import torch

import ddp_workers as w

SIZES = {2: [5, 3], 3: [4, 1, 7]}
N_SAMPLER = {2: 19, 3: 23}           # not multiples of B: the tail step is exercised
SPEC = {2: "32GB,24GB", 3: "2x32GB,24GB"}
TOO_SMALL = {2: "24GB,390MiB", 3: "24GB,390MiB,24GB"}   # 6 MiB left: not even the workspace fits


def _jobs(world: int) -> list:
    sizes = SIZES[world]
    return [
        ("grad:scaled", {"sizes": sizes}),
        ("grad:unscaled", {"sizes": sizes, "scale": False}),
        ("sampler:keep", {"sizes": sizes, "n": N_SAMPLER[world]}),
        ("sampler:drop", {"sizes": sizes, "n": N_SAMPLER[world], "drop_last": True}),
        ("plan:balance", {"spec": SPEC[world], "global_batch": 96, "objective": "balance"}),
        ("plan:max", {"spec": SPEC[world], "objective": "max_batch"}),
        ("plan:fast", {"spec": SPEC[world], "global_batch": 96}),
        ("plan:infeasible", {"spec": TOO_SMALL[world], "global_batch": 8}),
        ("user_error", {"spec": f"{world}x24GB"}),
    ]


# real gloo processes under torchrun-style rendezvous: several seconds a job
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def job(request):
    world = request.param
    return world, w.launch(world, _jobs(world), timeout=240)


def _close(a, b, tol=1e-6):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_every_rank_gets_the_full_batch_gradient(job):
    world, out = job
    sizes = SIZES[world]
    full = w.full_batch_grads(sum(sizes))
    for r in range(world):
        got = out[r]["grad:scaled"]
        assert "error" not in got, got
        assert got["n"] == sizes[r]
        assert len(got["grads"]) == len(full)
        for g, f in zip(got["grads"], full):
            assert _close(g, f), (r, g[:3], f[:3])
    # without the scale, DDP's equal-weight average of uneven means is another gradient
    plain = out[0]["grad:unscaled"]["grads"]
    assert not all(_close(g, f) for g, f in zip(plain, full))


def test_sampler_covers_the_dataset_once_per_epoch_and_reshuffles(job):
    world, out = job
    n, sizes = N_SAMPLER[world], SIZES[world]
    epochs = [out[r]["sampler:keep"]["epochs"] for r in range(world)]
    steps = {len(e) for rank_epochs in epochs for e in rank_epochs}
    assert steps == {-(-n // sum(sizes))}                       # same step count everywhere
    orders = []
    for epoch in range(2):
        seen = [i for r in range(world) for batch in epochs[r][epoch] for i in batch]
        assert sorted(seen) == list(range(n))                  # each sample exactly once
        for r in range(world):
            assert all(len(b) <= sizes[r] for b in epochs[r][epoch])
            assert [len(b) for b in epochs[r][epoch][:-1]] == [sizes[r]] * (len(epochs[r][epoch]) - 1)
        orders.append([epochs[r][epoch] for r in range(world)])
    assert orders[0] != orders[1]                               # set_epoch reshuffles
    # drop_last: only full steps, no sample twice
    B = sum(sizes)
    for epoch in range(2):
        seen = [i for r in range(world) for b in out[r]["sampler:drop"]["epochs"][epoch] for i in b]
        assert len(seen) == len(set(seen)) == (n // B) * B


def test_ranks_agree_on_the_plan_and_it_matches_the_offline_plan(job):
    from dptune import ddp

    world, out = job
    for label, kw in (("plan:balance", {"global_batch": 96, "objective": "balance"}),
                      ("plan:max", {"objective": "max_batch"}),
                      ("plan:fast", {"global_batch": 96})):
        plans = [out[r][label] for r in range(world)]
        assert all("error" not in p for p in plans), plans
        first = plans[0]["plan"]
        for p in plans[1:]:
            assert p["plan"]["batch_sizes"] == first["batch_sizes"]
            assert p["plan"]["loss_scales"] == first["loss_scales"]
            assert p["plan"]["probes"] == first["probes"]
        hosts = {rk["host"] for rk in first["ranks"]}
        assert None not in hosts
        offline = ddp.plan(w._plan_model, w._plan_sample, optimizer=w._adamw, simulate=SPEC[world],
                           headroom=0, **kw)
        assert first["batch_sizes"] == offline.batch_sizes
        # the estimated times came with the probes, gathered from every rank
        assert first["probes"] == [p.to_dict() for p in offline.probes]
        assert all(p["seconds"] > 0 for p in first["probes"])
        assert first["notes"] == list(offline.notes)
    assert sum(out[0]["plan:balance"]["plan"]["batch_sizes"]) == 96
    assert out[0]["plan:fast"]["plan"]["objective"] == "throughput"


def test_an_infeasible_rank_raises_on_every_rank(job):
    world, out = job
    for r in range(world):
        got = out[r]["plan:infeasible"]
        assert got.get("error") == "NoFeasibleSplitError", got
        assert "rank 1 (" in got["message"] and "rank 0 (" not in got["message"]
        assert got["seconds"] < 60
        err = out[r]["user_error"]
        assert err.get("error") == "UserCodeError", err
        assert "broken batch on this rank" in err["message"]
        assert err["message"] == out[0]["user_error"]["message"]      # the same on every rank
        assert err["message"].startswith("rank 1 failed")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs one GPU per rank (two NCCL ranks cannot share one card)")
def test_nccl_gradient_equals_full_batch():  # pragma: no cover - needs 2 GPUs
    out = w.launch(2, [("grad:nccl", {"sizes": [5, 3], "device": "cuda"})], timeout=240, backend="nccl")
    full = w.full_batch_grads(8)
    for r in range(2):
        assert "error" not in out[r]["grad:nccl"], out[r]["grad:nccl"]
        for g, f in zip(out[r]["grad:nccl"]["grads"], full):
            assert _close(g, f, 1e-4)


# ---- the README's loop on every step: the tail, a tail smaller than the world, a wrong plan --

LOOP_JOBS = [
    ("loop:tail", {"sizes": [44, 45, 1], "n": 100}),              # tail [4, 5, 1]
    ("loop:tail2", {"sizes": [40, 30, 20], "n": 100}),            # tail [5, 3, 2]
    ("loop:small_tail", {"sizes": [4, 1, 7], "n": 26, "epochs": 2}),   # tail of 2 < 3 ranks
    ("loop:sizes", {"sizes": [4, 1, 7], "n": 26, "how": "sizes"}),
    ("loop:planned", {"sizes": [40, 30, 20], "n": 100, "how": "planned"}),
    ("wrong_world:sampler", {"plan_world": 4, "n": 100, "what": "sampler"}),
    ("wrong_world:scale", {"plan_world": 4, "n": 100, "what": "scale_loss"}),
    ("wrong_world:scale_batch", {"plan_world": 4, "n": 100, "what": "scale_loss:batch"}),
    ("wrong_world:fewer", {"plan_world": 2, "n": 100, "what": "sampler"}),
    ("small", {"sizes": [4, 1, 7], "n": 2}),
    ("bn", {"sizes": [4, 2, 7], "n": 29}),                      # tail of 3 < 2 x 3 ranks
]


@pytest.fixture(scope="module")
def loop_job():
    return w.launch(3, LOOP_JOBS, timeout=240)


def _steps_by_rank(out, label):
    for r in range(3):
        assert "error" not in out[r][label], out[r][label]
    return [out[r][label]["steps"] for r in range(3)]


def _check_every_step(out, label, n):
    """Each step's DDP gradient, on every rank, is the single-process gradient of the mean
    over the samples the ranks got at that step; returns the per-step sizes."""
    steps = _steps_by_rank(out, label)
    assert len({len(s) for s in steps}) == 1
    sizes = []
    for k in range(len(steps[0])):
        batch = [i for r in range(3) for i in steps[r][k]["indices"]]
        assert len(batch) == len(set(batch))
        full = w.grads_of(batch, n)
        for r in range(3):
            assert steps[r][k]["indices"], (label, k, r)          # no rank is ever empty
            for g, f in zip(steps[r][k]["grads"], full):
                assert _close(g, f, 1e-5), (label, k, r, g[:3], f[:3])
        sizes.append([len(steps[r][k]["indices"]) for r in range(3)])
    return sizes


@pytest.mark.slow
def test_the_tail_step_has_the_gradient_of_its_global_batch(loop_job):
    assert _check_every_step(loop_job, "loop:tail", 100) == [[44, 45, 1], [4, 5, 1]]
    assert _check_every_step(loop_job, "loop:tail2", 100) == [[40, 30, 20], [5, 3, 2]]
    # the planned scale (no batch size) would be off on the tail: refused, saying what to pass
    for r in range(3):
        got = loop_job[r]["loop:planned"]
        assert got.get("error") == "UsageError" and "batch_size=len(batch)" in got["message"], got


@pytest.mark.slow
def test_a_tail_smaller_than_the_world_runs_on_every_rank(loop_job):
    sizes = _check_every_step(loop_job, "loop:small_tail", 26)
    # 26 = 2 x 12 + 2: the step before the tail lends one sample so each rank gets one
    assert sizes == [[4, 1, 7], [4, 1, 6], [1, 1, 1]] * 2
    steps = _steps_by_rank(loop_job, "loop:small_tail")
    for epoch in range(2):
        seen = [i for r in range(3) for s in steps[r] if s["epoch"] == epoch for i in s["indices"]]
        assert sorted(seen) == list(range(26))                       # each sample once
    assert _check_every_step(loop_job, "loop:sizes", 26) == [[4, 1, 7], [4, 1, 6], [1, 1, 1]]
    for r in range(3):                                               # too few samples for 3 ranks
        got = loop_job[r]["small"]
        assert got.get("error") == "UsageError" and "each of the 3 ranks one" in got["message"], got


@pytest.mark.slow
def test_a_batchnorm_model_gets_two_samples_on_every_step(loop_job):
    got = [loop_job[r]["bn"] for r in range(3)]
    assert all("error" not in g for g in got), got
    # 29 = 2 x 13 + 3: the step before the tail lends 3 samples so each rank gets 2
    assert [g["sizes"] for g in got] == [[4, 4, 2], [2, 2, 2], [7, 4, 2]]


@pytest.mark.slow
def test_a_plan_for_another_world_size_fails_on_every_rank(loop_job):
    for label in ("wrong_world:sampler", "wrong_world:scale", "wrong_world:scale_batch"):
        for r in range(3):
            got = loop_job[r][label]
            assert got.get("error") == "UsageError", (label, r, got)
            assert "the plan has 4 ranks but this torch.distributed job has 3" in got["message"]
            assert "\n" not in got["message"] and got["seconds"] < 30
    for r in range(3):
        assert "the plan has 2 ranks" in loop_job[r]["wrong_world:fewer"]["message"]
