"""A Trainer's collator that pads example by example with tensor operations is the slow path
under the simulator (every operation simulated one by one: a length plan had not finished
after 10 minutes, 28 s with lists padded first). The length plan's batch builder counts the
torch calls the collator makes and says so once, in one line, with what to do; a collator
that builds each tensor once per batch is left alone. The batch itself is unchanged."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from dptune.errors import DptuneWarning
from dptune.integrations.trainer_lengths import TrainerLengthSample, _resized, per_example_ops
from dptune.integrations.trainer_workload import TrainerSample

DATA = [{"input_ids": list(range(1, 5 + k % 7))} for k in range(50)]


def pad_each(features):
    """Example by example: a tensor, a pad and a stack per example."""
    longest = max(len(f["input_ids"]) for f in features)
    rows = [F.pad(torch.tensor(f["input_ids"]), (0, longest - len(f["input_ids"])))
            for f in features]
    return {"input_ids": torch.stack(rows)}


def pad_lists(features):
    """Lists padded first, one tensor per batch."""
    longest = max(len(f["input_ids"]) for f in features)
    return {"input_ids": torch.tensor([f["input_ids"] + [0] * (longest - len(f["input_ids"]))
                                       for f in features])}


def sample_with(collator) -> TrainerLengthSample:
    s = TrainerLengthSample.__new__(TrainerLengthSample)
    s.inner, s.key, s.warned = TrainerSample(DATA, collator), "input_ids", False
    return s


def test_a_collator_padding_example_by_example_is_named_once():
    s = sample_with(pad_each)
    with pytest.warns(DptuneWarning) as seen:
        batch = s(64, 32)
    msgs = [str(w.message) for w in seen if issubclass(w.category, DptuneWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0]
    assert "for a batch of 64 examples" in msgs[0] and "pad lists" in msgs[0]
    direct = pad_each([_resized(ex, "input_ids", 32) for ex in s.inner._examples(64)])
    assert torch.equal(batch["input_ids"], direct["input_ids"])     # the batch is the same
    with warnings.catch_warnings():
        warnings.simplefilter("error", DptuneWarning)
        s(64, 16)                    # said once


def test_a_collator_building_each_tensor_once_is_left_alone():
    s = sample_with(pad_lists)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DptuneWarning)
        batch = s(256, 32)
    assert batch["input_ids"].shape == (256, 32)


def test_the_rule_grows_with_the_examples():
    assert not per_example_ops(70, 8)          # a handful of examples: nothing to gain
    assert not per_example_ops(60, 1000)       # a few tensors per batch
    assert per_example_ops(1064, 1000) and per_example_ops(3 * 64, 64)
