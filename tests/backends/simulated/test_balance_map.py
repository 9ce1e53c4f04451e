""":meth:`SimulatedBackend.balance_map` against real steps: every chunk of every card's curve
probed for real on the same simulated cards (each a whole simulated step replayed through the
allocator), not drawn between two steps as the map does; and its bounds: a chunk just past a
curve is over the map's level, or cannot be in a split of the batch at it.

A small BERT-style encoder, bf16 AdamW, length 128, on two 4 GB cards at the reserved level:
card 1's reserved figure falls at 33 samples (a cached block reused where one sample fewer
reserved one more segment)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.reserved import ReservedModel
from dptune.budget import BudgetLevel, at_level
from dptune.examples.models import BertClassifier
from dptune.step.workload import Workload

pytestmark = pytest.mark.slow

LENGTH, VOCAB, HEADROOM = 128, 1000, 256 * 2**20


def backend() -> SimulatedBackend:
    def sample(n: int) -> Any:
        return {"input_ids": torch.randint(0, VOCAB, (n, LENGTH)),
                "attention_mask": torch.ones(n, LENGTH, dtype=torch.long),
                "labels": torch.randint(0, 2, (n,))}
    model = (lambda: BertClassifier(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4,
                                    seq_len=512))
    return SimulatedBackend(Workload(model, sample, None,
                                     lambda p: torch.optim.AdamW(p, lr=1e-4), amp="bf16"),
                            "2x4GB", reserved=ReservedModel())


def figures(be: SimulatedBackend, split: tuple[int, ...]) -> tuple[int, ...]:
    return at_level(be.probe(split), be.devices, BudgetLevel.RESERVED).peak_bytes


def test_every_chunk_of_the_map_is_the_real_step() -> None:
    be = backend()
    budgets = [d.budget_bytes(HEADROOM) for d in be.devices]
    batch, split = 64, (30, 34)
    level = max(p / b for p, b in zip(figures(be, split), budgets))
    mp = be.balance_map(split, level, budgets)
    assert mp is not None and mp.batch == batch and mp.replays > 0
    c1 = mp.curves[1]
    # card 1's curve reaches down past its fall at 33 and up to where it is over the level
    assert c1.lo <= 33 < c1.lo + len(c1.figures)
    real = {}
    for cv in mp.curves:
        for c, fig in cv.chunks().items():
            s = (c, batch - c) if cv.card == 0 else (batch - c, c)
            real[cv.card, c] = figures(be, s)[cv.card]
            assert fig == real[cv.card, c], (cv.card, c)
    # a figure that falls as the chunk grows is in the map, and so is the fall
    falls = [c for (i, c) in real if i == 1 and (1, c + 1) in real and real[1, c + 1] < real[1, c]]
    assert falls, "the case no longer has a fall: pick another"
    for cv in mp.curves:
        top = cv.lo + len(cv.figures)          # the first chunk past the curve
        if top <= batch:
            s = (top, batch - top) if cv.card == 0 else (batch - top, top)
            assert figures(be, s)[cv.card] / budgets[cv.card] > level


def test_a_map_too_wide_to_replay_is_not_made() -> None:
    from dptune.backends.simulated.balance_map import balance_map
    be = backend()
    budgets = [d.budget_bytes(HEADROOM) for d in be.devices]
    split = (30, 34)
    level = max(p / b for p, b in zip(figures(be, split), budgets))
    assert be.reserved is not None
    nccl = be.reserved.fixed.nccl_for(2)
    args = (be._traces, split, budgets, level, be.reserved.config, nccl)
    assert balance_map(*args, max_chunks=3) is None
    assert balance_map(*args) is not None
