"""A DDP plan for a global batch trained with gradient accumulation: ``plan(micro_batches=...)``,
``DDPPlan.micro_batches``, ``scale_loss`` over the micro-batches and ``dptune plan
--global-batch``. (The choice of the number of micro-batches against a brute force over
every divisor and split is checked inside real jobs, ``test_ddp_time_dist.py``.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from dptune import ddp
from dptune.ddp import DDPPlan
from dptune.errors import UsageError
from dptune.step.presets import adamw


def wide() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10))


def vectors(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


SPEC = "24GB,24GB,used=1:23.5GB"       # rank 1 has 0.5 GB: about 2,400 samples of `wide`


def test_accumulated_scaled_losses_give_the_mean_gradient_over_the_global_batch():
    """Two ranks, three micro-batches of [3, 5]: DDP averages the ranks' gradients at every
    micro-batch (1/W), the micro-batches' gradients add up; with scale_loss the sum is the
    single-process gradient of the mean over all 24 samples (a hand accounting of DDP)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(24, 4), torch.randn(24, 2)
    plan = DDPPlan.from_batch_sizes([3, 5], micro_batches=3)
    acc = [torch.zeros_like(p) for p in model.parameters()]
    start = 0
    for _ in range(3):
        per_rank = []
        for r, b in enumerate(plan.batch_sizes):
            xb, yb = x[start:start + b], y[start:start + b]
            start += b
            model.zero_grad()
            plan.scale_loss(nn.functional.mse_loss(model(xb), yb), rank=r, sizes=[3, 5]).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])
        for i in range(len(acc)):                       # DDP's all-reduce: the ranks' mean
            acc[i] += sum(g[i] for g in per_rank) / plan.world_size
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    for a, p in zip(acc, model.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-6)
    # without accumulation the same three steps add up to three times the mean
    one = DDPPlan.from_batch_sizes([3, 5])
    loss = torch.tensor(2.0)
    assert plan.scale_loss(loss, rank=1).item() == pytest.approx(one.scale_loss(loss, rank=1).item() / 3)


def test_a_fixed_number_of_micro_batches_splits_one_of_them():
    fixed = ddp.plan(wide(), vectors, optimizer=adamw, global_batch=9000, micro_batches=3,
                     simulate=SPEC, headroom=0, budget_level="allocated")
    one = ddp.plan(wide(), vectors, optimizer=adamw, global_batch=3000, simulate=SPEC, headroom=0,
                   budget_level="allocated")
    assert fixed.micro_batches == 3 and fixed.batch_sizes == one.batch_sizes
    assert fixed.requested_global_batch == 9000 and fixed.global_batch == 3000
    assert any("3 micro-batches of 3000" in n for n in fixed.notes)
    assert "3 micro-batches per optimizer step: 9000 samples" in fixed.summary()
    again = DDPPlan.from_dict(json.loads(json.dumps(fixed.to_dict())))
    assert again == fixed and again.micro_batches == 3


def test_auto_accumulates_only_what_one_step_cannot_hold():
    # 3000 fits one step (rank 1 holds about 2,400): no accumulation; 9000 does not
    one = ddp.plan(wide(), vectors, optimizer=adamw, global_batch=3000, micro_batches="auto",
                   simulate=SPEC, headroom=0, budget_level="allocated")
    assert one.micro_batches == 1 and sum(one.batch_sizes) == 3000
    many = ddp.plan(wide(), vectors, optimizer=adamw, global_batch=9000, micro_batches="auto",
                    simulate=SPEC, headroom=0, budget_level="allocated")
    k = many.micro_batches
    assert k > 1 and 9000 % k == 0 and k * many.global_batch == 9000
    assert all(r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
               for r in many.ranks)


@pytest.mark.parametrize("kw, words", [
    (dict(global_batch=90, micro_batches=4), "give a global_batch it divides"),
    (dict(objective="max_batch", micro_batches=2), "give a global_batch it divides"),
    (dict(global_batch=90, micro_batches=0), "micro_batches must be an int >= 1 or 'auto'"),
    (dict(global_batch=90, micro_batches=True), "micro_batches must be an int >= 1 or 'auto'"),
    (dict(global_batch=90, micro_batches="many"), "micro_batches must be an int >= 1 or 'auto'"),
    (dict(global_batch=90, micro_batches="auto", objective="balance"), "objective 'throughput'"),
])
def test_micro_batches_are_checked(kw, words):
    with pytest.raises(UsageError, match=words):
        ddp.plan(wide, vectors, optimizer=adamw, simulate=SPEC, **kw)


@pytest.mark.slow
def test_cli_global_batch_plans_the_micro_batches(tmp_path, capsys):
    from dptune.cli import main

    # 20,000 samples do not fit in one step beside the 2 GB used on card 1 (12,000 do); the
    # solver's time grows with the global batch, so it is kept small (600,000 took 20 s)
    code = main(["plan", "--model", "dptune.examples.models:MLP", "--simulate",
                 "4GB,4GB,used=1:2GB", "--global-batch", "20000", "--headroom", "0",
                 "--budget-level", "allocated", "--out", str(tmp_path / "p.json"), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["micro_batches"] > 1
    assert printed["micro_batches"] * printed["global_batch"] == 20000
    assert printed["requested_global_batch"] == 20000
    for extra in (["--batch-size", "60"], ["--objective", "balance"]):
        assert main(["plan", "--model", "dptune.examples.models:MLP", "--global-batch", "60",
                     "--out", str(tmp_path / "q.json")] + extra) == 2
        assert "--global-batch plans the fastest micro-batches" in capsys.readouterr().err
