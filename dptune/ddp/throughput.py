"""``plan(objective="throughput")``: per-rank batches with the shortest DDP step that fits.

A DDP step ends when the slowest rank's backward has finished and the gradients are
all-reduced, so the step time is ``max_r t_r(b_r) + all-reduce``. Each rank's time is fitted
on its own probes (affine in its batch, :func:`dptune.solve.time.fit_time`: the fixed cost
that makes a small batch inefficient, plus a cost per sample); its batch is capped by its
memory (its fit, below any batch measured over budget); each rank is a process of its own, so
its host's time to issue the step (:mod:`dptune.hardware.speeds`: its ops x the host's cost per op) is a
floor on that rank's step, and the step is at least the largest host time of the ranks plus the
all-reduce. :func:`dptune.solve.time.fastest_split`
with ``every_card=True`` gives the batches that equalise the ranks' step times within their
memory caps; they are probed, and a rank over budget tightens its cap, until every rank is
measured within budget (the loop shared with DataParallel and the length plans:
:func:`dptune.search.throughput_loop.throughput_loop` over :class:`RankCards`).

Each rank's time comes with its probes (:attr:`dptune.search.ranks.RankProbe.seconds`, gathered
with the peaks, so inside a job every rank fits every rank's time from the same figures and
makes the same plan): on the simulated cluster the simulator's estimate (:class:`RankTimer`:
FLOPs and bytes against each card's datasheet peaks, the simulator's one rank timer
:class:`dptune.backends.simulated.timing.RankTimes`), on real cards inside a job the card's
forward and backward measured by CUDA events (:class:`dptune.ddp.probers.CudaProber`).
:class:`ProbeTimes` fits them. The all-reduce is a ring over the simulated link
(:func:`dptune.backends.simulated.timing.ddp_allreduce_seconds`), not overlapped with the backward; on
real cards it is not timed (it is the same for every plan where every rank takes part).
The plan says, per rank, why it got its batch (its memory cap, or an equal step time), and
when leaving a rank out of the job would be faster. Where no time is known (FSDP; inside a job
by default when a rank's step could not be timed), :class:`EqualSpeed` takes the ranks as
equally fast, and :func:`equal_split` gives batches as equal as the caps allow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dptune.ddp.result import RankReason
from dptune.errors import NoFeasibleSplitError
from dptune.search.ranks import beyond_the_ranks
from dptune.search.throughput_loop import fastest_ranks_split, rank_step_model, throughput_loop
from dptune.solve.time import SplitTime, StepModel, TimeFit, fastest_split, fit_time, micro_batch_counts

__all__ = ["RankTimer", "ProbeTimes", "EqualSpeed", "ThroughputPlan", "equal_split",
           "RankCards", "plan_throughput", "speed_note", "untimed_note"]


class RankTimer:
    """Each rank's simulated step time at the batches probed (seconds, estimated): the
    simulator's rank timer (:class:`dptune.backends.simulated.timing.RankTimes`) over the
    ranks' probers. ``probe(r, b)`` runs the rank's prober with the op counter installed."""

    def __init__(self, probers: dict, cluster: Any):
        from dptune.backends.simulated.timing import RankTimes
        from dptune.hardware.speeds import ClusterSpeed

        self.probers = probers
        self.times = RankTimes(cluster.names, ClusterSpeed.of(cluster.names, cluster.spec))
        self.speed = self.times.speed

    def probe(self, r: int, b: int) -> Optional[int]:
        prober = self.probers[r]
        return self.times.counted(prober.backend, r, b, lambda: prober.probe(b))

    def seconds(self, r: int, b: int) -> Optional[float]:
        """Rank r's card work at batch b; ``None`` when not probed. Its host's part:
        :meth:`host_seconds`."""
        return self.times.seconds(r, b)

    def host_seconds(self, r: int, b: int) -> Optional[float]:
        """Rank r's host's time to issue its step at batch b; ``None`` when not probed."""
        return self.times.host_seconds(r, b)


class ProbeTimes:
    """Each rank's step time fitted on the times that came with its probes (affine in its
    batch, :func:`dptune.solve.time.fit_time`). ``source``: ``"estimated"`` (the simulator's)
    or ``"measured"`` (CUDA events); ``link_bandwidth``: the simulated link of the ring
    all-reduce (``None`` on real cards: the all-reduce is not timed)."""

    def __init__(self, state: Any, source: str, link_bandwidth: Optional[float] = None):
        self.state, self.source, self.link_bandwidth = state, source, link_bandwidth

    def fit(self, r: int) -> Optional[TimeFit]:
        return fit_time([(p.batch_size, p.seconds) for p in self.state.of(r)
                         if p.seconds is not None])

    def floor(self, n: int) -> Callable[[frozenset[int]], float]:
        """The step's least time on the ranks ``S``: the slowest host of ``S`` (each rank's
        host time gathered with its probes: estimated ones only; a measured step's time
        already holds its host's)."""
        hosts = [max((p.host_seconds for p in self.state.of(r) if p.host_seconds is not None),
                     default=0.0) for r in range(n)]
        return lambda used: max((hosts[r] for r in used), default=0.0)

    def allreduce(self, grad_bytes: int) -> Callable[[frozenset[int]], float]:
        from dptune.backends.simulated.timing import ddp_allreduce_seconds

        bw = self.link_bandwidth
        if bw is None:
            return lambda used: 0.0
        return lambda used: ddp_allreduce_seconds(grad_bytes, len(used), bw)

    def untimed(self) -> list[Any]:
        """The probes whose step ran (a peak) but came without a time."""
        return [p for p in self.state.probes if p.peak_bytes is not None and p.seconds is None]


def untimed_note(probes: Sequence[Any]) -> str:
    """What could not be timed, the same words on every rank (from the gathered probes)."""
    ranks = sorted({p.rank for p in probes})
    first = probes[0]
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: the step was not "
            f"timed (rank {first.rank} at batch {first.batch_size}: the CUDA events saw no forward "
            "and backward of the model on its card, a step that does not call the model or a "
            "runtime without events)")


class EqualSpeed:
    """Where no step time is known (FSDP; a rank inside a job whose step was not timed), the
    ranks taken as equally fast: one unit of time per sample, no fixed cost, no all-reduce.
    The fastest split is then the one whose largest batch is smallest: batches as equal as
    the memory caps allow."""

    source = "assumed"

    def fit(self, r: int) -> TimeFit:
        return TimeFit(0.0, 1.0)

    def allreduce(self, grad_bytes: int) -> Callable[[frozenset[int]], float]:
        return lambda used: 0.0

    def floor(self, n: int) -> Callable[[frozenset[int]], float]:
        return lambda used: 0.0


def equal_split(caps: Sequence[int], batch: int, min_batch: int = 1) -> Optional[SplitTime]:
    """``batch`` over ranks capped at ``caps`` (each at least ``min_batch``) with the smallest
    largest batch, as equal as the caps allow: every rank at ``min(cap, L)`` for the least
    level ``L`` that holds the batch, one sample fewer for what is over on the ranks at ``L``
    with the smallest caps, then the last ones (ties favour the larger rank; equal ranks end
    within one sample, the first ones taking the remainder as equal batches do). ``None``: it
    does not fit.
    Its ``step_seconds`` is the largest batch (one unit per sample, see :class:`EqualSpeed`)."""
    if any(c < min_batch for c in caps) or sum(caps) < batch or batch < min_batch * len(caps):
        return None
    lo, hi = min_batch, max(caps)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(min(c, mid) for c in caps) >= batch:
            hi = mid
        else:
            lo = mid + 1
    sizes = [min(c, lo) for c in caps]
    extra = sum(sizes) - batch
    # ties favour the larger rank: the smallest caps give a sample first, then the last ranks
    for r in sorted(range(len(sizes)), key=lambda r: (caps[r], -r)):
        if extra and sizes[r] == lo and lo > min_batch:
            sizes[r] -= 1
            extra -= 1
    return SplitTime(tuple(sizes), float(max(sizes)))


@dataclass(frozen=True)
class ThroughputPlan:
    sizes: list[int]
    step: SplitTime                   # predicted by the fits (one micro-batch)
    reasons: tuple[str, ...]          # per rank, why it got its batch
    notes: tuple[str, ...]
    labels: tuple[RankReason, ...] = ()   # per rank, the reason in short
    micro_batches: int = 1            # the global batch as that many equal micro-batches


class RankCards:
    """A DDP job's ranks for :func:`dptune.search.throughput_loop.throughput_loop`: independent
    ranks, the step is the slowest rank plus the all-reduce
    (:func:`dptune.search.throughput_loop.rank_step_model`; with :class:`EqualSpeed`, one unit
    of time per sample); a split is probed as one round, each rank not yet measured at its
    batch probing it. The budget: ``max_rounds`` rounds in all."""

    def __init__(self, state: Any, run: Callable[[Sequence[Optional[int]]], None],
                 timer: "ProbeTimes | EqualSpeed", global_batch: int, max_rounds: int,
                 grad_bytes: int, cap_of: Callable[[Any, int], int], accumulate: bool):
        self.state, self.run, self.timer, self.global_batch = state, run, timer, global_batch
        self.max_rounds, self.cap_of, self.accumulate = max_rounds, cap_of, accumulate
        self.overhead = timer.allreduce(grad_bytes)
        self.hosts = timer.floor(state.n)

    def model(self, fits: Sequence[TimeFit]) -> StepModel:
        return rank_step_model(fits, self.hosts, self.overhead)

    def curves(self) -> tuple[list[int], list[list[float]], StepModel]:
        """Each rank's memory cap, its fitted time at every batch up to it, and the model."""
        caps, fits = _caps(self.state, self.cap_of, self.global_batch), _fits(self.state, self.timer)
        return caps, [[f.predict(c) for c in range(cap + 1)] for f, cap in zip(fits, caps)], self.model(fits)

    def spent(self) -> bool:
        return self.state.rounds >= self.max_rounds

    def solve(self) -> tuple[SplitTime, int]:
        """The fastest split of one micro-batch and the number of micro-batches; raises
        :class:`NoFeasibleSplitError` where nothing fits."""
        state, global_batch, accumulate = self.state, self.global_batch, self.accumulate
        caps, curves, model = self.curves()
        solved = _solve(self.timer, caps, curves, global_batch, model, state.m, accumulate)
        if solved is None:
            known = [c for c in state.caps() if c is not None]
            if not accumulate and len(known) == state.n and sum(known) < global_batch:
                raise beyond_the_ranks(state, self.run, global_batch, self.max_rounds)  # more than they hold
            raise NoFeasibleSplitError(
                f"no number of micro-batches that divides the global batch {global_batch} gives "
                f"per-rank batches that fit every rank's memory (largest per rank: {caps}); try "
                "another global_batch" if accumulate else
                f"no per-rank batches of the global batch {global_batch} fit every rank's memory "
                f"(largest per rank: {caps}); try a smaller global_batch", shortfall_bytes=None)
        return solved

    def _measured(self, answer: tuple[SplitTime, int]) -> list[Any]:
        return [self.state.measured(r, b) for r, b in enumerate(answer[0].chunk_sizes)]

    def settled(self, answer: tuple[SplitTime, int]) -> bool:
        return all(p is not None and p.fits for p in self._measured(answer))

    def probe(self, answer: tuple[SplitTime, int]) -> None:
        self.run([None if d is not None else b
                  for d, b in zip(self._measured(answer), answer[0].chunk_sizes)])


def plan_throughput(state: Any, run: Callable[[Sequence[Optional[int]]], None],
                    timer: "ProbeTimes | EqualSpeed",
                    global_batch: int, max_rounds: int, grad_bytes: int,
                    cap_of: Callable[[Any, int], int], accumulate: bool = False) -> ThroughputPlan:
    """Solve, probe, tighten caps until the batches are measured within every budget
    (:func:`dptune.search.throughput_loop.throughput_loop` over :class:`RankCards`).

    ``state``: the ranks' :class:`dptune.search.ranks.RankObservations` after the first two
    rounds; ``run(sizes)`` probes one round; ``cap_of(fit, budget)`` the memory cap of a fit;
    ``timer``: the ranks' step times (estimated or measured), or :class:`EqualSpeed` where
    there are none. ``accumulate``: ``global_batch`` is trained as ``k`` equal micro-batches
    (``k`` divides it), ``k`` and the split of a micro-batch chosen together for the least
    time per global batch (:func:`dptune.solve.time.fastest_accumulation`; without times, the
    fewest micro-batches whose batches fit).
    """
    cards = RankCards(state, run, timer, global_batch, max_rounds, grad_bytes, cap_of, accumulate)
    end = throughput_loop(cards)
    sol, k = end.answer if end.answer is not None else cards.solve()
    sizes = list(sol.chunk_sizes)
    if not all((p := state.measured(r, b)) is not None and p.fits for r, b in enumerate(sizes)):
        raise NoFeasibleSplitError(
            f"the fastest batches {sizes} were not all measured within budget in {state.rounds} "
            "rounds; try a larger max_rounds or objective='balance'", shortfall_bytes=None)
    caps, curves, model = cards.curves()
    acc = _accumulation_note(global_batch, k, sizes, sol, timer.source) if accumulate else ()
    if isinstance(timer, EqualSpeed):
        labels, lines = _equal_reasons(sizes, caps)
        return ThroughputPlan(sizes, sol, lines, (EQUAL_NOTE,) + acc, labels, k)
    labels, lines = _reasons(sizes, caps, curves)
    notes = _notes(curves, sizes, sum(sizes), model, state.m, sol, timer.source)
    return ThroughputPlan(sizes, sol, lines, notes + acc + _source_notes(timer), labels, k)


def _fits(state: Any, timer: "ProbeTimes | EqualSpeed") -> list[TimeFit]:
    """Each rank's fitted step time (raises where a rank has none)."""
    fits = [timer.fit(r) for r in range(state.n)]
    if any(f is None for f in fits):
        raise NoFeasibleSplitError("a rank's step time is unknown (no timed probe); "
                                   "objective='throughput' needs each rank's step time",
                                   shortfall_bytes=None)
    return fits  # type: ignore[return-value]


def _solve(timer: "ProbeTimes | EqualSpeed", caps: Sequence[int], curves: list, batch: int,
           model: StepModel, m: int, accumulate: bool) -> Optional[tuple[SplitTime, int]]:
    """The fastest split of ``batch`` (one micro-batch), or with ``accumulate`` the number of
    micro-batches and the split of one; ``None``: nothing fits. ``model``: the ranks' step
    (their slowest host, then the all-reduce, :func:`dptune.search.throughput_loop.rank_step_model`)."""
    if isinstance(timer, EqualSpeed):     # one unit per sample: the largest batch, k times
        best: Optional[tuple[SplitTime, int]] = None
        for k in micro_batch_counts(batch) if accumulate else [1]:
            s = equal_split(caps, batch // k, m)
            if s is not None and (best is None or k * s.step_seconds < best[1] * best[0].step_seconds):
                best = (s, k)
        return best
    return fastest_ranks_split(model, curves, batch, m, accumulate)


def _accumulation_note(batch: int, k: int, sizes: Sequence[int], sol: SplitTime,
                       source: str) -> tuple[str, ...]:
    head = (f"global batch {batch} per optimizer step: {k} micro-batch{'es' if k > 1 else ''} of "
            f"{batch // k} (per rank {list(sizes)})")
    if source == "assumed":
        return (head + ": the fewest micro-batches whose batches fit every rank (no step time "
                "known); plan.scale_loss divides each micro-batch's loss by " + f"{k}",)
    total = k * sol.step_seconds
    return (f"{head}, {total * 1e3:.2f} ms per global batch ({source}), {batch / total:,.0f} "
            "samples/s: the number of micro-batches and the split that finish it fastest "
            "within every rank's memory cap (each micro-batch modelled as a whole step, its "
            f"all-reduce included: an upper bound with no_sync); plan.scale_loss divides each "
            f"micro-batch's loss by {k}",)


EQUAL_NOTE = ("no step time is known here (FSDP, or a rank whose step was not timed): the ranks "
              "are taken as equally fast, so the batches are as equal as the memory caps allow "
              "(objective='balance' gives the same share of memory on every rank instead)")


def _source_notes(timer: ProbeTimes) -> tuple[str, ...]:
    if timer.source != "measured":
        return ()
    return ("step times measured on each rank's card: its forward and backward from CUDA events "
            "on its stream (the median of the measured steps after a warm-up), gathered from "
            "every rank and fitted per rank; the all-reduce is not timed (the same for every "
            "plan where every rank takes part)",)


def _equal_reasons(sizes: Sequence[int], caps: Sequence[int]
                   ) -> tuple[tuple[RankReason, ...], tuple[str, ...]]:
    labels, lines = [], []
    for r, b in enumerate(sizes):
        if b >= caps[r] and b < max(sizes):
            labels.append(RankReason.MEMORY_CAP)
            lines.append(f"rank {r}: batch {b}: its memory cap (the largest batch that fits, "
                         f"{caps[r]})")
        else:
            labels.append(RankReason.EQUAL)
            lines.append(f"rank {r}: batch {b}: an equal share (the ranks taken as equally fast)")
    return tuple(labels), tuple(lines)


def _caps(state: Any, cap_of: Callable[[Any, int], int], global_batch: int) -> list[int]:
    """Each rank's largest batch: its memory fit's (through the probes nearest the edge, a
    secant once a batch was measured over), inside the bracket of the batches measured within
    budget and over; every second round of a rank over budget, the bracket's middle."""
    caps = []
    for r in range(state.n):
        lo, hi = state.lo(r), state.hi(r)
        cap = min(global_batch, cap_of(state.fit(r, lo if hi is None else hi), state.budgets[r]))
        if hi is not None:
            cap = min(cap, hi - 1)
            if sum(not p.fits for p in state.of(r)) % 2 == 0:
                cap = min(cap, (lo + hi) // 2)
        caps.append(max(cap, lo if lo <= global_batch else 0))
    return caps


def _reasons(sizes: Sequence[int], caps: Sequence[int], curves: Sequence[Sequence[float]]
             ) -> tuple[tuple[RankReason, ...], tuple[str, ...]]:
    """Per rank, why it got its batch: in short (the plan's column) and in full (a note)."""
    slowest = max(curves[r][b] for r, b in enumerate(sizes))
    labels, out = [], []
    for r, b in enumerate(sizes):
        t = curves[r][b] * 1e3
        if b >= caps[r]:
            label = RankReason.MEMORY_CAP
            why = f"its memory cap (the largest batch that fits, {caps[r]}); its step {t:.2f} ms"
        elif curves[r][b] >= slowest * (1 - 1e-9):
            label, why = RankReason.STEP_TIME, f"it sets the step time ({t:.2f} ms)"
        elif curves[r][b + 1] > slowest:
            label = RankReason.TIME_BALANCE
            why = (f"one more sample would make it the slowest rank ({t:.2f} ms now, "
                   f"{slowest * 1e3:.2f} ms the step's slowest)")
        else:
            label = RankReason.REST
            why = (f"the rest of the global batch ({t:.2f} ms): the slowest rank "
                   f"({slowest * 1e3:.2f} ms) is at its smallest batch")
        labels.append(label)
        out.append(f"rank {r}: batch {b}: {why}")
    return tuple(labels), tuple(out)


def _notes(curves: Sequence[Sequence[float]], sizes: Sequence[int], batch: int,
           model: StepModel, m: int, sol: SplitTime, source: str) -> tuple[str, ...]:
    n = len(sizes)
    overhead, floor = model.overhead, model.host      # the all-reduce; the slowest host, then it
    lines = []
    even = [batch // n + (1 if r < batch % n else 0) for r in range(n)]
    if all(b <= len(c) - 1 for b, c in zip(even, curves)):
        every = frozenset(range(n))
        t_even = max(floor(every), overhead(every) + max(curves[r][b] for r, b in enumerate(even)))
        lines.append(f"speed ({source}): equal batches {even}: {t_even * 1e3:.2f} ms, "
                     f"{batch / t_even:,.0f} samples/s; this plan {sol.step_seconds * 1e3:.2f} ms, "
                     f"{sol.samples_per_second:,.0f} samples/s")
    else:
        lines.append(f"speed ({source}): this plan {sol.step_seconds * 1e3:.2f} ms, "
                     f"{sol.samples_per_second:,.0f} samples/s; equal batches {even} do not fit")
    used = frozenset(r for r, b in enumerate(sizes) if b > 0)
    slowest = max(curves[r][b] for r, b in enumerate(sizes) if b > 0)
    if floor(used) > overhead(used) + slowest:
        lines.append(f"the ranks' hosts set the step (issuing its ops takes "
                     f"{(floor(used) - overhead(used)) * 1e3:.2f} ms, longer than any rank's card "
                     f"work, {slowest * 1e3:.2f} ms): a larger batch would cost little more per step")
    subset = fastest_split(curves, batch, overhead=overhead, min_chunk=m, host=floor)
    if subset is not None and subset.dropped and subset.step_seconds < sol.step_seconds * 0.98:
        left = ", ".join(str(r) for r in subset.dropped)
        kept = [b for b in subset.chunk_sizes if b > 0]
        lines.append(f"faster without rank(s) {left}: a job of {n - len(subset.dropped)} ranks with "
                     f"batches {kept} takes {subset.step_seconds * 1e3:.2f} ms per step "
                     f"({subset.samples_per_second:,.0f} samples/s): leave that card out of the job")
    return tuple(lines)


def speed_note(timer: ProbeTimes, sizes: Sequence[int], grad_bytes: int) -> tuple[str, ...]:
    """A plan of another objective: its speed against equal batches (each rank's time fitted
    on its probes), and a warning when it is slower."""
    n = len(sizes)
    fits = [timer.fit(r) for r in range(n)]
    if any(f is None for f in fits):
        return ()
    overhead = timer.allreduce(grad_bytes)(frozenset(range(n)))
    host = timer.floor(n)(frozenset(range(n)))
    batch = sum(sizes)
    t_plan = overhead + max(host, *(f.predict(b) for f, b in zip(fits, sizes)))  # type: ignore[union-attr]
    even = [batch // n + (1 if r < batch % n else 0) for r in range(n)]
    t_even = overhead + max(host, *(f.predict(b) for f, b in zip(fits, even)))  # type: ignore[union-attr]
    line = (f"speed ({timer.source}): this plan {t_plan * 1e3:.2f} ms per step, {batch / t_plan:,.0f} "
            f"samples/s; equal batches {even}: {t_even * 1e3:.2f} ms, {batch / t_even:,.0f} samples/s"
            " (whether they fit was not checked)")
    if t_plan > t_even * 1.01:
        line += ("; this plan is slower per sample: its fullest rank sets the step time "
                 "(objective='throughput' gives the fastest batches that fit)")
    return (line,)
