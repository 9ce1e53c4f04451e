"""The tuner's even split's largest batch on the model (simulated cards, the reserved level):
``TuneResult.even`` at ``E`` found there (``on_model``), in ``report.json`` (read back), in the
footer and the notes; none at the allocated level.

The backend is the synthetic one of ``tests/test_tuner_look_past.py`` (card 1 holds 1 GiB of
cached blocks from 420 to 439 samples, over its budget there) with an even line by brute force
over the same surface: every even batch from the one asked, until one is over."""

from __future__ import annotations

import json
from typing import Optional, Sequence

import torch

from dptune.result.model import TuneResult
from dptune.report.text import render_summary, render_table
from dptune.tuner import Tuner
from dptune.types import EvenLine
from tests.test_tuner_look_past import FallingBackend, tune


def chunk(b: int) -> tuple[int, ...]:
    sizes = [len(t) for t in torch.arange(b).chunk(2)]
    return tuple(sizes + [0] * (2 - len(sizes)))


class LinedBackend(FallingBackend):
    def __init__(self, fall: bool):
        super().__init__(fall)
        self.lines: list[int] = []

    def over(self, b: int, budgets: Sequence[int]) -> Optional[int]:
        s = chunk(b)
        return next((i for i, c in enumerate(s) if self.figure(i, c, b) > budgets[i]), None)

    def even_line(self, lo: int, budgets: Sequence[int], min_chunk: int = 1,
                  upto: Optional[int] = None) -> Optional[EvenLine]:
        self.lines.append(lo)
        b = lo + 1
        while self.over(b, budgets) is None:
            b += 1
        card = self.over(b, budgets)
        assert card is not None
        return EvenLine(lo, b - 1, b, card, replays=2 * (b - lo), steps=6)


def brute_even(be: LinedBackend, budgets: Sequence[int]) -> int:
    b = 1
    while be.over(b + 1, budgets) is None:
        b += 1
    return b


def tune_at(backend: FallingBackend, batch: int, **kw) -> TuneResult:  # type: ignore[no-untyped-def]
    return Tuner(torch.nn.Linear(4, 2), lambda n: torch.randn(n, 4), batch_size=batch,
                 objective="max_batch", backend=backend, verbose=False, **kw).fit()


def test_a_reading_the_model_agrees_with_is_said_checked() -> None:
    be = LinedBackend(fall=True)
    r = tune(be)                       # from 850: the probes read E = 839 themselves
    e = brute_even(be, r.budget_bytes)
    assert be.lines and r.even.batch_size == e and not r.even.on_model
    said = [n for n in r.notes if "checked on the allocator model" in n]
    assert len(said) == 1 and str(e) in said[0]


def test_a_fall_inside_the_probes_reading_moves_E_down_and_is_reported() -> None:
    """From 700 the probes read E = 921, past card 1's fall (they never asked card 1 at 420
    to 439 on an even split below it); the line finds the first even batch over."""
    plain = tune_at(FallingBackend(fall=True), 700)
    be = LinedBackend(fall=True)
    r = tune_at(be, 700)
    e = brute_even(be, r.budget_bytes)
    assert plain.even.batch_size > e and not plain.even.on_model
    assert r.even.batch_size == e and be.over(e + 1, r.budget_bytes) == 1
    assert r.even.on_model and r.even.chunk_sizes == chunk(e) and r.even.feasible
    assert all(p.chunk_sizes != r.even.chunk_sizes for p in r.probes)   # not a probe
    assert len(r.probes) == len(plain.probes) and r.chunk_sizes == plain.chunk_sizes
    said = [n for n in r.notes if "found on the allocator model" in n]
    assert len(said) == 1 and "does not hold" in said[0]
    assert "was found on the allocator model" in render_summary(r) + render_table(r)
    back = TuneResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.even == r.even and back.even.on_model


def test_no_line_at_the_allocated_level() -> None:
    be = LinedBackend(fall=True)
    r = tune(be, budget_level="allocated")
    assert be.lines == [] and not r.even.on_model
