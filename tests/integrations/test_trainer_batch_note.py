"""tune_trainer's note on the batch says what the batch is: with max_batch only where the
search starts (the result's batch is the largest that fits)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from dptune.integrations.transformers import _cards_and_batch  # noqa: E402


@pytest.mark.parametrize("objective", ["max_batch", "max-batch"])
def test_max_batch_notes_the_start(objective):
    trainer = SimpleNamespace(args=SimpleNamespace(per_device_train_batch_size=24))
    _, batch, notes = _cards_and_batch(trainer, {}, None, "2x24GB", None, objective)
    assert batch == 48
    assert notes == ["batch: the search started at 48 samples per forward pass "
                     "(per_device_train_batch_size 24 x 2 cards)"]


def test_balance_notes_the_batch():
    trainer = SimpleNamespace(args=SimpleNamespace(per_device_train_batch_size=24))
    _, batch, notes = _cards_and_batch(trainer, {}, None, "2x24GB", None, "balance")
    assert notes == ["batch: 48 samples per forward pass (per_device_train_batch_size 24 x 2 cards)"]
