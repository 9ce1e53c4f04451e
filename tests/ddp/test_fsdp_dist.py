"""FSDP2 with per-rank batch sizes in real processes: gloo on the CPU, 2 and 3 ranks.

One job per world size runs every scenario (``tests/support/fsdp_workers.py``): a step with unequal
local batches whose gathered gradients must equal the single-process full-batch gradient
(FSDP2's reduce-scatter averages the ranks with equal weights; ``scale_loss`` corrects it),
the same with gradient accumulation, an epoch with the uneven sampler, and
``plan(..., strategy="fsdp")`` inside the job (each rank simulates its own card on a fake
group beside the real one), including a rank that cannot fit and a rank whose sharding
raises: both raise on every rank, in seconds.
"""

from __future__ import annotations

import pytest

import fsdp_workers as w

SIZES = {2: [5, 3], 3: [4, 1, 7]}
N_EPOCH = {2: 19, 3: 29}             # not multiples of B: the tail step runs too
SPEC = {2: "32GB,24GB", 3: "2x32GB,24GB"}
TOO_SMALL = {2: "24GB,390MiB", 3: "24GB,390MiB,24GB"}   # 6 MiB left: not even the workspace fits
MiB = 1 << 20
CARDS = {2: [48 * MiB, 24 * MiB], 3: [48 * MiB, 24 * MiB, 33 * MiB]}   # each rank's "CUDA card"
#: the stack's parameters (3 x Linear(64, 64), Linear(64, 8)) in float32
STACK_BYTES = 4 * (3 * (64 * 64 + 64) + 64 * 8 + 8)


def _jobs(world: int) -> list:
    sizes = SIZES[world]
    return [
        ("grad:scaled", {"sizes": sizes}),
        ("grad:unscaled", {"sizes": sizes, "scale": False}),
        ("grad:accumulate", {"sizes": sizes, "accumulate": 2}),
        ("epoch", {"sizes": sizes, "n": N_EPOCH[world]}),
        ("plan:balance", {"spec": SPEC[world], "global_batch": 96, "objective": "balance"}),
        ("plan:infeasible", {"spec": TOO_SMALL[world], "global_batch": 8}),
        ("user_error", {"spec": f"{world}x24GB"}),
        ("card_plan", {"totals": CARDS[world]}),
        ("card_plan:infeasible", {"totals": [48 * MiB] + [STACK_BYTES // world] * (world - 1)}),
    ]


pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def job(request):
    world = request.param
    return world, w.launch(world, _jobs(world), timeout=300)


def _close(a, b, tol=1e-6):
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def test_gathered_gradients_equal_the_full_batch_gradient(job):
    world, out = job
    sizes = SIZES[world]
    full = w.full_batch_grads(sum(sizes))
    for r in range(world):
        for label in ("grad:scaled", "grad:accumulate"):
            got = out[r][label]
            assert "error" not in got, got
            assert got["n"] == sizes[r]
            assert sorted(got["grads"]) == sorted(full)
            for name, f in full.items():
                assert len(got["grads"][name]) == len(f)
                assert _close(got["grads"][name], f), (r, label, name)
    # without the scale, FSDP's equal-weight average of uneven means is another gradient
    plain = out[0]["grad:unscaled"]["grads"]
    assert not all(_close(plain[name], f) for name, f in full.items())


def test_an_epoch_runs_the_same_steps_on_every_rank_and_covers_the_data(job):
    world, out = job
    n, sizes = N_EPOCH[world], SIZES[world]
    batches = [out[r]["epoch"]["batches"] for r in range(world)]
    assert {len(b) for b in batches} == {-(-n // sum(sizes))}
    seen = [i for r in range(world) for b in batches[r] for i in b]
    assert sorted(seen) == list(range(n))


def test_ranks_agree_on_the_fsdp_plan_and_it_matches_the_offline_plan(job):
    from dptune import ddp

    world, out = job
    plans = [out[r]["plan:balance"] for r in range(world)]
    assert all("error" not in p for p in plans), plans
    first = plans[0]["plan"]
    for p in plans[1:]:
        assert p["plan"]["batch_sizes"] == first["batch_sizes"]
        assert p["plan"]["probes"] == first["probes"]
    assert sum(first["batch_sizes"]) == 96
    offline = ddp.plan(w._plan_stack, w._plan_sample, optimizer=w._adamw, simulate=SPEC[world],
                       headroom=0, global_batch=96, strategy="fsdp", objective="balance")
    assert first["batch_sizes"] == offline.batch_sizes
    # in the job each rank simulates its own shards; offline every rank is simulated as rank 0,
    # whose shards are the largest (torch.chunk gives the first ranks the rounded-up rows):
    # the same probes, each peak at most the offline one
    ours = {(p["rank"], p["batch_size"]): p["peak_bytes"] for p in first["probes"]}
    theirs = {(p.rank, p.batch_size): p.peak_bytes for p in offline.probes}
    assert ours.keys() == theirs.keys()
    assert all(ours[k] <= theirs[k] for k in ours)
    assert ours[(0, offline.batch_sizes[0])] == theirs[(0, offline.batch_sizes[0])]


def test_a_rank_that_cannot_fit_raises_on_every_rank(job):
    world, out = job
    for r in range(world):
        got = out[r]["plan:infeasible"]
        assert got.get("error") == "NoFeasibleSplitError", got
        assert "rank 1 (" in got["message"] and "rank 0 (" not in got["message"]
        assert got["seconds"] < 60
        err = out[r]["user_error"]
        assert err.get("error") == "UserCodeError", err
        assert "broken sharding on this rank" in err["message"] and err["seconds"] < 60
        if r != 1:
            assert err["message"].startswith("rank 1 failed")


def test_on_each_ranks_own_card_the_plan_probes_an_fsdp_rank_of_the_job(job):
    """Inside the job without ``simulate``, each rank probes its own card (a CPU with a memory
    model: its shards' bytes plus 1 MiB per sample): the model the probe ran is sharded for the
    job's world size (the ranks' shards add up to the whole model), the user's model is left
    unsharded and unchanged, every rank returns the same plan, and each rank's certified
    largest batch is what its card holds beside its shards."""
    world, out = job
    got = [out[r]["card_plan"] for r in range(world)]
    assert all("error" not in g for g in got), got
    assert {g["param_type"] for g in got} == {"DTensor"}
    assert all(g["model_type"] == "Stack" and g["unchanged"] for g in got)
    shards = [g["shard_bytes"] for g in got]
    assert sum(shards) == STACK_BYTES and max(shards) < STACK_BYTES // world + 4 * 64 * 4
    plan = got[0]["plan"]
    assert all(g["plan"]["batch_sizes"] == plan["batch_sizes"] for g in got)
    assert plan["batch_sizes"] == [(CARDS[world][r] - shards[r]) // MiB for r in range(world)]
    assert plan["certified"] and plan["backend"] == "cuda"
    assert any("FSDP2 rank" in n for n in plan["notes"])


def test_on_real_cards_a_rank_whose_card_cannot_fit_raises_on_every_rank(job):
    world, out = job
    for r in range(world):
        got = out[r]["card_plan:infeasible"]
        assert got.get("error") == "NoFeasibleSplitError", got
        assert "rank 1 (" in got["message"] and "rank 0 (" not in got["message"]
        assert got["seconds"] < 60
