"""DDP ranks per length bucket on the simulated cluster, timed; their fastest batches.

:class:`DDPRanks` is the probe interface over DDP ranks that :func:`dptune.search.run` takes
(rank ``r`` runs its own step at ``split[r]``, nothing gathered), and every probe carries the
DDP step's estimated time (:class:`dptune.types.StepTime`): each rank's card work (the
simulator's op counter against that card's datasheet peaks, the batch's copy from the host),
each rank's host issue time (its ops x the host's cost per op: every rank is a process of its
own), and the ring all-reduce of the gradient buckets over the simulated link
(:func:`dptune.backends.simulated.timing.ddp_allreduce_seconds`, not overlapped with the backward). The
step is modelled as :mod:`dptune.ddp.throughput` models it::

    T(b) = all-reduce + max(slowest rank's host, max_r card_r(b_r))

:func:`fastest_ranks` (``objective="throughput"`` with ``ddp=True``) gives a bucket the
per-rank batches with the most tokens per second: each rank's batch at most its memory cap
at that length (the largest batch measured within its budget: a rank's memory depends only
on its own batch), at least the smallest batch (DDP needs every rank in every step), its
time fitted affine on the bucket's probes (:func:`dptune.solve.time.fit_time`), the
split solved by :func:`dptune.solve.time.fastest_split` (``every_card=True``, the batch
free), probed, and solved again with the new point until the answer was probed (the loop
shared with DataParallel and the DDP plans: :func:`dptune.search.throughput_loop.throughput_loop`
over :class:`BucketRanks`; the step's model :func:`dptune.search.throughput_loop.rank_step_model`;
the ranks' times kept by the simulator's one rank timer,
:class:`dptune.backends.simulated.timing.RankTimes`). The answer
is the probe measured within every budget with the most samples per second (the length is
the bucket's: tokens per second in proportion).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.budget import BudgetLevel, at_level
from dptune.search.throughput_loop import fastest_ranks_split, rank_step_model, throughput_loop
from dptune.solve.time import SplitTime, TimeFit, fit_time
from dptune.types import StepTime, TimeSource

__all__ = ["DDPRanks", "BucketRanks", "fastest_ranks", "ddp_step_seconds"]


def ddp_step_seconds(card: Sequence[float], host: Sequence[float], allreduce: float) -> float:
    """The DDP step of ranks whose card work is ``card[r]`` and host time ``host[r]``."""
    return allreduce + max(max(card, default=0.0), max(host, default=0.0))


class DDPRanks:
    """DDP ranks on the simulated cluster, one per card, for :func:`dptune.search.run`.

    A rank given no samples costs nothing here (DDP needs every rank: an answer with an empty
    rank is refused by the caller). With ``reserved`` (an allocator model) each rank's peak
    is at the reserved level: its own probe's trace replayed, NCCL's buffers as for a world of
    all the ranks; the allocated peaks are kept in ``allocated_peak_bytes``, as
    :func:`dptune.budget.at_level` does. Each probe's ``time``: see the module
    docstring (estimated).
    """

    kind = "simulated"

    def __init__(self, workload: Any, cluster: Any, reserved: Any = None):
        from dptune.backends.simulated.ddp import SimulatedDDP
        from dptune.backends.simulated.timing import RankTimes
        from dptune.hardware.speeds import ClusterSpeed

        self.sim = SimulatedDDP(workload, cluster, reserved=reserved)
        self.devices = self.sim.devices
        # per card type, length and batch: the step's ops, timed against each rank's speed
        self.times = RankTimes(self.sim.cluster.names,
                               ClusterSpeed.of(self.sim.cluster.names, self.sim.cluster.spec))
        self.speed = self.times.speed

    def describe(self) -> str:
        return self.sim.describe()

    def _length(self) -> Any:
        return getattr(self.sim.workload.sample, "length", None)

    def _peaks(self, r: int, b: int) -> tuple[int, int]:
        """Rank ``r``'s (allocated, budget-level) peaks at local batch ``b``; its time kept."""
        if b <= 0:
            return 0, 0
        rank = self.sim.rank(r)

        def step() -> tuple[int, int]:
            if self.sim.reserved is None:
                peak = rank.estimate([b]).peak_bytes[0]
                return peak, peak
            p = at_level(rank.probe([b]), [self.devices[r]], BudgetLevel.RESERVED)
            return p.allocated_peak_bytes[0], p.peak_bytes[0]   # type: ignore[index]

        return self.times.counted(rank, r, b, step, key=self._length())

    def _rank_seconds(self, r: int, b: int) -> Optional[tuple[float, float]]:
        """Rank ``r``'s card work and host time at batch ``b``, against its own card's speed
        (two cards of one type may be given different speeds); ``None``: not probed."""
        if b <= 0:
            return 0.0, 0.0
        card = self.times.seconds(r, b, key=self._length())
        host = self.times.host_seconds(r, b, key=self._length())
        return None if card is None or host is None else (card, host)

    def grad_bytes(self) -> int:
        """Bytes of the gradient buckets a step all-reduces (rank 0's: every rank's the same)."""
        return self.sim.rank(0).ddp_bytes()

    def step_time(self, split: Sequence[int]) -> Optional[StepTime]:
        """The DDP step's estimated time at ``split`` (``None``: a rank's step was not timed)."""
        from dptune.backends.simulated.timing import ddp_allreduce_seconds

        got = [self._rank_seconds(r, b) for r, b in enumerate(split)]
        if any(t is None for t in got):
            return None
        card = tuple(t[0] for t in got)          # type: ignore[index]
        host = tuple(t[1] for t in got)          # type: ignore[index]
        used = sum(1 for b in split if b > 0)
        reduce = ddp_allreduce_seconds(self.grad_bytes(), used, self.speed.link.bandwidth)
        return StepTime(card_seconds=card, step_seconds=ddp_step_seconds(card, host, reduce),
                        source=TimeSource.ESTIMATED, transfer_seconds=reduce,
                        host_seconds=max(host, default=0.0), card_host_seconds=host)

    def probe(self, split: Sequence[int]) -> ProbeResult:
        both = [self._peaks(r, b) for r, b in enumerate(split)]
        peaks = [p for _, p in both]
        over = [(p - d.available_bytes) / d.available_bytes for p, d in zip(peaks, self.devices)]
        worst = max(range(len(over)), key=lambda i: over[i])
        return ProbeResult(tuple(split), tuple(peaks), oom_device=worst if over[worst] > 0 else None,
                           note="simulated DDP", time=self.step_time(split),
                           allocated_peak_bytes=(
                               None if self.sim.reserved is None else tuple(a for a, _ in both)))

    def close(self) -> None:
        self.sim.close()


def _caps(probes: Sequence[ProbeResult], budgets: Sequence[int]) -> list[int]:
    """Each rank's largest batch measured within its budget (its memory depends on its own
    batch only, and grows with it): 0 where none was."""
    caps = [0] * len(budgets)
    for p in probes:
        for r, (c, peak) in enumerate(zip(p.chunk_sizes, p.peak_bytes)):
            if c > caps[r] and peak <= budgets[r] and p.oom_device != r:
                caps[r] = c
    return caps


def _fits(probes: Sequence[ProbeResult], n: int) -> Optional[list[TimeFit]]:
    """Each rank's card time, affine in its batch, from the timed probes (``None``: a rank
    has no timed point)."""
    timed = [p for p in probes if p.time is not None and len(p.time.card_seconds) == n]
    fits = [fit_time([(p.chunk_sizes[r], p.time.card_seconds[r]) for p in timed])  # type: ignore[union-attr]
            for r in range(n)]
    return None if any(f is None for f in fits) else fits  # type: ignore[return-value]


def _hosts(probes: Sequence[ProbeResult], n: int) -> list[float]:
    """Each rank's host time (its step's ops do not depend on its batch): the largest seen."""
    out = [0.0] * n
    for p in probes:
        if p.time is not None and len(p.time.card_host_seconds) == n:
            out = [max(a, b) for a, b in zip(out, p.time.card_host_seconds)]
    return out


def _solve(probes: Sequence[ProbeResult], budgets: Sequence[int], m: int,
           allreduce: Callable[[frozenset[int]], float]) -> Optional[SplitTime]:
    """The model's batches with the most samples per second, every rank within its cap."""
    n = len(budgets)
    fits, caps = _fits(probes, n), _caps(probes, budgets)
    if fits is None or any(c < m for c in caps):
        return None
    hosts = _hosts(probes, n)
    model = rank_step_model(fits, lambda used: max(hosts[r] for r in used), allreduce)
    curves = [[f.predict(c) for c in range(cap + 1)] for f, cap in zip(fits, caps)]
    solved = fastest_ranks_split(model, curves, None, m)
    return None if solved is None else solved[0]


class BucketRanks:
    """A length bucket's DDP ranks for :func:`dptune.search.throughput_loop.throughput_loop`:
    independent ranks (:func:`dptune.search.throughput_loop.rank_step_model`), each capped at
    its largest batch measured within budget, the batch free; a split is probed as one step
    of every rank. At most ``max_probes`` probes."""

    def __init__(self, probes: Sequence[ProbeResult], probe: Callable[[Sequence[int]], ProbeResult],
                 budgets: Sequence[int], min_chunk: int,
                 allreduce: Callable[[frozenset[int]], float], max_probes: int):
        self.known = list(probes)
        self.seen = {tuple(p.chunk_sizes) for p in self.known}
        self.probe_split, self.budgets, self.min_chunk = probe, budgets, min_chunk
        self.allreduce, self.left = allreduce, max_probes

    def spent(self) -> bool:
        return self.left <= 0

    def solve(self) -> Optional[SplitTime]:
        return _solve(self.known, self.budgets, self.min_chunk, self.allreduce)

    def settled(self, answer: SplitTime) -> bool:
        return answer.chunk_sizes in self.seen

    def probe(self, answer: SplitTime) -> None:
        self.left -= 1
        p = dataclasses.replace(self.probe_split(list(answer.chunk_sizes)), purpose=(
            f"throughput: the DDP ranks' fastest predicted ({answer.step_seconds * 1e3:.2f} ms)"))
        self.known.append(p)
        self.seen.add(tuple(p.chunk_sizes))


def _rate(p: ProbeResult) -> float:
    return p.batch_size / p.time.step_seconds if p.time is not None and p.time.step_seconds > 0 else 0.0


def _ok(p: ProbeResult, budgets: Sequence[int], m: int) -> bool:
    return (p.time is not None and p.feasible and all(c >= m for c in p.chunk_sizes)
            and all(x <= b for x, b in zip(p.peak_bytes, budgets)))


def fastest_ranks(outcome: Any, probe: Callable[[Sequence[int]], ProbeResult],
                  budgets: Sequence[int], min_chunk: int, grad_bytes: int, link_bandwidth: float,
                  max_probes: int = 6, length: int = 0) -> tuple[Any, tuple[str, ...]]:
    """The bucket's search ``outcome`` with its answer replaced by the per-rank batches with
    the most samples per second (see the module docstring), and a note on them (with the
    padded tokens per second at ``length``, when given). At most ``max_probes`` more probes;
    without step times the outcome is returned as it was."""
    from dptune.backends.simulated.timing import ddp_allreduce_seconds

    def allreduce(used: frozenset[int]) -> float:
        return ddp_allreduce_seconds(grad_bytes, len(used), link_bandwidth)

    ranks = BucketRanks(outcome.probes, probe, budgets, min_chunk, allreduce, max_probes)
    throughput_loop(ranks)
    known = ranks.known
    ok = [p for p in known if _ok(p, budgets, min_chunk)]
    if not ok:
        return outcome, ("no DDP probe carries a step time: the largest batches are kept",)
    best = max(ok, key=lambda p: (_rate(p), p.batch_size))
    caps = _caps(known, budgets)
    return (dataclasses.replace(outcome, best=best, probes=tuple(known)),
            (_note(best, outcome.best, caps, length),))


def _note(best: ProbeResult, largest: ProbeResult, caps: Sequence[int], length: int) -> str:
    """The fastest batches beside the largest, and the ranks held below their memory cap."""
    t = best.time
    assert t is not None
    tokens = f" ({_rate(best) * length:,.0f} padded tokens/s)" if length else ""
    line = (f"DDP ranks' fastest batches {list(best.chunk_sizes)}: step {t.step_seconds * 1e3:.2f} ms "
            f"({t.source.value}), {_rate(best):,.0f} samples/s{tokens}")
    if largest.time is not None and tuple(largest.chunk_sizes) != tuple(best.chunk_sizes):
        line += (f"; the largest batches {list(largest.chunk_sizes)}: "
                 f"{largest.time.step_seconds * 1e3:.2f} ms, {_rate(largest):,.0f} samples/s")
    held = [f"rank {r} {c} of {cap}" for r, (c, cap) in enumerate(zip(best.chunk_sizes, caps))
            if c < cap]
    if held:
        line += ("; below their memory cap (a larger batch would lengthen the step more than it "
                 "adds): " + ", ".join(held))
    return line
