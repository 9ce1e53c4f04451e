""":meth:`SimulatedBackend.look_past` against brute force: every chunk of its window probed
for real on the same simulated cards (the allocator model replaying each real step), not
drawn between two steps as the look does.

Two BERT-style encoders, bf16 AdamW, at the reserved level: a small one on 4 x 4 GB at
length 128, whose windows are over throughout, and the benchmarks' (``benchmarks.lengths``)
on 4 x 24 GB at length 138, where cards 1-3 are over at 2,088 samples and fit again a few
samples on (fragmentation the search's probes did not meet: it certified 2,087 there)."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pytest
import torch

from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.reserved import ReservedModel
from dptune.budget import BudgetLevel, at_level
from dptune.examples.models import BertClassifier
from dptune.step.workload import Workload
from dptune.types import CardWindow

pytestmark = pytest.mark.slow


def backend(d_model: int, cluster: str, length: int, vocab: int = 1000) -> SimulatedBackend:
    def sample(n: int) -> Any:
        return {"input_ids": torch.randint(0, vocab, (n, length)),
                "attention_mask": torch.ones(n, length, dtype=torch.long),
                "labels": torch.randint(0, 2, (n,))}
    model = (lambda: BertClassifier(vocab_size=vocab, d_model=d_model, n_layers=4,
                                    n_heads=8, seq_len=512))
    return SimulatedBackend(Workload(model, sample, None,
                                     lambda p: torch.optim.AdamW(p, lr=1e-4), amp="bf16"),
                            cluster, reserved=ReservedModel())


def real(be: SimulatedBackend, split: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One real probe's figures at the level (reserved peak + NCCL) and its allocated ones +
    NCCL (the replay's ``allocated_bytes.all.peak``, which the reserved peak never goes below)."""
    r = at_level(be.probe(split), be.devices, BudgetLevel.RESERVED)
    nccl = be.reserved.fixed.nccl_for(len(split))  # type: ignore[union-attr]
    assert r.memory_stats is not None
    return r.peak_bytes, tuple(m["allocated_bytes.all.peak"] + nccl for m in r.memory_stats)


def frontier(batch: int, caps: Sequence[int]) -> list[int]:
    """A split of ``batch`` with the least on card 0 the others' caps allow (what a
    certificate says is over for every larger batch), the others filled up to their caps."""
    c0 = max(0, batch - sum(caps))
    rest, need = [0] * len(caps), batch - c0
    for i, cap in enumerate(caps):
        rest[i] = min(cap, need)
        need -= rest[i]
    return [c0, *rest]


def brute(be: SimulatedBackend, split: Sequence[int], over: Sequence[Optional[int]],
          w: CardWindow, budget: int, limit: int = 60
          ) -> tuple[Optional[int], Optional[int], Optional[int]]:
    """(first step within budget, last step within budget, first step whose allocated figure
    + NCCL is over) from ``w.start`` on, each a real probe: a card ``i >= 1`` alone from its
    over point, the others as in the answer; card 0 at the least it can take of each larger
    batch, the others at their caps (``over - 1``): ``w.start`` a batch where it holds no
    samples, else its chunk."""
    caps = [int(o) - 1 for o in over[1:] if o is not None]
    first = last = None
    for x in range(w.start, w.start + limit):
        if w.card:
            s = list(split)
            s[w.card] = x
        elif w.no_samples:
            s = frontier(x, caps)
            assert s[0] == 0, s
        else:
            s = [x, *caps]
        level, alloc = real(be, s)
        if alloc[w.card] > budget:
            return first, last, x
        if level[w.card] <= budget:
            first = x if first is None else first
            last = x
    raise AssertionError(f"no end within {limit} steps of {w}")


def check(be: SimulatedBackend, split: list[int], over: list[Optional[int]]) -> list[CardWindow]:
    budgets = [d.budget_bytes(256 * 2**20) for d in be.devices]
    look = be.look_past(split, over, budgets)
    assert {w.card for w in look.cards} == {i for i, o in enumerate(over) if o is not None}
    for w in look.cards:
        assert w.scaled, w
        assert (w.fits, w.last_fits, w.end) == brute(be, split, over, w, budgets[w.card]), w
    return list(look.cards)


def test_windows_over_throughout_agree_with_every_chunk_probed() -> None:
    be = backend(256, "4x4GB", 128)
    windows = check(be, [527, 536, 536, 536], [528, 537, 537, 537])
    assert all(w.closed for w in windows)
    assert all(w.end is not None and w.end > w.start for w in windows)


def test_a_fall_past_the_over_point_is_the_one_brute_force_finds() -> None:
    be = backend(512, "4x24GB", 138, vocab=30522)
    windows = check(be, [2077, 2087, 2087, 2087], [2078, 2088, 2088, 2088])
    falls = [w for w in windows if w.fits is not None]
    assert [w.card for w in falls] == [1, 2, 3]
    # over at the chunk the search measured over, within budget again above it
    assert all(w.fits is not None and w.fits > w.start for w in falls)


def test_card_0_with_no_samples_is_looked_at_as_the_batch_grows() -> None:
    """A decoder whose gathered logits leave card 0 nothing (its answer [0, 119, 118, 118] on
    4 x 4 GB, the others' caps 323): the certificate says card 0 is over with no samples in
    every batch the others' caps can hold, and with one sample and more beyond; both windows
    against real probes."""
    from dptune.examples.models import TinyGPT

    wl = Workload(lambda: TinyGPT(vocab_size=16000, d_model=64, n_layers=1, n_heads=2, seq_len=128),
                  lambda n: torch.randint(0, 16000, (n, 128)), None,
                  lambda p: torch.optim.AdamW(p, lr=1e-4))
    be = SimulatedBackend(wl, "4x4GB", reserved=ReservedModel())
    windows = check(be, [0, 119, 118, 118], [1, 324, 324, 324])
    zero = [w for w in windows if w.card == 0 and w.no_samples]
    ones = [w for w in windows if w.card == 0 and not w.no_samples]
    assert len(zero) == 1 and zero[0].start == 356 and zero[0].closed
    assert len(ones) == 1 and ones[0].start == 1 and ones[0].batch_start == 970 and ones[0].closed
