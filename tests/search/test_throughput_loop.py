"""The one throughput loop (dptune.search.throughput_loop): its stopping rules on a scripted set
of cards, and the DDP ranks' step model against the step composed by hand."""

from __future__ import annotations

from typing import Optional

import pytest

from dptune.search.throughput_loop import (LoopEnd, fastest_ranks_split, rank_step_model,
                                           throughput_loop)
from dptune.solve.time import TimeFit


class Scripted:
    """Cards whose solver answers from a script: answer i after i probes."""

    def __init__(self, answers: list[Optional[int]], measured: set[int], budget: int):
        self.answers, self.measured, self.budget = answers, set(measured), budget
        self.probed: list[int] = []
        self.solves = 0

    def spent(self) -> bool:
        return len(self.probed) >= self.budget

    def solve(self) -> Optional[int]:
        self.solves += 1
        return self.answers[len(self.probed)]

    def settled(self, answer: int) -> bool:
        return answer in self.measured

    def probe(self, answer: int) -> None:
        self.probed.append(answer)
        self.measured.add(answer)


def test_the_loop_probes_each_new_answer_until_one_was_measured():
    cards = Scripted([5, 7, 7], measured={1}, budget=6)
    end = throughput_loop(cards)
    assert end == LoopEnd(7, False) and cards.probed == [5, 7]


def test_the_loop_stops_when_nothing_fits():
    cards = Scripted([5, None], measured=set(), budget=6)
    assert throughput_loop(cards) == LoopEnd(None, False) and cards.probed == [5]


def test_the_loop_stops_at_the_budget_without_solving_again():
    cards = Scripted([1, 2, 3, 4], measured=set(), budget=2)
    end = throughput_loop(cards)
    assert end.spent and end.answer is None
    assert cards.probed == [1, 2] and cards.solves == 2
    spent = Scripted([1], measured=set(), budget=0)
    assert throughput_loop(spent) == LoopEnd(None, True) and spent.solves == 0


def test_the_ranks_model_is_the_slowest_rank_or_host_then_the_all_reduce():
    fits = [TimeFit(0.001, 0.0001), TimeFit(0.002, 0.0004)]
    hosts = [0.0015, 0.0030]
    model = rank_step_model(fits, lambda used: max(hosts[r] for r in used),
                            lambda used: 0.0005 * len(used))
    # by hand: rank 0 at 10 samples 2.0 ms, rank 1 at 5: 4.0 ms; hosts 1.5 and 3.0 ms
    assert model.seconds([10, 5]) == pytest.approx(0.001 + 0.004)
    # rank 1 at 1 sample (2.4 ms) is faster than its host (3.0 ms): the host sets the step
    assert model.seconds([10, 1]) == pytest.approx(0.001 + 0.003)


def test_the_ranks_fastest_split_gives_the_faster_rank_more_and_drops_none():
    fits = [TimeFit(0.0, 0.001), TimeFit(0.0, 0.003)]     # rank 1 three times slower
    model = rank_step_model(fits, lambda used: 0.0, lambda used: 0.0)
    curves = [[f.predict(c) for c in range(41)] for f in fits]
    got = fastest_ranks_split(model, curves, 40, 1)
    assert got is not None
    sol, k = got
    assert k == 1 and sol.chunk_sizes == (30, 10)
    # brute force over every split of 40 with both ranks given samples
    best = min(max(fits[0].predict(a), fits[1].predict(40 - a)) for a in range(1, 40))
    assert sol.step_seconds == pytest.approx(best)
    # as equal micro-batches: never slower per global batch than one step
    acc = fastest_ranks_split(model, curves, 40, 1, accumulate=True)
    assert acc is not None and acc[1] * acc[0].step_seconds <= sol.step_seconds * (1 + 1e-9)
    assert fastest_ranks_split(model, [c[:11] for c in curves], 40, 1) is None   # caps of 10
