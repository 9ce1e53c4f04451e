"""The simulator's "data-dependent sizes bounded" note appears only when it matters: a value
read from a tensor on a card, not AdamW's step counter (a host scalar, read on CUDA too)."""

from __future__ import annotations

import torch
from torch import nn

from dptune.backends.simulated import estimate_memory


def _notes(model, optimizer):
    e = estimate_memory(model, lambda n: torch.randn(n, 16), [4, 4], "2x24GB",
                        loss_fn=lambda o, b: o.sum(), optimizer=optimizer)
    return [n for n in e.notes if "data-dependent" in n]


def test_adamw_step_counter_is_not_a_data_dependent_size():
    assert _notes(nn.Linear(16, 16), lambda p: torch.optim.AdamW(p)) == []


def test_a_value_read_on_a_card_is_still_noted():
    class Normalised(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return y / (y > 0).sum().item()

    [note] = _notes(Normalised(16, 16), lambda p: torch.optim.AdamW(p))
    assert ".item()" in note and "kept symbolic" in note
