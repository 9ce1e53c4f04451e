"""The DDP plan made offline on the simulated cluster, the plan object and its files, the
uneven sampler, and the solver's every-card rule (no rank may sit out a step)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn as nn

from dptune import ddp
from dptune.backends.simulated import parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDPRank, card_of
from dptune.ddp.sampler import last_steps, tail_split
from dptune.errors import NoFeasibleSplitError, UsageError
from dptune.result.model import Fit
from dptune.solve.memory import solve_balance
from oracles import solve_max_batch
from dptune.step.workload import Workload


# ---- the solver's every-card rule -----------------------------------------------------------

def test_every_card_never_leaves_a_rank_out():
    # card 2 has a large fixed cost: the DataParallel rule would leave it idle
    fits = [Fit(100.0, 10.0), Fit(100.0, 10.0), Fit(900.0, 10.0)]
    budgets = [1000, 1000, 1000]
    assert solve_balance(fits, budgets, 40)[2] == 0
    split = solve_balance(fits, budgets, 40, every_card=True)
    assert min(split) >= 1 and sum(split) == 40
    # brute force: the smallest largest share with every card >= 1
    def worst(s):
        return max((f.intercept_bytes + f.slope_bytes * c) / b for f, c, b in zip(fits, s, budgets))
    best = min(worst(s) for s in itertools.product(range(1, 40), repeat=3) if sum(s) == 40)
    assert worst(split) == pytest.approx(best)


def test_every_card_max_batch_is_the_sum_of_the_caps():
    fits = [Fit(100.0, 10.0), Fit(300.0, 7.0), Fit(50.0, 20.0)]
    budgets = [1000, 1000, 500]
    best, split = solve_max_batch(fits, budgets, every_card=True)
    caps = [int((b - f.intercept_bytes) // f.slope_bytes) for f, b in zip(fits, budgets)]
    assert best == sum(caps) and split == caps
    with pytest.raises(NoFeasibleSplitError):
        solve_max_batch([Fit(100.0, 10.0), Fit(995.0, 10.0)], [1000, 1000], every_card=True)
    with pytest.raises(NoFeasibleSplitError, match="at least 2"):
        solve_balance(fits, budgets, 5, min_chunk_nonzero=2, every_card=True)


# ---- plans on the simulated cluster ----------------------------------------------------------

def net() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 16))


def batch(b: int) -> torch.Tensor:
    return torch.randn(b, 256)


def adamw(p):
    return torch.optim.AdamW(p)


SPEC = "2x32GB,2x24GB,used=3:10GB"


def is_exact_cap(spec: str, rank: int, headroom: int, cap: int) -> bool:
    """Whether ``cap`` is the largest batch rank ``rank`` fits on the simulator: its step fits
    at ``cap`` and not at ``cap + 1`` (the peak grows with the batch, as a bisection for the
    largest batch would take it to)."""
    cluster = parse_cluster(spec)
    budget = cluster.devices[rank].budget_bytes(headroom)
    sim = SimulatedDDPRank(Workload(net, batch, None, adamw), card_of(cluster, rank))
    try:
        return (cap >= 1 and sim.estimate([cap]).peak_bytes[0] <= budget
                and sim.estimate([cap + 1]).peak_bytes[0] > budget)
    finally:
        sim.close()


def test_max_batch_is_certified_and_exact():
    plan = ddp.plan(net, batch, optimizer=adamw, objective="max_batch", simulate=SPEC,
                    budget_level="allocated")     # is_exact_cap's peaks are allocated peaks
    caps = plan.batch_sizes
    assert all(is_exact_cap(SPEC, r, 1 << 30, caps[r]) for r in range(4)), caps
    assert plan.certified
    assert plan.even_batch_size == 4 * min(caps) < plan.global_batch
    for r in plan.ranks:
        assert r.measured_peak_bytes <= r.budget_bytes
        assert r.max_batch_size == r.batch_size
    assert plan.loss_scales == pytest.approx([4 * b / plan.global_batch for b in caps])
    # every probe is a per-rank step; ranks on one card type share results
    assert {p.rank for p in plan.probes} == {0, 1, 2, 3}


def test_balance_splits_the_global_batch_by_budget():
    # the allocated level: its peaks grow smoothly with the batch (reserved ones in segments)
    plan = ddp.plan(net, batch, optimizer=adamw, global_batch=4000, simulate=SPEC,
                    objective="balance", budget_level="allocated")
    assert plan.global_batch == 4000 and min(plan.batch_sizes) >= 1
    shares = [r.measured_peak_bytes / r.budget_bytes for r in plan.ranks]
    assert max(shares) - min(shares) < 0.01
    assert plan.batch_sizes[0] == plan.batch_sizes[1] > plan.batch_sizes[2] > plan.batch_sizes[3]
    # limited max_batch: the largest that fits is more than asked, so the asked batch is balanced
    capped = ddp.plan(net, batch, optimizer=adamw, objective="max_batch", global_batch=4000,
                      simulate=SPEC, budget_level="allocated")
    assert capped.batch_sizes == plan.batch_sizes


def test_a_rank_that_cannot_fit_is_named():
    with pytest.raises(NoFeasibleSplitError, match=r"rank 1 \(24GB") as info:
        ddp.plan(net, batch, optimizer=adamw, global_batch=64, simulate="24GB,24GB,used=1:23.5GB")
    assert info.value.shortfall_bytes > 0


def test_bad_arguments_are_usage_errors():
    with pytest.raises(UsageError, match="global_batch"):
        ddp.plan(net, batch, simulate=SPEC)
    with pytest.raises(UsageError, match="objective"):
        ddp.plan(net, batch, global_batch=8, objective="fastest", simulate=SPEC)
    with pytest.raises(UsageError, match="not inside a torch.distributed job"):
        ddp.plan(net, batch, global_batch=8)
    with pytest.raises(UsageError, match="too small for 4 ranks"):
        ddp.plan(net, batch, global_batch=3, simulate=SPEC)
    with pytest.raises(UsageError, match=r"unexpected keyword\(s\) warp_speed"):
        ddp.plan(net, batch, global_batch=8, simulate=SPEC, warp_speed=9)


def test_batchnorm_gives_every_rank_two_samples():
    def bn() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))

    plan = ddp.plan(bn, lambda b: torch.randn(b, 8), global_batch=8, simulate="4x24GB", headroom=0)
    assert plan.batch_sizes == [2, 2, 2, 2] and plan.min_batch == 2
    assert any("BatchNorm" in n for n in plan.notes)
    assert min(p.batch_size for p in plan.probes) == 2


# ---- the plan object ------------------------------------------------------------------------

def test_from_batch_sizes_and_loss_scales():
    plan = ddp.DDPPlan.from_batch_sizes([6, 2])
    assert plan.global_batch == 8 and plan.world_size == 2
    assert plan.loss_scales == [1.5, 0.5]
    loss = torch.tensor(2.0)
    assert plan.scale_loss(loss, rank=1).item() == 1.0
    with pytest.raises(UsageError, match="not initialised"):
        plan.scale_loss(loss)
    with pytest.raises(UsageError, match="not in 0..1"):
        plan.loss_scale(2)
    with pytest.raises(UsageError, match="one int >= 1 per rank"):
        ddp.DDPPlan.from_batch_sizes([4, 0])


@pytest.mark.slow
def test_save_load_and_show(tmp_path, capsys):
    from dptune.cli import main

    plan = ddp.plan(net, batch, optimizer=adamw, global_batch=512, simulate="32GB,24GB")
    folder = tmp_path / "plan"
    path = plan.save(str(folder))
    assert path.endswith("plan.json") and (folder / "summary.md").read_text().startswith("DDP plan")
    page = (folder / "report.html").read_text()
    assert "<h1>dptune DDP plan:" in page and str(plan.batch_sizes) in page
    from dptune.cli.checks import check_plan_out

    check_plan_out(str(folder))        # a plan's folder, report.html included: written again
    again = ddp.DDPPlan.load(str(folder))
    assert again == plan
    assert ddp.DDPPlan.load(plan.save(str(tmp_path / "p.json"))) == plan
    assert main(["show", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "global batch 512" in out and str(plan.batch_sizes) in out
    assert main(["show", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["batch_sizes"] == plan.batch_sizes


@pytest.mark.parametrize("content, match", [
    ("{", "not valid JSON"), ("[1, 2]", "not a dptune DDP plan"),
    ('{"kind": "dptune-ddp-plan", "version": 1, "ranks": [{"rank": 0}]}', "malformed"),
    ('{"kind": "dptune-ddp-plan", "version": 7, "ranks": []}', "version 7"),
])
def test_bad_plan_files_are_usage_errors(tmp_path, content, match):
    p = tmp_path / "plan.json"
    p.write_text(content)
    with pytest.raises(UsageError, match=match):
        ddp.DDPPlan.load(str(p))


# ---- the sampler ----------------------------------------------------------------------------

@pytest.mark.parametrize("sizes, n", [([3, 1], 16), ([5, 3], 19), ([4, 1, 7], 23), ([4, 1, 7], 14),
                                      ([2, 2, 2], 7), ([10, 1], 0), ([3, 1], 2), ([1, 2, 2], 11)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_partitions_each_epoch(sizes, n, drop_last):
    plan = ddp.DDPPlan.from_batch_sizes(sizes)
    B = plan.global_batch
    samplers = [ddp.UnevenBatchSampler(n, plan, rank=r, seed=5, drop_last=drop_last)
                for r in range(len(sizes))]
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        batches = [list(s) for s in samplers]
        assert len({len(b) for b in batches}) == 1 == len({len(s) for s in samplers})
        seen = [i for b in batches for step in b for i in step]
        assert len(seen) == len(set(seen))
        assert len(seen) == (n // B * B if drop_last else n)
        for step in range(len(batches[0])):
            sizes_now = samplers[0].sizes_at(step)
            assert [len(b[step]) for b in batches] == sizes_now
            assert all(1 <= a <= b for a, b in zip(sizes_now, sizes))   # never empty, never over


@pytest.mark.parametrize("least", [1, 2])
def test_last_steps_lend_to_empty_ranks(least):
    # brute force over small plans and tails: every rank gets >= least in both steps, no
    # rank more than planned, the samples add up, and it refuses exactly when no split of
    # the last two steps' samples can give every rank >= least in each
    for sizes in itertools.product(range(least, 5), repeat=3):
        B, W = sum(sizes), len(sizes)
        for t in range(1, B):
            got = last_steps(sizes, t, least)
            possible = any(all(least <= x <= b for x, b in zip(tail, sizes)) and
                           B + t - sum(tail) >= least * W
                           for tail in itertools.product(*(range(b + 1) for b in sizes))
                           if sum(tail) <= t + B - least * W and sum(tail) >= min(t, least * W)
                           and sum(tail) in (t, least * W))
            assert (got is not None) == possible, (sizes, t)
            if got is None:
                continue
            before, tail = got
            assert sum(before) + sum(tail) == B + t
            assert all(least <= a <= b for a, b in zip(before, sizes))
            assert all(least <= a <= b for a, b in zip(tail, sizes))
            if t >= least * W:
                assert list(before) == list(sizes)


def test_a_batchnorm_plan_never_gives_a_rank_one_sample():
    plan = ddp.DDPPlan.from_batch_sizes([4, 2, 7], min_batch=2)
    for n in (13 + 1, 13 * 2 + 3, 13 * 2 + 5, 13 * 3 + 7):
        samplers = [ddp.UnevenBatchSampler(n, plan, rank=r, seed=2) for r in range(3)]
        batches = [list(s) for s in samplers]
        seen = sorted(i for b in batches for step in b for i in step)
        assert seen == list(range(n))
        assert all(len(step) >= 2 for b in batches for step in b), (n, [[len(x) for x in b] for b in batches])
    assert ddp.UnevenBatchSampler(14, plan, rank=0).sizes_at(1) == [2, 2, 2]
    with pytest.raises(UsageError, match="each of the 3 ranks 2 \\(BatchNorm\\)"):
        ddp.UnevenBatchSampler(5, plan, rank=0)
    assert ddp.UnevenBatchSampler(5, plan, rank=0, min_batch=1).sizes_at(0) == [1, 1, 3]
    with pytest.raises(UsageError, match="min_batch must be an int from 1 to the smallest batch"):
        ddp.DDPPlan.from_batch_sizes([4, 1], min_batch=2)
    assert ddp.DDPPlan.from_dict(plan.to_dict()).min_batch == 2


def test_sampler_refuses_what_cannot_give_every_rank_a_sample():
    with pytest.raises(UsageError, match="each of the 3 ranks one on every step"):
        ddp.UnevenBatchSampler(2, [4, 1, 7], rank=0)
    with pytest.raises(UsageError, match="pass drop_last=True"):
        ddp.UnevenBatchSampler(4, [1, 1, 1], rank=0)      # nothing to lend: every batch is 1
    assert len(ddp.UnevenBatchSampler(4, [1, 1, 1], rank=0, drop_last=True)) == 1


def test_scale_loss_follows_the_step_sizes():
    plan = ddp.DDPPlan.from_batch_sizes([40, 30, 20])
    loss = torch.tensor(2.0)
    # the tail [5, 3, 2]: rank 0's scale is 3*5/10, not the planned 3*40/90
    assert plan.scale_loss(loss, rank=0, sizes=[5, 3, 2]).item() == pytest.approx(2.0 * 1.5)
    assert plan.scale_loss(loss, rank=2, sizes=[5, 3, 2], batch_size=2).item() == pytest.approx(1.2)
    with pytest.raises(UsageError, match="sizes gives this rank 3"):
        plan.scale_loss(loss, rank=1, sizes=[5, 3, 2], batch_size=4)
    with pytest.raises(UsageError, match="3 ranks"):
        plan.scale_loss(loss, rank=1, sizes=[5, 3])
    with pytest.raises(UsageError, match="not initialised"):
        plan.scale_loss(loss, rank=0, batch_size=5)       # the sum needs the other ranks


def test_tail_split_rules():
    assert tail_split([100, 1], 50) == [49, 1]        # a rank rounded to 0 takes one sample
    assert tail_split([4, 1, 7], 2) == [1, 0, 1]      # fewer samples than ranks: the last gets none
    assert tail_split([4, 1, 7], 11) == [4, 1, 6]
    assert sum(tail_split([3, 3, 3], 4)) == 4


def test_sampler_order_follows_the_permutation():
    plan = ddp.DDPPlan.from_batch_sizes([2, 1])
    s0 = ddp.UnevenBatchSampler(range(6), plan, rank=0, shuffle=False)
    s1 = ddp.UnevenBatchSampler(range(6), plan, rank=1, shuffle=False)
    assert list(s0) == [[0, 1], [3, 4]] and list(s1) == [[2], [5]]
    g = torch.Generator().manual_seed(11)
    perm = torch.randperm(6, generator=g).tolist()
    s = ddp.UnevenBatchSampler(6, [2, 1], rank=1, seed=11)
    assert list(s) == [[perm[2]], [perm[5]]]
    with pytest.raises(UsageError, match="length"):
        ddp.UnevenBatchSampler(iter(range(3)), plan, rank=0)


# ---- the command line -----------------------------------------------------------------------

def test_cli_plan_writes_and_prints_the_plan(tmp_path, capsys):
    from dptune.cli import main

    out = tmp_path / "p.json"
    code = main(["plan", "--model", "dptune.examples.models:MLP", "--simulate", "32GB,24GB",
                 "--batch-size", "96", "--objective", "balance", "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert sum(printed["batch_sizes"]) == 96 and printed["world_size"] == 2
    assert printed["batch_sizes"][0] > printed["batch_sizes"][1]
    assert ddp.DDPPlan.load(str(out)).batch_sizes == printed["batch_sizes"]


@pytest.mark.parametrize("argv, code, message", [
    (["--simulate", "2x24GB"], 2, "give --batch-size N"),
    (["--simulate", "2x24XB", "--batch-size", "8"], 2, "unknown card"),
    (["--simulate", "24GB,24GB,used=1:23.5GB", "--batch-size", "64", "--headroom", "0"], 3,
     "rank 1 (24GB"),
])
def test_cli_plan_errors(argv, code, message, capsys):
    from dptune.cli import main

    assert main(["plan", "--model", "dptune.examples.models:TinyGPT", *argv]) == code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_step_options_reach_the_rank_step_and_the_plan(tmp_path, capsys):
    from dptune.backends.simulated.ddp import estimate_ddp_memory
    from dptune.cli import main

    plain = estimate_ddp_memory(net, batch, [64], "24GB", optimizer=adamw).peak_bytes[0]
    bf16 = estimate_ddp_memory(net, batch, [64], "24GB", optimizer=adamw, amp="bf16").peak_bytes[0]
    assert bf16 != plain
    plan = ddp.plan(net, batch, optimizer=adamw, global_batch=256, simulate="32GB,24GB",
                    amp="bf16", accumulate=2)
    assert plan.settings is not None
    assert plan.settings["amp"] == "bf16" and plan.settings["accumulate"] == 2
    assert "bf16" in plan.summary()
    assert main(["plan", "--model", "dptune.examples.models:MLP", "--simulate", "32GB,24GB",
                 "--batch-size", "64", "--amp", "bf16", "--accumulate", "2",
                 "--out", str(tmp_path / "p.json"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["accumulate"] == 2


def test_a_sampler_made_before_the_group_is_checked_when_iterated():
    import socket

    import torch.distributed as dist

    sampler = ddp.UnevenBatchSampler(10, [3, 2], rank=0)     # no group yet: not checked
    plan = ddp.DDPPlan.from_batch_sizes([3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(UsageError, match="the plan has 2 ranks but this torch.distributed job has 1"):
            list(sampler)
        # one rank: the step's scale is 1 whatever its size
        assert plan.scale_loss(torch.tensor(2.0), batch_size=2).item() == 2.0
    finally:
        dist.destroy_process_group()
