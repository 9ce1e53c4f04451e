"""The balance at the default level on simulated cards, solved on the allocator model's map
(``search.Known.balance_map``), against brute force: every split of the batch probed for
real on the same simulated cards (each a whole simulated step replayed through the
allocator), the least largest share read off them.

A small BERT-style encoder, bf16 AdamW, length 128, on two 4 GB cards: the reserved figures
fall as a chunk grows (card 1's at 33 samples: a cached block reused where one sample fewer
reserved one more segment), so a certificate that reads "every card at or above the largest
share from its first chunk measured there" can be wrong: at batch 64 the probes alone certify
[24, 40] at 16.63% of a budget, where [40, 24] reaches 16.57%. The map (every chunk a card can
take in a split no worse than the probes' answer, drawn between simulated steps) must find
what brute force finds, and the tuner certifies it. The tolerance is set next to nothing, so
that the even split is kept only where it is the least itself."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.reserved import ReservedModel
from dptune.budget import BudgetLevel, at_level
from dptune.examples.models import BertClassifier
from dptune.settings import Budget
from dptune.step.workload import Workload
from dptune.tuner import Tuner

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]

LENGTH, VOCAB = 128, 1000
CLUSTER = "2x4GB"


def sample(n: int) -> Any:
    g = torch.Generator().manual_seed(n)
    return {"input_ids": torch.randint(0, VOCAB, (n, LENGTH), generator=g),
            "attention_mask": torch.ones(n, LENGTH, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,), generator=g)}


def model() -> torch.nn.Module:
    return BertClassifier(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, seq_len=512)


def backend() -> SimulatedBackend:
    return SimulatedBackend(Workload(model, sample, None,
                                     lambda p: torch.optim.AdamW(p, lr=1e-4), amp="bf16"),
                            CLUSTER, reserved=ReservedModel())


@pytest.mark.parametrize("batch", [64, 66])
def test_balance_at_the_reserved_level_is_brute_force(batch: int) -> None:
    budget = Budget.at("reserved")
    res = Tuner(model, sample, batch_size=batch, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                amp="bf16", objective="balance", budget=budget, verbose=False,
                backend=backend(), tolerance=1e-9).fit()
    be = backend()                          # brute force on fresh cards of the same kind
    budgets = [d.budget_bytes(budget.headroom_bytes) for d in be.devices]
    tops = {}
    for c0 in range(batch + 1):
        r = at_level(be.probe((c0, batch - c0)), be.devices, BudgetLevel.RESERVED)
        if all(p <= b for p, b in zip(r.peak_bytes, budgets)):
            tops[(c0, batch - c0)] = max(p / b for p, b in zip(r.peak_bytes, budgets))
    least = min(tops.values())
    assert res.certified, res.notes
    assert tuple(res.chunk_sizes) in tops
    assert tops[tuple(res.chunk_sizes)] == pytest.approx(least, rel=0, abs=1e-12)
    assert max(res.peak_bytes[i] / budgets[i] for i in range(2)) == \
        pytest.approx(tops[tuple(res.chunk_sizes)], abs=1e-12)
