"""One frozen settings object for the tuner and the DDP planner (issue 21): the shared checks
give the same message from both, the object cannot be changed, the objective is the enum's,
and the planner's modules stay small and below the planner (the DDP search on search/)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from dptune import Tuner, ddp
from dptune.backends.simulated.reserved import BudgetLevel
from dptune.errors import UsageError
from dptune.settings import Settings
from dptune.types import Objective, Strategy
from tests.test_layers import imports

ROOT = Path(__file__).resolve().parents[1]


def model() -> nn.Module:
    return nn.Linear(4, 4)


def sample(b: int) -> torch.Tensor:
    return torch.randn(b, 4)


def _message(fn) -> str:
    with pytest.raises(UsageError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("options", [
    {"headroom": "lots"}, {"objective": "fastest"}, {"budget_level": "free"},
    {"budget_level": "reserved", "allocator": "no_such_option:1"},
])
def test_shared_checks_say_the_same_for_the_tuner_and_the_plan(options):
    tuner = _message(lambda: Tuner(model(), sample, 8, simulate="2x24GB", verbose=False, **options))
    plan = _message(lambda: ddp.plan(model(), sample, global_batch=8, simulate="2x24GB", **options))
    assert tuner == plan


def test_the_limits_are_checked_once_under_their_own_names():
    assert "max_probes must be an int >= 3, got 2" in _message(
        lambda: Tuner(model(), sample, 8, simulate="2x24GB", max_probes=2))
    assert "max_rounds must be an int >= 3, got 2" in _message(
        lambda: ddp.plan(model(), sample, global_batch=8, simulate="2x24GB", max_rounds=2))
    assert "global_batch must be an int >= 1, got True" in _message(
        lambda: ddp.plan(model(), sample, global_batch=True, simulate="2x24GB"))
    assert "batch_size must be an int >= 1, got 0" in _message(
        lambda: Tuner(model(), sample, 0, simulate="2x24GB"))


def test_the_settings_are_frozen_and_typed():
    tuner = Tuner(model(), sample, 8, simulate="2x24GB", objective="max-batch", headroom="0",
                  budget_level="reserved", verbose=False)
    s = tuner.settings
    assert isinstance(s, Settings)
    assert s.objective is Objective.MAX_BATCH and tuner.objective is Objective.MAX_BATCH
    assert s.budget.level is BudgetLevel.RESERVED and s.budget.headroom_bytes == 0
    assert s.budget.reserved is not None and s.max_probes == 12
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.max_probes = 99  # type: ignore[misc]
    plan = Settings.for_plan(global_batch=8, objective=None, headroom=None,
                             budget_level="allocated", allocator=None, nccl_bytes=None,
                             max_rounds=16, simulate="2x24GB", bucket_cap_mb=None,
                             gradient_as_bucket_view=False, strategy="fsdp", shard=None,
                             reshard_after_forward=True, mp_policy=None, device=None)
    assert plan.objective is None and plan.strategy is Strategy.FSDP and plan.fsdp
    assert plan.budget.headroom_bytes == 1 << 30     # the allocated level's default


def test_every_objective_goes_through_the_enum():
    assert ddp.OBJECTIVES == tuple(o.value for o in Objective)
    for spelling in ("max-batch", "max_batch", Objective.MAX_BATCH):
        assert Objective.parse(spelling) is Objective.MAX_BATCH
    # the planner's modules spell no objective by hand
    for path in ("dptune/ddp/planner.py", "dptune/search/ranks.py", "dptune/settings.py",
                 "dptune/tuner.py"):
        tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
        compared = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)
                    and any(isinstance(c, ast.Constant) and c.value in ("balance", "max_batch",
                                                                        "max-batch", "throughput")
                            for c in [n.left, *n.comparators])]
        assert compared == [], path


def test_the_ddp_search_is_on_search_and_below_the_planner():
    # the bracket search for independent ranks lives on search/, built on its Bracket
    found = imports("dptune.search.ranks")
    assert "dptune.search.observations" in found
    assert not [m for m in found if m.startswith(("dptune.ddp", "dptune.tuner", "dptune.cli"))]
    assert "dptune.search.ranks" in imports("dptune.ddp.planner")
    for module in ("dptune.settings",):
        assert not [m for m in imports(module)
                    if m.startswith(("dptune.ddp", "dptune.tuner", "dptune.cli", "dptune.search"))]
    planner = (ROOT / "dptune/ddp/planner.py").read_text(encoding="utf-8")
    assert "class _State" not in planner and "def _max_batch" not in planner
