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

from dptune import Budget, SearchSettings, Tuner, Workload, ddp
from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.budget import BudgetLevel
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
    plan = Settings.for_plan(global_batch=8, objective=None, budget=Budget.at(level="allocated"),
                             max_rounds=16, simulate="2x24GB", strategy=Strategy.FSDP,
                             ddp=DDPOptions(), fsdp=None, device=None)
    assert plan.objective is None and plan.strategy is Strategy.FSDP and plan.fsdp
    assert plan.budget.headroom_bytes == 1 << 30     # the allocated level's default


def test_entry_points_take_objects_and_the_keywords_build_the_same():
    """Issue 34: budget= and search= objects, or their keywords, give the same settings; the
    keywords beside their object, and unknown keywords, are one usage error each."""
    by_words = Tuner(model(), sample, 8, simulate="2x24GB", headroom="512MiB",
                     budget_level="allocated", max_probes=7, tolerance=0.05, verbose=False)
    by_objects = Tuner(model(), sample, 8, simulate="2x24GB",
                       budget=Budget.at(level="allocated", headroom="512MiB"),
                       search=SearchSettings(max_probes=7, tolerance=0.05, verbose=False))
    assert by_words.settings == by_objects.settings
    assert by_objects.settings.budget.headroom_bytes == 512 << 20
    assert (by_objects.settings.max_probes, by_objects.settings.tolerance) == (7, 0.05)
    assert "give the budget once" in _message(lambda: Tuner(
        model(), sample, 8, simulate="2x24GB", budget=Budget.at(), headroom="1GiB"))
    assert "give the search settings once" in _message(lambda: Tuner(
        model(), sample, 8, simulate="2x24GB", search=SearchSettings(), max_probes=5))
    assert "unexpected keyword(s) max_probe;" in _message(lambda: Tuner(
        model(), sample, 8, simulate="2x24GB", max_probe=5))
    assert "max_probes must be an int >= 3" in _message(lambda: SearchSettings(max_probes=2))
    # the whole step as one Workload, and nothing of the step beside it
    wl = Workload(model=model(), sample=sample, amp="bf16", accumulate=2)
    tuner = Tuner(wl, batch_size=8, simulate="2x24GB", verbose=False)
    assert tuner.workload is wl and tuner.workload.settings.accumulate == 2
    assert "drop sample, amp" in _message(lambda: Tuner(wl, sample, 8, amp="fp16"))
    # the DDP planner: the strategy as its options object, or as words and keywords
    assert "are FSDP's: pass strategy='fsdp'" in _message(lambda: ddp.plan(
        model(), sample, global_batch=8, simulate="2x24GB", mp_policy=None, shard=print))
    assert "strategy= is given as options already: drop bucket_cap_mb" in _message(lambda: ddp.plan(
        model(), sample, global_batch=8, simulate="2x24GB", strategy=DDPOptions(), bucket_cap_mb=5))


def test_no_entry_point_takes_more_than_twelve_parameters():
    import inspect

    from dptune.lengths import plan_lengths

    for fn in (Tuner.__init__, ddp.plan, plan_lengths):
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
        assert len(params) <= 12, (fn.__qualname__, len(params))


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
