"""Tuner.fit_lengths: the per-bucket plan for the step and cards a Tuner holds."""

from __future__ import annotations

import pytest
import torch

from dptune import Tuner
from dptune.errors import UsageError
from dptune.lengths import plan_lengths
from dptune.lengths.fit import length_sample_of
from tests.support.lengths_models import V, batch, gpt

SPEC = "1x403.125MB,1x404.125MB,context=384MiB"
LENGTHS = [8] * 30 + [24] * 20 + [60] * 10 + [100] * 5


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_which_samples_take_the_length():
    def two(n, length):
        return (n, length)

    def keyword(n, *, length=4):
        return (n, length)

    def star(*args):
        return args

    def one(n):
        return n

    assert length_sample_of(two)(3, 7) == (3, 7)
    assert length_sample_of(keyword)(3, 7) == (3, 7)
    assert length_sample_of(star)(3, 7) == (3, 7)
    assert length_sample_of(one) is None
    assert length_sample_of(len) is None     # one positional parameter


@pytest.mark.parametrize("tuner_kw, call_kw, fragment", [
    ({}, {}, "takes no length"),
    ({"output_device": 1}, {"sample": batch}, "drop output_device"),
])
def test_what_does_not_apply_is_one_line(tuner_kw, call_kw, fragment):
    tuner = Tuner(gpt, lambda n: torch.randint(0, V, (n, 16)), 8, simulate=SPEC, **tuner_kw)
    with pytest.raises(UsageError, match=fragment):
        tuner.fit_lengths(LENGTHS, [32, 64], **call_kw)


@pytest.mark.slow
def test_fit_lengths_plans_the_tuners_step_on_its_cards():
    """The tuner's optimizer, amp, headroom and cards reach the plan: the same buckets and
    splits as plan_lengths called with them, certified; the sample takes length= itself."""
    tuner = Tuner(gpt, batch, 64, optimizer=sgd, amp="bf16", simulate=SPEC, headroom=0,
                  verbose=False, budget_level="allocated")    # cards of ~10 MiB beyond the workspaces: no room for NCCL
    plan = tuner.fit_lengths(LENGTHS, [32, 64])
    direct = plan_lengths(gpt, batch, LENGTHS, [32, 64], optimizer=sgd, amp="bf16",
                          simulate=SPEC, headroom=0, batch_size=64, budget_level="allocated")
    assert plan.edges == [32, 64, 100] and plan.certified
    assert [b.chunk_sizes for b in plan.buckets] == [b.chunk_sizes for b in direct.buckets]
    assert plan.budget_bytes == direct.budget_bytes and plan.cluster == direct.cluster


@pytest.mark.slow     # three whole per-bucket plans at the reserved level (about a minute of CPU)
def test_fit_lengths_plans_at_the_tuners_budget_level():
    """At the reserved level (the default) the tuner's allocator model reaches the plan: the
    same splits as plan_lengths at that level, and the plan says which level it checked."""
    spec = "2x2200MB,context=384MiB"
    tuner = Tuner(gpt, batch, 64, optimizer=sgd, simulate=spec, verbose=False,
                  allocator="expandable_segments:True", nccl_bytes="200MiB")
    plan = tuner.fit_lengths(LENGTHS, [32, 64])
    direct = plan_lengths(gpt, batch, LENGTHS, [32, 64], optimizer=sgd, simulate=spec,
                          batch_size=64, allocator="expandable_segments:True", nccl_bytes="200MiB")
    allocated = plan_lengths(gpt, batch, LENGTHS, [32, 64], optimizer=sgd, simulate=spec,
                             batch_size=64, budget_level="allocated")
    assert [b.chunk_sizes for b in plan.buckets] == [b.chunk_sizes for b in direct.buckets]
    assert plan.budget_bytes == direct.budget_bytes and plan.headroom_bytes == direct.headroom_bytes
    assert any("reserved" in n for n in plan.notes)
    assert [b.chunk_sizes for b in plan.buckets] != [b.chunk_sizes for b in allocated.buckets]
