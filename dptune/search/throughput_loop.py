"""The throughput loop, once: fit each card's time, solve, probe the answer, tighten, again.

:func:`throughput_loop` runs it for any :class:`Cards`: DataParallel's cards
(:func:`dptune.search.throughput.fastest`: card 0 gathers, the step is the slowest card plus
the serial work), the DDP ranks of a plan (:func:`dptune.ddp.throughput.plan_throughput`) and
of a length bucket (:func:`dptune.lengths.ddp_speed.fastest_ranks`): independent ranks, the
step is the slowest rank (card or host) plus the all-reduce, :func:`rank_step_model`. The
cards say what is known, how the step's time depends on the split, how to probe one and when
their probe budget is spent; the pure arithmetic is :mod:`dptune.solve.time`'s.

:func:`fastest_ranks_split` is where the DDP ranks' answer is chosen among splits the model
finds equally fast (the solver's own order, :func:`dptune.solve.time.fastest_split`): the one
spot to change how the ranks' ties are broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Optional, Protocol, Sequence, TypeVar

from dptune.solve.time import SplitTime, StepModel, TimeFit, fastest_accumulation, fastest_split

__all__ = ["Cards", "LoopEnd", "throughput_loop", "rank_step_model", "fastest_ranks_split"]

A = TypeVar("A")


class Cards(Protocol[A]):
    """The cards a throughput loop plans for; ``A``: their answer (a solved split)."""

    def spent(self) -> bool:
        """The probe budget is used up."""
        ...

    def solve(self) -> Optional[A]:
        """Each card's time fitted on what is known, and the split the model finds fastest
        within the cards' memory caps; ``None``: no model yet, or nothing fits."""
        ...

    def settled(self, answer: A) -> bool:
        """Nothing is left to probe for ``answer`` (it was measured)."""
        ...

    def probe(self, answer: A) -> None:
        """Probe ``answer``: what it measures joins what is known (a card over its budget
        tightens its cap, a new time point refits its card)."""
        ...


@dataclass(frozen=True)
class LoopEnd(Generic[A]):
    """How the loop ended: the last answer solved (``None``: nothing fits, no model, or the
    budget was spent before a solve) and whether the probe budget ran out."""

    answer: Optional[A]
    spent: bool


def throughput_loop(cards: Cards[A]) -> LoopEnd[A]:
    """Solve, probe the answer, solve again with what it measured, until an answer needs no
    probe, nothing fits, or the cards' probe budget is spent."""
    while not cards.spent():
        answer = cards.solve()
        if answer is None or cards.settled(answer):
            return LoopEnd(answer, False)
        cards.probe(answer)
    return LoopEnd(None, True)


def rank_step_model(fits: Sequence[TimeFit], slowest_host: Callable[[frozenset[int]], float],
                    allreduce: Callable[[frozenset[int]], float]) -> StepModel:
    """DDP ranks' step: each rank a process of its own, the gradients all-reduced once the
    slowest rank (its card's work, or its host's time to issue the step) has finished::

        T(b) = allreduce(S) + max(slowest_host(S), max_r fits[r](b_r))

    ``S``: the ranks given samples."""
    return StepModel(cards=tuple(fits), overhead=allreduce,
                     host=lambda used: slowest_host(used) + allreduce(used))


def fastest_ranks_split(model: StepModel, curves: Sequence[Sequence[float]], batch: Optional[int],
                        min_batch: int, accumulate: bool = False
                        ) -> Optional[tuple[SplitTime, int]]:
    """The DDP ranks' fastest split under ``model`` (every rank given at least ``min_batch``)
    and its number of micro-batches. ``curves[r]``: rank r's time at batches ``0..cap_r``;
    ``batch``: the global batch (``None``: the batch is free, the most samples per second);
    ``accumulate``: ``batch`` as equal micro-batches, their number chosen too. ``None``:
    nothing fits. Ties: the solver's order (the one spot to change it for the ranks)."""
    if accumulate:
        assert batch is not None
        acc = fastest_accumulation(lambda b: curves, batch, overhead=model.overhead,
                                   min_chunk=min_batch, every_card=True, host=model.host)
        return None if acc is None else (acc.split, acc.micro_batches)
    sol = fastest_split(curves, batch, overhead=model.overhead, min_chunk=min_batch,
                        every_card=True, host=model.host)
    return None if sol is None else (sol, 1)
