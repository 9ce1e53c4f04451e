"""The fastest split that fits: time fits from the probes, the solver, certified probes.

After the memory search at the batch (``balance``: its probes give each card's memory fit
and, with timed probes, each card's time at several chunks), :func:`fastest` fits each
card's step time (affine in its chunk, :func:`dptune.solve.time.fit_time`), the output
card's serial work (affine in the batch) and the copies between cards, caps each card's
chunk by memory (its fit, and any chunk measured over budget), solves for the split with
the shortest step (:func:`dptune.solve.time.fastest_split`, dropping cards where that is
faster), and probes it. A split over budget tightens that card's cap and the solver runs
again. Only splits a probe measured within every budget are returned, as for the other
objectives; among them the one with the shortest step time. The loop is the one shared with
the DDP plans: :func:`dptune.search.throughput_loop.throughput_loop` over :class:`DataParallelCards`.

Two other goals (:class:`Goal`): ``global_batch=N``, the number of equal micro-batches and the
micro-batch's split that finish N samples fastest (gradient accumulation; the certified probe
is at the micro-batch); ``up_to=True``, the batch (at most the one given) and split with the
most samples per second (the variable-length plan's throughput, per bucket).

:func:`figures` gives every report its time line: for the even split, the memory-balanced
split and the fastest split, the batch, step time, samples per second and whether the time
was measured or estimated (or predicted from the fits, for a split not probed).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.errors import UsageError
from dptune.solve.memory import Fit
from dptune.split import even_split
from dptune.solve.time import SplitTime, StepModel, TimeFit, fit_time
from dptune.search.throughput_loop import throughput_loop
from dptune.types import StepTime
from dptune.types import Objective

__all__ = ["SpeedFigure", "ThroughputOutcome", "Goal", "fastest", "step_model", "figures",
           "speed_notes", "advice", "memory_caps", "check_global_batch", "DataParallelCards"]


@dataclass(frozen=True)
class SpeedFigure:
    """One split's speed: ``label`` (even, memory-balanced, fastest), its time and source."""

    label: str
    chunk_sizes: tuple[int, ...]
    step_seconds: Optional[float]
    source: str                 # "measured", "estimated", or "predicted from fits"
    fits: bool                  # measured within every budget

    @property
    def batch_size(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def samples_per_second(self) -> Optional[float]:
        if self.step_seconds is None or self.step_seconds <= 0:
            return None
        return self.batch_size / self.step_seconds

    def describe(self) -> str:
        split = "/".join(str(c) for c in self.chunk_sizes)
        if self.step_seconds is None:
            return f"{self.label}: batch {self.batch_size} [{split}], time unknown"
        fit = "" if self.fits else ", over budget"
        return (f"{self.label}: batch {self.batch_size} [{split}], step {self.step_seconds * 1e3:.2f} ms, "
                f"{self.samples_per_second:,.0f} samples/s ({self.source}{fit})")

    def to_dict(self) -> dict:
        return dict(label=self.label, chunk_sizes=list(self.chunk_sizes),
                    step_seconds=self.step_seconds, samples_per_second=self.samples_per_second,
                    source=self.source, fits=self.fits)


@dataclass(frozen=True)
class ThroughputOutcome:
    best: ProbeResult
    figures: tuple[SpeedFigure, ...]
    model: Optional[StepModel]
    probes: tuple[ProbeResult, ...]       # every probe: the memory search's, then these
    notes: tuple[str, ...]
    advice: tuple[str, ...]
    micro_batches: int = 1                # the global batch's micro-batches (accumulation)


def step_model(probes: Sequence[ProbeResult], n: int) -> Optional[StepModel]:
    """The step-time model fitted on the timed probes (``None`` when none is timed)."""
    timed = [(r, r.time) for r in probes if r.time is not None and len(r.time.card_seconds) == n]
    if not timed:
        return None
    cards: list[Optional[TimeFit]] = []
    for i in range(n):
        cards.append(fit_time([(r.chunk_sizes[i], t.card_seconds[i]) for r, t in timed]))
    known = [f for f in cards if f is not None]
    if not known:
        return None
    # a card never given samples: the slowest known card's time (a guess, said in the notes)
    slowest = max(known, key=lambda f: f.predict(64))
    serial = fit_time([(r.batch_size, t.serial_seconds - t.gather_seconds) for r, t in timed]) \
        or TimeFit(0.0, 0.0)
    others = sum(sum(r.chunk_sizes[1:]) for r, _ in timed)
    gather = sum(t.gather_seconds for _, t in timed) / others if others else 0.0
    spread = [t.transfer_seconds for r, t in timed if any(c > 0 for c in r.chunk_sizes[1:])]
    comm = sum(spread) / len(spread) if spread else 0.0
    return StepModel(cards=tuple(f if f is not None else slowest for f in cards), serial=serial,
                     overhead=lambda used: comm if used - {0} else 0.0, gather_per_sample=gather,
                     host=host_model(timed, n))


def host_model(timed: Sequence[tuple[ProbeResult, StepTime]], n: int
               ) -> Callable[[frozenset[int]], float]:
    """The host's time to issue a step on the cards ``S`` (estimated steps,
    :class:`dptune.types.StepTime`): card 0's own part plus each used card's replica's, each
    the mean over the probes that gave it (the ops do not depend on the chunk); a card never
    given samples: the largest known card's. No host part known: 0."""
    per_card: list[list[float]] = [[] for _ in range(n)]
    own: list[float] = []
    for r, t in timed:
        if len(t.card_host_seconds) != n:
            continue
        own.append(t.host_seconds - sum(t.card_host_seconds))
        for i, c in enumerate(r.chunk_sizes):
            if c > 0:
                per_card[i].append(t.card_host_seconds[i])
    means = [sum(h) / len(h) if h else None for h in per_card]
    known = [m for m in means if m is not None]
    if not own or not known:
        return lambda used: 0.0
    cards = [m if m is not None else max(known) for m in means]
    base = sum(own) / len(own)
    return lambda used: base + sum(cards[i] for i in used)


def _solo(r: ProbeResult) -> Optional[int]:
    """The card a probe gave samples to, when it gave them to one card only."""
    busy = [i for i, c in enumerate(r.chunk_sizes) if c > 0]
    return busy[0] if len(busy) == 1 else None


def whole_step_model(probes: Sequence[ProbeResult], n: int) -> Optional[StepModel]:
    """Fits from measured whole-step times (real cards, no per-card times): card i's time is
    the step's with only card i given samples, which includes the copies and card 0's work;
    a split's step is then modelled as its slowest card's. ``None`` without two chunks per card."""
    cards = []
    for i in range(n):
        pts = [(r.chunk_sizes[i], r.time.step_seconds) for r in probes
               if r.time is not None and r.feasible and _solo(r) == i]
        f = fit_time(pts)
        if f is None or len({c for c, _ in pts}) < 2:
            return None
        cards.append(f)
    return StepModel(cards=tuple(cards))


def _solo_pos(split: Sequence[int]) -> int:
    return next(i for i, c in enumerate(split) if c > 0)


def _solo_splits(batch: int, n: int, caps: Sequence[int], m: int) -> list[tuple[int, ...]]:
    """Two chunks per card, each probed with that card alone: the timed probes the fits of
    whole-step times need."""
    out = []
    for i in range(n):
        hi = max(m, min(caps[i], -(-batch // n)))
        for c in sorted({hi, max(m, hi // 2)}):
            split = [0] * n
            split[i] = c
            out.append(tuple(split))
    return out


def memory_caps(fits: Sequence[Fit], budgets: Sequence[int], batch: int,
                probes: Sequence[ProbeResult]) -> list[int]:
    """Each card's largest chunk at ``batch``: its memory fit's, below any chunk measured over
    budget there, and never below a chunk measured within budget."""
    caps = []
    for i, (fit, budget) in enumerate(zip(fits, budgets)):
        slope = max(fit.slope_bytes, 1.0)
        room = budget - fit.intercept_bytes - fit.batch_slope_bytes * batch
        cap = max(0, min(batch, int(room // slope)))
        for r in probes:
            c = r.chunk_sizes[i]
            same = i > 0 or r.batch_size == batch
            if not same:
                continue
            over = r.oom_device == i or (r.peak_bytes[i] > budget and (r.feasible or r.oom_device == i))
            if over and c > 0:
                cap = min(cap, c - 1)
            elif r.within_budget(budgets):
                cap = max(cap, c)
        caps.append(cap)
    return caps


def _time(r: ProbeResult) -> Optional[float]:
    return None if r.time is None else r.time.step_seconds


@dataclass(frozen=True)
class Goal:
    """What :func:`fastest` looks for: the shortest step for the batch (the default); with
    ``up_to``, the most samples per second with at most the batch, each card's chunk within
    its memory cap at the batch (a card's memory only shrinks with a smaller batch, so these
    caps hold; card 0, which gathers the outputs, might take a little more at a smaller
    batch: not tried); with ``global_batch``, the least time for that many samples as equal
    micro-batches (gradient accumulation)."""

    global_batch: Optional[int] = None
    up_to: bool = False

    def steps(self, r: ProbeResult) -> int:
        """How many steps of ``r`` one round takes (the micro-batches of a global batch)."""
        return 1 if self.global_batch is None else self.global_batch // r.batch_size

    def admits(self, r: ProbeResult, batch: int) -> bool:
        if self.global_batch is not None:
            return self.global_batch % r.batch_size == 0
        return r.batch_size <= batch if self.up_to else r.batch_size == batch

    def cost(self, r: ProbeResult) -> float:
        """What the goal minimises: seconds per sample (``up_to``) or per round."""
        t = r.time.step_seconds if r.time is not None else math.inf
        return t / r.batch_size if self.up_to else self.steps(r) * t


def _solve(model: StepModel, fits: Sequence[Fit], budgets: Sequence[int], batch: int,
           known: Sequence[ProbeResult], min_chunk: int, goal: Goal) -> tuple[Optional[SplitTime], int]:
    """The model's answer to ``goal`` (see :class:`Goal`) and its number of micro-batches."""
    if goal.global_batch is not None:
        plan = model.fastest_accumulation(lambda b: memory_caps(fits, budgets, b, known),
                                          goal.global_batch, min_chunk)
        return (None, 1) if plan is None else (plan.split, plan.micro_batches)
    caps = memory_caps(fits, budgets, batch, known)
    if goal.up_to:
        return model.fastest(caps, None, min_chunk, max_batch=batch), 1
    return model.fastest(caps, batch, min_chunk), 1


def _chosen(known: Sequence[ProbeResult], budgets: Sequence[int], batch: int,
            goal: Goal) -> Optional[ProbeResult]:
    """The probe measured within every budget that does best for ``goal``."""
    ok = [r for r in known if r.time is not None and r.within_budget(budgets) and r.batch_size > 0
          and goal.admits(r, batch)]
    return min(ok, key=lambda r: (goal.cost(r), goal.steps(r), tuple(r.chunk_sizes))) if ok else None


class DataParallelCards:
    """DataParallel's cards for :func:`dptune.search.throughput_loop.throughput_loop`: card 0
    gathers the outputs, so the step is the slowest card plus the serial work and the copies
    (:func:`step_model`; on real cards, each card's whole step timed alone,
    :func:`whole_step_model`); a split is probed as one DataParallel step. Keeps every probe
    (``known``), the probes run here (``run``) and the model fitted on them (``model``)."""

    def __init__(self, probe: Callable[[Sequence[int]], ProbeResult], budgets: Sequence[int],
                 batch: int, probes: Sequence[ProbeResult], fits: Sequence[Fit], min_chunk: int,
                 max_probes: int, goal: Goal):
        self.probe_split, self.budgets, self.batch, self.fits = probe, budgets, batch, fits
        self.min_chunk, self.max_probes, self.goal = min_chunk, max_probes, goal
        self.n = len(budgets)
        self.known = list(probes)
        self.by_split = {tuple(r.chunk_sizes): r for r in self.known}
        self.run = 0
        self.whole = False
        self.model: Optional[StepModel] = None

    def timed(self, split: Sequence[int], purpose: str) -> ProbeResult:
        self.run += 1
        r = dataclasses.replace(self.probe_split(list(split)), purpose=purpose)
        self.known.append(r)
        self.by_split[tuple(r.chunk_sizes)] = r
        return r

    def refit(self) -> None:
        self.model = whole_step_model(self.known, self.n) if self.whole else step_model(self.known, self.n)

    def spent(self) -> bool:
        return self.run >= self.max_probes

    def solve(self) -> Optional[tuple[SplitTime, int]]:
        if self.model is None:          # no card timed: nothing to solve
            return None
        sol, k = _solve(self.model, self.fits, self.budgets, self.batch, self.known,
                        self.min_chunk, self.goal)
        return None if sol is None else (sol, k)

    def settled(self, answer: tuple[SplitTime, int]) -> bool:
        return answer[0].chunk_sizes in self.by_split

    def probe(self, answer: tuple[SplitTime, int]) -> None:
        sol, k = answer
        self.timed(sol.chunk_sizes, f"throughput: fastest predicted ({sol.step_seconds * 1e3:.2f} ms"
                                    + (f" x {k} micro-batches)" if self.goal.global_batch is not None
                                       else ")"))
        self.refit()


def fastest(probe: Callable[[Sequence[int]], ProbeResult], budgets: Sequence[int], batch: int,
            probes: Sequence[ProbeResult], fits: Sequence[Fit], balanced: ProbeResult, *,
            min_chunk: int = 1, max_probes: int = 6,
            global_batch: Optional[int] = None, up_to: bool = False) -> ThroughputOutcome:
    """The fastest split of ``batch`` measured within every budget (see the module docstring).

    ``probes``: the memory search's; ``fits``: its memory fits; ``balanced``: its answer.
    At most ``max_probes`` more probes are run. ``global_batch``: train that many samples per
    optimizer step as equal micro-batches (gradient accumulation): the number of
    micro-batches and the micro-batch's split are chosen together
    (:func:`dptune.solve.time.fastest_accumulation`); ``batch`` is then only where the
    memory search ran. ``up_to``: the most samples per second with at most ``batch``
    samples (a smaller batch, or a card left out, may be faster per sample).
    """
    goal = Goal(global_batch, up_to)
    n = len(budgets)
    cards = DataParallelCards(probe, budgets, batch, probes, fits, min_chunk, max_probes, goal)
    even = tuple(even_split(batch, n))
    if even not in cards.by_split and cards.run < max_probes:
        cards.timed(even, "throughput: the even split's time")
    cards.refit()
    whole = cards.whole = cards.model is None and any(r.time is not None for r in cards.known)
    if whole:            # real cards: each card timed alone, two chunks each (2n probes)
        caps = memory_caps(fits, budgets, batch, cards.known)
        for split in _solo_splits(batch, n, caps, min_chunk):
            if split not in cards.by_split:
                cards.timed(split, f"throughput: card {_solo_pos(split)} timed alone")
        cards.refit()
        cards.max_probes += cards.run
    throughput_loop(cards)
    known, model = cards.known, cards.model
    chosen = _chosen(known, budgets, batch, goal)
    best = chosen if chosen is not None else balanced
    figs = figures(known, budgets, batch, balanced, best, model)
    micro = global_batch // best.batch_size if global_batch is not None and chosen is not None else 1
    notes = _fastest_notes(model, chosen is not None, whole) + speed_notes(figs, best, fastest=True)
    tips = tuple(advice(figs))
    if global_batch is not None:
        notes += (_accumulation_note(best, global_batch, chosen is not None),)
        tips += _accumulation_tip(best, global_batch) if chosen is not None else ()
    return ThroughputOutcome(best=best, figures=figs, model=model, probes=tuple(known),
                             notes=notes, advice=tips, micro_batches=micro)


def _fastest_notes(model: Optional[StepModel], found: bool, whole: bool) -> tuple[str, ...]:
    if model is None and not found:
        return ("no probe carries a step time (the backend does not time steps): the "
                "memory-balanced split is returned",)
    if model is None:
        return ("the probes measured the whole step's time, not each card's, and the cards "
                "timed alone gave no fits: the fastest split measured within every budget is "
                "returned",)
    if whole:
        return ("time fits from the measured steps of each card alone (two chunks per card; "
                "they include the copies and card 0's work): a split's step is modelled as its "
                "slowest card's",)
    return ()


def _accumulation_tip(best: ProbeResult, global_batch: int) -> tuple[str, ...]:
    k = global_batch // best.batch_size
    return (f"for the global batch of {global_batch}: batches of {best.batch_size} split "
            f"{list(best.chunk_sizes)}, {k} accumulation step{'s' if k > 1 else ''} per optimizer "
            "step",)


def _accumulation_note(best: ProbeResult, global_batch: int, found: bool) -> str:
    if not found:
        return (f"global batch {global_batch}: no micro-batch that divides it was measured "
                "within every budget with a step time; the memory-balanced split is returned")
    k = global_batch // best.batch_size
    t = best.time.step_seconds if best.time is not None else 0.0
    split = "/".join(str(c) for c in best.chunk_sizes)
    return (f"global batch {global_batch}: {k} micro-batch{'es' if k > 1 else ''} of "
            f"{best.batch_size} [{split}] (accumulate {k}), {k * t * 1e3:.2f} ms per global "
            f"batch ({best.time.source.value if best.time else 'unknown'}; each micro-batch timed "
            "as a whole step, optimizer included), the fastest the time fits predict among "
            "equal micro-batches")


def _figure(label: str, split: tuple[int, ...], by_split: dict, budgets: Sequence[int],
            model: Optional[StepModel]) -> SpeedFigure:
    r = by_split.get(split)
    if r is not None and r.time is not None:
        return SpeedFigure(label, split, r.time.step_seconds, r.time.source.value, r.within_budget(budgets))
    t = model.seconds(split) if model is not None else None
    return SpeedFigure(label, split, t, "predicted from fits" if t is not None else "unknown",
                       r is not None and r.within_budget(budgets))


def figures(probes: Sequence[ProbeResult], budgets: Sequence[int], batch: int,
            balanced: ProbeResult, fastest_probe: Optional[ProbeResult] = None,
            model: Optional[StepModel] = None) -> tuple[SpeedFigure, ...]:
    """The even, memory-balanced and (when given) fastest splits' speed figures."""
    by_split = {tuple(r.chunk_sizes): r for r in probes}
    n = len(budgets)
    if model is None:
        model = step_model(probes, n)
    out = [_figure("even", tuple(even_split(batch, n)), by_split, budgets, model),
           _figure("memory-balanced", tuple(balanced.chunk_sizes), by_split, budgets, model)]
    if fastest_probe is not None:
        out.append(_figure("fastest", tuple(fastest_probe.chunk_sizes), by_split, budgets, model))
    return tuple(out)


def speed_notes(figs: Sequence[SpeedFigure], best: ProbeResult, fastest: bool = False
                ) -> tuple[str, ...]:
    """The speed line of a report; for the fastest split, why cards were left out."""
    lines = ["speed: " + "; ".join(f.describe() for f in figs)]
    dropped = [i for i, c in enumerate(best.chunk_sizes) if c == 0]
    if fastest and dropped and len(best.chunk_sizes) > 1:
        lines.append(f"card(s) {', '.join(map(str, dropped))} get no samples: the step is faster "
                     "without them (their time, the host's time to issue their replica, or the "
                     "copies to them, cost more than they add)")
    t = best.time
    if t is not None and t.host_bound:
        lines.append(f"the host sets the step ({t.source.value}: issuing its ops takes "
                     f"{t.host_seconds * 1e3:.2f} ms, the cards' work {t.device_seconds * 1e3:.2f} ms): "
                     "more samples per step cost little, and each card added to DataParallel adds its "
                     "replica's issue time")
    return tuple(lines)


def advice(figs: Sequence[SpeedFigure]) -> list[str]:
    """A warning when the split returned is slower per sample than the even split."""
    chosen, even = figs[-1], figs[0]
    if chosen.samples_per_second is None or even.samples_per_second is None or not even.fits:
        return []
    if chosen.samples_per_second < even.samples_per_second * 0.99:
        return [f"the {chosen.label} split is slower per sample than the even split "
                f"({chosen.samples_per_second:,.0f} against {even.samples_per_second:,.0f} "
                f"samples/s, {chosen.source}): its fullest card sets the step time; "
                "use --objective throughput for the fastest split that fits"]
    return []


def check_global_batch(global_batch: Optional[int], objective: Objective, accumulate: int) -> Optional[int]:
    """``Tuner(global_batch=...)`` checked: an int >= 1, with ``objective="throughput"`` and
    no ``accumulate`` of the user's own (the plan chooses the accumulation)."""
    if global_batch is None:
        return None
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise UsageError(f"global_batch must be an int >= 1, got {global_batch!r}")
    if objective is not Objective.THROUGHPUT:
        raise UsageError("global_batch= is the throughput objective's: use objective='throughput' "
                         "(command line: --objective throughput --global-batch N)")
    if accumulate != 1:
        raise UsageError(f"global_batch={global_batch} chooses the number of micro-batches itself; "
                         f"leave accumulate at 1 (got {accumulate})")
    return global_batch
