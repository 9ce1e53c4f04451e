"""The one rule for BatchNorm's smallest chunk (dptune.step.workload.smallest_chunk)."""

from __future__ import annotations

import pytest
import torch.nn as nn

from dptune.errors import UserCodeError
from dptune.step.workload import BATCHNORM_MIN_CHUNK, min_chunk, smallest_chunk


def test_plain_batchnorm_needs_two_samples_on_a_card_and_on_a_rank():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    assert BATCHNORM_MIN_CHUNK == 2
    assert smallest_chunk(model) == 2 and smallest_chunk(model, across_ranks=True) == 2
    assert smallest_chunk(lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))) == 2


def test_sync_batchnorm_gathers_across_ranks_but_not_across_one_process_cards():
    model = nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8))
    assert smallest_chunk(model) == 2
    assert smallest_chunk(model, across_ranks=True) == 1


def test_no_batchnorm_one_sample_and_the_flag_rule():
    assert smallest_chunk(nn.Linear(4, 2)) == 1 and smallest_chunk(nn.LayerNorm(4), across_ranks=True) == 1
    assert (min_chunk(True), min_chunk(False)) == (2, 1)


def test_a_factory_that_raises_is_the_users_error_named():
    def broken() -> nn.Module:
        raise ValueError("no such layer")

    with pytest.raises(UserCodeError, match="model factory raised .* ValueError: no such layer"):
        smallest_chunk(broken)
