"""The types at the bottom (dptune.types), the declared backend capabilities, and the backend
decided once per run."""

from __future__ import annotations

import json

import pytest

from dptune import types
from dptune.backends import base
from dptune.errors import UsageError
from dptune.types import (BackendKind, Category, Objective, ProbeResult, budget_share, card_in_use,
                          within_budget)


# ---- enums --------------------------------------------------------------------------------

@pytest.mark.parametrize("given, want", [("balance", Objective.BALANCE),
                                         ("max_batch", Objective.MAX_BATCH),
                                         ("max-batch", Objective.MAX_BATCH),
                                         (Objective.MAX_BATCH, Objective.MAX_BATCH),
                                         ("throughput", Objective.THROUGHPUT)])
def test_objective_spellings(given, want):
    assert Objective.parse(given) is want


@pytest.mark.parametrize("bad", ["Balance", "max batch", "maxbatch", "", None, 1])
def test_objective_rejects_the_rest_naming_the_accepted(bad):
    with pytest.raises(UsageError, match="objective must be 'balance', 'max_batch' or 'throughput'"):
        Objective.parse(bad)


def test_enums_are_their_strings():
    """A member equals, formats and serialises as its value, so reports are unchanged."""
    assert Objective.MAX_BATCH == "max_batch" and Objective.MAX_BATCH.flag == "max-batch"
    assert f"{BackendKind.CUDA}" == "cuda" and str(BackendKind.SIMULATED) == "simulated"
    assert json.dumps({"objective": Objective.BALANCE}) == '{"objective": "balance"}'
    assert {"weights": 1}[Category.WEIGHTS] == 1
    assert types.CATEGORIES == ("weights", "gradients", "optimizer", "activations", "inputs",
                                "outputs", "other")
    assert base.CATEGORIES is types.CATEGORIES and base.Device is types.Device


# ---- per-card rules -----------------------------------------------------------------------

def test_card_in_use_by_hand():
    assert [card_in_use(i, c) for i, c in enumerate([0, 0, 3, 0, 1])] == [
        True, False, True, False, True]


def test_within_budget_counts_card_0_always_and_other_cards_only_with_samples():
    budgets = [100, 100, 100]
    # card 1 has no samples: its peak over budget (a stray allocation) does not count
    assert within_budget([100, 500, 99], budgets, [0, 0, 4])
    # card 0 counts with no samples (it holds the weights and gathers the outputs)
    assert not within_budget([101, 0, 50], budgets, [0, 3, 3])
    assert not within_budget([50, 50, 101], budgets, [1, 1, 1])
    # a probe: also refused when a card ran out of memory, whatever the peaks say
    assert ProbeResult((0, 0, 4), (100, 500, 99)).within_budget(budgets)
    assert not ProbeResult((2, 2, 4), (10, 10, 10), oom_device=1).within_budget(budgets)
    assert not ProbeResult((0, 3, 3), (101, 0, 50)).within_budget(budgets)


def test_budget_share():
    assert budget_share(3 * 2**30, 4 * 2**30) == 0.75
    assert budget_share(1, 0) == float("inf") and budget_share(0, -5) == float("inf")


# ---- capabilities -------------------------------------------------------------------------

class Minimal:
    """A backend with only the required members, as a user may write one."""

    def __init__(self, kind):
        if kind is not None:
            self.kind = kind
        self.devices = [types.Device(0, "c", 2**30)]

    def describe(self):
        return "minimal"

    def probe(self, chunk_sizes):
        return types.ProbeResult(tuple(chunk_sizes), (0,))

    def close(self):
        pass


@pytest.mark.parametrize("kind, want", [
    ("simulated", base.Capabilities(BackendKind.SIMULATED, exact_on_oom=True)),
    ("cuda", base.Capabilities(BackendKind.CUDA)),
    ("tpu", base.Capabilities("tpu")),
    (None, base.Capabilities("unknown")),
])
def test_a_minimal_backend_gets_its_kinds_defaults(kind, want):
    b = Minimal(kind)
    assert base.capabilities(b) == want
    assert base.model_facts(b) == base.ModelFacts()
    b.has_batchnorm = True
    assert base.model_facts(b) == base.ModelFacts(has_batchnorm=True)


def test_dptunes_backends_declare_what_they_can_do():
    import torch

    from dptune.backends.simulated import SimulatedBackend
    from dptune.step.workload import Workload

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    sim = SimulatedBackend(Workload(model, lambda n: torch.randn(n, 4)), "2x1GB")
    assert isinstance(sim, base.Backend)
    assert base.capabilities(sim) == base.Capabilities(BackendKind.SIMULATED, exact_on_oom=True,
                                                      output_device=True, op_observer=True)
    assert base.model_facts(sim) == base.ModelFacts(has_batchnorm=True, gradient_checkpointing=False)
    sim.close()


# ---- the backend decided once -------------------------------------------------------------

def test_choice_counts_its_cards(monkeypatch):
    import dptune.backends.choice as choice_mod
    import dptune.tuner as tuner_mod

    assert tuner_mod.choose_backend(simulate="2x24GB,1x40GB").cards == 3
    assert tuner_mod.BackendChoice(device_ids=[1, 3]).cards == 2
    monkeypatch.setattr(choice_mod, "_visible_gpus", lambda: 5)
    choice = tuner_mod.choose_backend()
    assert not choice.simulated and choice.cards == 5 and choice.kind is BackendKind.CUDA
    monkeypatch.setattr(choice_mod, "_visible_gpus", lambda: 0)
    choice = tuner_mod.choose_backend()
    assert choice.simulated and choice.cards == 4 and choice.notice is not None


def test_from_spec_decides_the_cards_once(monkeypatch):
    import dptune.tuner as tuner_mod
    from dptune.step.spec import WorkloadSpec

    calls = []
    real = tuner_mod.choose_backend

    def counting(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(tuner_mod, "choose_backend", counting)
    spec = WorkloadSpec("dptune.examples.models:MLP",
                        model_kwargs={"in_features": 8, "hidden": 8, "depth": 1},
                        input_shape=(8,), loss="sum")
    result = tuner_mod.Tuner.from_spec(spec, 4, simulate="2x4GB", verbose=False,
                                       max_probes=3).fit()
    assert len(calls) == 1 and result.cluster.startswith("2x4GB")


def test_cards_are_given_once():
    import torch

    from dptune.tuner import BackendChoice, Tuner

    with pytest.raises(UsageError, match="give the cards once"):
        Tuner(torch.nn.Linear(2, 2), lambda n: torch.randn(n, 2), 4, simulate="2x1GB",
              choice=BackendChoice(device_ids=[0]))
