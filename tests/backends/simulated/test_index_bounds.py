"""Embedding indices past the table raise on the simulated cards as on a real card (CUDA's
device-side assert, the CPU's ``IndexError: index out of range in self``), naming the user's
line; indices within the table, or whose values the simulator cannot bound, run as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dptune import estimate_memory
from dptune.errors import EXIT_USER_CODE, UserCodeError
from dptune.examples.hf import tiny_gpt2


class Tokens(nn.Module):
    def __init__(self, vocab: int = 100):
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids):
        return self.head(self.emb(ids))      # the user's line the error names


def estimate(model, sample, split=(4, 4)):
    return estimate_memory(model, sample, list(split), "2x24GB", optimizer=None)


def test_the_cpu_itself_raises_for_these_indices():
    # the reference: what the same step does on real tensors (a CUDA card asserts instead)
    with pytest.raises(IndexError, match="index out of range in self"):
        Tokens()(torch.randint(0, 200, (8, 12)))


def test_token_ids_beyond_the_vocabulary_raise_naming_the_line():
    with pytest.raises(UserCodeError) as err:
        estimate(Tokens(), lambda n: torch.randint(0, 200, (n, 12)))
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == EXIT_USER_CODE
    assert "index out of range in self" in msg and "an index of 199 into an embedding table of 100 rows" in msg
    assert "test_index_bounds.py" in msg and "self.head(self.emb(ids))" in msg


@pytest.mark.parametrize("make", [
    lambda n: torch.randint(0, 100, (n, 12)),                  # the vocabulary's ids
    lambda n: torch.randint(0, 200, (n, 12)) % 100,            # no bound known: not checked
    lambda n: torch.arange(n * 12).reshape(n, 12) % 100,
    lambda n: torch.full((n, 12), 99),
], ids=["in-range", "modulo", "arange-modulo", "last-row"])
def test_indices_within_the_table_or_unbounded_run(make):
    est = estimate(Tokens(), make)
    assert all(p > 0 for p in est.peak_bytes)


def test_negative_and_shifted_ids():
    with pytest.raises(UserCodeError, match="an index of -1 "):
        estimate(Tokens(), lambda n: torch.randint(0, 100, (n, 12)) - 1)
    with pytest.raises(UserCodeError, match="an index of 100 "):
        estimate(Tokens(), lambda n: torch.arange(12).expand(n, 12) + 89)
    assert estimate(Tokens(), lambda n: torch.arange(12).expand(n, 12) + 88).peak_bytes[0] > 0


@pytest.mark.slow
def test_a_sequence_longer_than_the_models_positions():
    """GPT-2's position ids are arange(seq_len): past n_positions the position table runs out."""
    model = tiny_gpt2(vocab_size=64, n_positions=16, n_embd=32, n_head=2, use_cache=False)
    ok = estimate(model, lambda n: {"input_ids": torch.randint(0, 64, (n, 16))})
    assert ok.peak_bytes[0] > 0
    with pytest.raises(IndexError, match="index out of range in self"):   # the CPU's own verdict
        model(input_ids=torch.randint(0, 64, (1, 17)))
    with pytest.raises(UserCodeError) as err:
        estimate(model, lambda n: {"input_ids": torch.randint(0, 64, (n, 17))})
    msg = str(err.value)
    assert "an index of 16 into an embedding table of 16 rows" in msg
    assert "modeling_gpt2.py" in msg
