""":meth:`SimulatedBackend.even_line` against real steps: the even split's largest batch past
a known fit, every even batch from there simulated for real on the same cards (a whole step
replayed through the allocator each, not drawn between steps as the line does) until one is
over.

A tiny GPT (vocabulary 2000, one layer, 32 tokens), AdamW, on three 2 GB cards at the
reserved level: the figures rise and fall (card 0 reads 774 MB at batch 115, 766 MB at 121),
so the first over batch is not found by bisection."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.reserved import ReservedModel
from dptune.budget import BudgetLevel, at_level
from dptune.examples.models import TinyGPT
from dptune.split import even_split
from dptune.step.workload import Workload

pytestmark = pytest.mark.slow

LO, TOP = 100, 160


def backend() -> SimulatedBackend:
    model = TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)
    return SimulatedBackend(Workload(model, model.sample, None,
                                     lambda p: torch.optim.AdamW(p, lr=1e-4)),
                            "3x2GB", reserved=ReservedModel())


def first_over(real: dict[int, tuple[int, ...]], budgets: list[int]) -> Optional[int]:
    return next((b for b in range(LO + 1, TOP) if any(p > x for p, x in zip(real[b], budgets))),
                None)


def test_the_line_is_the_first_real_step_over() -> None:
    be = backend()
    real = {b: at_level(be.probe(even_split(b, 3)), be.devices, BudgetLevel.RESERVED).peak_bytes
            for b in range(LO, TOP)}
    c0 = sorted({r[0] for r in real.values()})
    c1 = sorted({r[1] for r in real.values()})
    # budgets that put the first over batch at several places: on card 0's rise, on a card
    # i >= 1 before the figures fall (and fit again after: the answer stays the first over)
    cases = [[max(x, f) for x, f in zip(c, real[LO])]
             for c in ([c0[-3], c1[-1], c1[-1]], [c0[2], c1[-1], c1[-1]],
                       [c0[-1], c1[-2] - 1, c1[-2] - 1])]
    falls = [b for b in range(LO, TOP - 1) if real[b + 1][0] < real[b][0]]
    assert falls, "the case no longer has a fall: pick another"
    cards = set()
    for budgets in cases:
        want = first_over(real, budgets)
        assert want is not None and want > LO + 2, budgets
        line = be.even_line(LO, budgets)
        assert line is not None, budgets
        assert (line.start, line.largest, line.over) == (LO, want - 1, want), budgets
        assert real[want][line.card] > budgets[line.card]
        assert line.replays >= 3 * (want - 1 - LO) and line.steps >= 9
        cards.add(line.card)
    assert 0 in cards and cards - {0}, cards      # over on card 0, and on another card


def test_no_line_where_it_cannot_be_drawn() -> None:
    be = backend()
    budgets = [d.budget_bytes(64 * 2**20) for d in be.devices]
    # below n * (n - 1) the chunks do not follow the residue lines yet
    assert be.even_line(5, budgets) is None
    from dptune.backends.simulated.even_line import even_line
    assert be.reserved is not None
    # no batch over within the events allowed
    assert even_line(be._traces, LO, [10**15] * 3, be.reserved.config,
                     be.reserved.fixed.nccl_for(3), max_events=10**6) is None


def test_under_batchnorm_no_chunk_of_one_is_simulated_and_the_line_is_the_real_steps() -> None:
    """A small BatchNorm CNN on three cards from the first batch the line draws (6; the
    figures flat on 2 MB segments, card 0's rising by one near batch 69): batches
    whose last card would get 1 sample (7: (3, 3, 1)) are no step DataParallel can run, skipped,
    and never simulated."""
    from dptune.examples.models import SmallResNet

    model = SmallResNet(widths=(8, 16), blocks=1, num_classes=10, image_size=32)
    be = SimulatedBackend(Workload(model, model.sample, None,
                                   lambda p: torch.optim.AdamW(p, lr=1e-4)),
                          "3x2GB", reserved=ReservedModel())
    asked: list[tuple[int, ...]] = []
    traces = be._traces

    def traces_of(split):  # type: ignore[no-untyped-def]
        asked.append(tuple(split))
        return traces(split)
    be._traces = traces_of  # type: ignore[method-assign]
    lo, top = 6, 80
    real = {b: at_level(be.probe(even_split(b, 3)), be.devices, BudgetLevel.RESERVED).peak_bytes
            for b in range(lo, top) if 1 not in even_split(b, 3)}
    # card 0 over where its figure first rises by a segment (near batch 69)
    budgets = [min(r[0] for r in real.values())] + [10**12] * 2
    want = next(b for b in sorted(real) if b > lo and real[b][0] > budgets[0])
    line = be.even_line(lo, budgets, min_chunk=2)
    assert line is not None and (line.largest, line.over) == (max(b for b in real if b < want), want)
    assert asked and all(1 not in s for s in asked)
