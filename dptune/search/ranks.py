"""The certified search for independent ranks (DDP, FSDP): every rank's brackets from its own
probes.

Under DDP a rank's memory depends only on its own batch (nothing is gathered on rank 0), so
each rank is a card of its own: a batch measured within budget fits every smaller one, a
batch measured over is over at every larger one, and each rank's cap is kept as a
:class:`dptune.search.observations.Bracket` ``[lo, hi)``. A round probes (at most) one batch
per rank; who runs the rounds (one process for every rank, or each rank of a
``torch.distributed`` job with the results gathered) is the caller's (``run(sizes)``, see
:mod:`dptune.ddp.planner`). Only batches measured within every budget are returned.

- :class:`RankObservations`: every rank's probes, its bracket, its local affine fit;
- :func:`balance_ranks`: the split of a global batch with the same share of budget on
  every rank (fits propose, probes decide);
- :func:`bracket_ranks`: each rank's largest batch (secant and bisection steps alternating,
  until every bracket is closed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

from dptune.errors import NoFeasibleSplitError
from dptune.search.observations import (Bracket, fall_limit, first_fall, on_one_step, round_middle,
                                        roundest, roundest_near, step_end, step_start)
from dptune.solve.memory import MIN_SLOPE_BYTES, Fit, fit_affine, solve_balance
from dptune.units import format_bytes

__all__ = ["RankProbe", "RankObservations", "Runner", "cap_of", "balance_ranks", "bracket_ranks",
           "beyond_the_ranks"]

#: Probes one round: rank r probes ``sizes[r]`` (``None``: it sits the round out).
Runner = Callable[[Sequence[Optional[int]]], None]


@dataclass(frozen=True)
class RankProbe:
    """One measured step of one rank: its batch, its peak (bytes), whether it fitted its budget,
    and its step time when the planner timed it (seconds: the rank's forward and backward,
    measured by CUDA events or estimated by the simulator; ``None`` when not timed).

    ``peak_bytes`` is ``None`` when the step ran out of memory on a real card (then only the
    fact is known)."""

    rank: int
    batch_size: int
    peak_bytes: Optional[int]
    fits: bool
    round: int = 0
    seconds: Optional[float] = None
    host_seconds: Optional[float] = None     # the host's time to issue the step (estimated)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(rank=self.rank, batch_size=self.batch_size,
                                 peak_bytes=self.peak_bytes, fits=self.fits, round=self.round)
        if self.seconds is not None:
            d["seconds"] = self.seconds
        if self.host_seconds is not None:
            d["host_seconds"] = self.host_seconds
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RankProbe":
        return cls(rank=int(d["rank"]), batch_size=int(d["batch_size"]),
                   peak_bytes=None if d.get("peak_bytes") is None else int(d["peak_bytes"]),
                   fits=bool(d["fits"]), round=int(d.get("round", 0)),
                   seconds=None if d.get("seconds") is None else float(d["seconds"]),
                   host_seconds=None if d.get("host_seconds") is None else float(d["host_seconds"]))


class RankObservations:
    """What every rank knows: each rank's budget and every probe so far."""

    def __init__(self, budgets: Sequence[int], min_batch: int):
        self.budgets = list(budgets)
        self.n = len(self.budgets)
        self.m = min_batch
        self.probes: list[RankProbe] = []
        self.rounds = 0

    def of(self, r: int) -> list[RankProbe]:
        return [p for p in self.probes if p.rank == r]

    def measured(self, r: int, b: int) -> Optional[RankProbe]:
        for p in self.of(r):
            if p.batch_size == b:
                return p
        return None

    def lo(self, r: int) -> int:
        return max([p.batch_size for p in self.of(r) if p.fits], default=0)

    def hi(self, r: int) -> Optional[int]:
        over = [p.batch_size for p in self.of(r) if not p.fits]
        return min(over) if over else None

    def not_monotone(self) -> Optional[str]:
        """Where a rank's probes contradict the monotone surface its certificate rests on: a
        batch measured within budget above one measured over (the reserved level can do this:
        fragmentation decides whether a freed block is reused), or a rank's peak falling as
        its batch grows by more than :func:`~dptune.search.observations.fall_limit` (see
        :meth:`dptune.search.observations.Observations.fragmented`). ``None`` when none does."""
        for r in range(self.n):
            hi = self.hi(r)
            if hi is not None and self.lo(r) > hi:
                return f"rank {r} fits at {self.lo(r)} samples and is over at {hi}"
        for r in range(self.n):
            pts = [(p.batch_size, p.peak_bytes) for p in self.of(r) if p.peak_bytes is not None]
            fall = first_fall([((b,), f) for b, f in pts], fall_limit(self.budgets[r]))
            if fall is not None:
                (b0, p0), (b1, p1) = (pts[k] for k in fall)
                return (f"rank {r} reads {format_bytes(p0)} at {b0} samples and "
                        f"{format_bytes(p1)} at {b1}: its figure falls as its batch grows")
        return None

    def bracket(self, r: int) -> Bracket:
        """Rank r's cap: the largest batch measured within budget, the smallest over."""
        return Bracket(card=r, lo=self.lo(r), hi=self.hi(r), min_chunk=self.m)

    def caps(self) -> list[Optional[int]]:
        return [None if (h := self.hi(r)) is None else h - 1 for r in range(self.n)]

    def all_fit(self, sizes: Sequence[int]) -> bool:
        """Every rank measured within budget at its batch of ``sizes``."""
        return all((p := self.measured(r, b)) is not None and p.fits for r, b in enumerate(sizes))

    def fit(self, r: int, near: int) -> Fit:
        """An affine fit of rank r's peak on the two probes nearest ``near`` (a known-over
        point with no peak stands for the budget there)."""
        pts = {p.batch_size: float(p.peak_bytes) for p in self.of(r) if p.peak_bytes is not None}
        for p in self.of(r):
            if p.peak_bytes is None and p.batch_size not in pts:
                pts[p.batch_size] = float(self.budgets[r])
        order = sorted(pts, key=lambda b: (abs(b - near), -b))
        # the nearest point and the nearest with another peak: at the reserved level peaks are
        # a staircase (segments, 2 MiB rounding), whose flat steps would make a flat line
        other = [b for b in order[1:] if pts[b] != pts[order[0]]]
        chosen = order[:1] + other[:1] if other else order[:2]
        if len(chosen) < 2:
            b = chosen[0]
            return Fit(intercept_bytes=pts[b] - MIN_SLOPE_BYTES * b, slope_bytes=MIN_SLOPE_BYTES, points=1)
        return fit_affine([(b, pts[b]) for b in chosen])

    def run(self, each: Callable[[Callable[[int], Optional[RankProbe]]], list[Optional[RankProbe]]],
            sizes: Sequence[Optional[int]], probe: Callable[[int, int], Optional[int]],
            timed: Optional[Callable[[int, int], Optional[float]]] = None,
            hosted: Optional[Callable[[int, int], Optional[float]]] = None) -> None:
        """One round: rank r probes ``sizes[r]`` (``None``: it sits this round out);
        ``each(fn)`` runs ``fn(rank)`` for every rank and returns the results in rank order
        (on every rank); ``probe(r, b)`` is rank r's peak at batch b (``None``: out of memory);
        ``timed(r, b)``, when given, rank r's step time in the probe just run (gathered with
        the peak, so every rank gets every rank's time); ``hosted(r, b)``, likewise, its host's
        time to issue that step (the simulator's estimate)."""
        self.rounds += 1
        rnd = self.rounds

        def one(r: int) -> Optional[RankProbe]:
            b = sizes[r]
            if b is None:
                return None
            peak = probe(r, b)
            return RankProbe(rank=r, batch_size=b, peak_bytes=peak,
                             fits=peak is not None and peak <= self.budgets[r], round=rnd,
                             seconds=None if timed is None else timed(r, b),
                             host_seconds=None if hosted is None else hosted(r, b))

        for p in each(one):
            if p is not None:
                self.probes.append(p)


def cap_of(fit: Fit, budget: int) -> int:
    """The largest batch a fit puts within ``budget`` (huge when its slope is ~0)."""
    x = (budget - fit.intercept_bytes) / max(fit.slope_bytes, MIN_SLOPE_BYTES)
    return int(math.floor(x)) if x < 1 << 50 else 1 << 50


def balance_ranks(obs: RankObservations, run: Runner, global_batch: int, max_rounds: int,
                  near: Sequence[int]) -> list[int]:
    """The split of ``global_batch`` with the same share of budget on every rank (every rank
    at least ``obs.m``): fit each rank near the last proposal, solve, probe, until a proposal
    is measured within budget on every rank (else the best one measured so, by its fullest
    rank). ``near``: the batches of the round before. Raises :class:`NoFeasibleSplitError`."""
    n, m = obs.n, obs.m
    tried: set[tuple[int, ...]] = set()
    last = list(near)
    while True:
        fits = [obs.fit(r, last[r]) for r in range(n)]
        caps = obs.caps()
        try:
            split = solve_balance(fits, obs.budgets, global_batch, min_chunk_nonzero=m,
                                  caps=caps, every_card=True, strict=True)
        except NoFeasibleSplitError:
            known = [c for c in caps if c is not None]
            if len(known) == n and sum(known) < global_batch:   # more than the ranks hold
                raise beyond_the_ranks(obs, run, global_batch, max_rounds) from None
            raise
        done = [obs.measured(r, b) for r, b in enumerate(split)]
        if all(p is not None and p.fits for p in done) or tuple(split) in tried \
                or obs.rounds >= max_rounds:
            break
        tried.add(tuple(split))
        run([None if d is not None else b for d, b in zip(done, split)])
        last = split
    if obs.all_fit(split):
        return split
    return _best_tried(obs, tried, global_batch)


def _best_tried(obs: RankObservations, tried: set[tuple[int, ...]], global_batch: int) -> list[int]:
    """The split tried and measured within budget on every rank whose fullest rank is the
    least full."""
    best: Optional[tuple[float, list[int]]] = None
    for cand in tried:
        ps = [obs.measured(r, b) for r, b in enumerate(cand)]
        if all(p is not None and p.fits and p.peak_bytes is not None for p in ps):
            worst = max(p.peak_bytes / obs.budgets[r] for r, p in enumerate(ps))  # type: ignore[union-attr,operator]
            if best is None or worst < best[0]:
                best = (worst, list(cand))
    if best is None:
        raise NoFeasibleSplitError(
            f"no split of the global batch {global_batch} was measured within every rank's budget "
            f"in {obs.rounds} rounds; try a smaller global_batch or a larger max_rounds",
            shortfall_bytes=None)
    return best[1]


def beyond_the_ranks(obs: RankObservations, run: Runner, global_batch: int,
                      max_rounds: int) -> NoFeasibleSplitError:
    """``global_batch`` is more than the ranks' measured caps add up to: bracket each rank's
    largest batch (as ``max_batch`` does) and say how many samples the ranks take together,
    a figure measured on the cards, not read off the probes that happened to be over."""
    closed = bracket_ranks(obs, run, max_rounds, None)
    n = obs.n
    fit = [obs.lo(r) for r in range(n)]
    over = [obs.hi(r) for r in range(n)]
    most = sum(fit) if closed else sum(fit[r] if h is None else h - 1 for r, h in enumerate(over))
    bound = f"the ranks take at most {most} samples together"
    if not closed:
        bound += f" ({sum(fit)} measured to fit; not every rank bracketed in {obs.rounds} rounds)"
    elif n <= 8:
        bound += f" ({', '.join(f'rank {r}: {b}' for r, b in enumerate(fit))})"
    return NoFeasibleSplitError(
        f"no split of the global batch {global_batch} is possible: {bound}, each rank probed up "
        f"to its budget. Try a global batch of at most {sum(fit)} (--batch-size), or more cards.",
        shortfall_bytes=None)


def _next_batch(obs: RankObservations, r: int, bisect: bool, limit: Optional[int],
                staircase: bool) -> int:
    """Rank r's next probe: inside a closed-above bracket on a staircase see
    :func:`_next_on_staircase`; else the bracket's middle (``bisect``), else where its fit
    meets the budget, at most 64x past what is known to fit."""
    lo, hi = obs.lo(r), obs.hi(r)
    if hi is not None and staircase:
        return _next_on_staircase(obs, r, bisect)
    if hi is not None and bisect:
        return (lo + hi) // 2
    x = max(cap_of(obs.fit(r, lo), obs.budgets[r]), lo + 1)
    if hi is not None:
        return min(x, hi - 1)
    if staircase and x == lo + 1:
        x = lo + max(1, lo // 256)
    x = min(x, max(64 * lo, lo + 1))
    if limit is not None:
        x = min(x, max(limit, lo + 1))
    return x


def _next_on_staircase(obs: RankObservations, r: int, bisect: bool) -> int:
    """Rank r's next probe inside its bracket ``[lo, hi)`` where peaks rise in steps (the
    reserved level), whose edges sit at round batches (:func:`~dptune.search.observations
    .roundest`): where its two largest fits share a figure, where that flat step likely ends
    (:func:`~dptune.search.observations.step_end`) or else the bracket's roundest batch;
    otherwise where the flat step its smallest overs share likely starts
    (:func:`~dptune.search.observations.step_start`), else, in
    turns, the roundest batch within a sixteenth of the bracket of where the line through
    its two ends meets the budget (the false position) and the roundest batch of its middle
    half (:func:`~dptune.search.observations.round_middle`). ``benchmarks.rank_staircases``:
    180 of 300 random staircases certified within 16 rounds, against 4 with the bracket's
    middle alone."""
    lo, hi = obs.lo(r), obs.hi(r)
    assert hi is not None
    fit = _fit_points(obs, r)
    over = sorted((p.batch_size, p.peak_bytes) for p in obs.of(r)
                  if not p.fits and p.peak_bytes is not None)
    edge = (step_end(fit, lo, hi) or roundest(lo, hi, obs.m)) if on_one_step(fit) \
        else step_start(over, lo, hi)
    if edge is not None and edge >= obs.m:
        return edge
    if not bisect and lo > 0:
        a, b = obs.measured(r, lo), obs.measured(r, hi)
        if a is not None and b is not None and a.peak_bytes is not None \
                and b.peak_bytes is not None and b.peak_bytes > a.peak_bytes:
            line = fit_affine([(lo, float(a.peak_bytes)), (hi, float(b.peak_bytes))])
        else:
            line = obs.fit(r, lo)
        x = min(max(cap_of(line, obs.budgets[r]), lo + 1), hi - 1)
        return roundest_near(x, lo, hi, max(1, (hi - lo) // 16))
    return round_middle(lo, hi, obs.m) or (lo + hi) // 2


def _fit_points(obs: RankObservations, r: int) -> list[tuple[int, int]]:
    """Rank ``r``'s ``(batch, peak)`` measured within budget, by batch."""
    return sorted((p.batch_size, p.peak_bytes) for p in obs.of(r)
                  if p.fits and p.peak_bytes is not None)


def bracket_ranks(obs: RankObservations, run: Runner, max_rounds: int, limit: Optional[int],
                  staircase: bool = False) -> bool:
    """Bracket each rank's largest batch; returns whether every bracket closed with no probe
    contradicting the monotone surface (:meth:`RankObservations.not_monotone`).

    ``limit``: stop once the ranks' batches measured within budget add up to it.
    ``staircase``: peaks rise in steps (the reserved level: whole segments), where a line
    through two probes says little near the edge of a step: a rank whose line says it is at
    its limit with no batch yet measured over probes ``lo + lo/256`` (not ``lo + 1``) to find
    one, and a bracket is closed by its steps' edges (:func:`_next_on_staircase`)."""
    n = obs.n
    bisect_next = [False] * n
    while obs.rounds < max_rounds:
        if limit is not None and sum(obs.lo(r) for r in range(n)) >= limit:
            return False
        sizes: list[Optional[int]] = []
        for r in range(n):
            if obs.bracket(r).closed:
                sizes.append(None)
                continue
            sizes.append(_next_batch(obs, r, bisect_next[r], limit, staircase))
            bisect_next[r] = not bisect_next[r]
        if all(s is None for s in sizes):
            return obs.not_monotone() is None
        run(sizes)
    return all(obs.bracket(r).closed for r in range(n)) and obs.not_monotone() is None
