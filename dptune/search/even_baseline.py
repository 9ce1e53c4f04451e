"""The even split's largest batch ``E``, bracketed from measured points only.

Every even split up to ``even(E)`` known within budget, ``even(E + 1)`` known over: the batch a
user reaches by raising DataParallel's batch until it fails (``torch.chunk``'s splits are not
monotone per card, so a larger batch may fit again, and does not count). "Known" includes
dominance on the monotone surface (:meth:`dptune.search.observations.Observations.fit_witness`).
The largest-batch strategy (:class:`dptune.search.max_batch.MaxBatch`) asks these questions
beside its own and shares its probes, its fits and its stall bookkeeping (:class:`Host`).
On simulated cards at the reserved level, where dominance proves nothing (a figure can fall
as the work grows), :func:`on_the_model` reads ``E`` on the allocator model
(``search.Known.even_line``): the probes' reading checked, or its bracket closed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional, Protocol, Sequence, Union

from dptune.search.line import largest_true
from dptune.search.loop import Proposal, valid_split
from dptune.search.models import MIN_SLOPE_BYTES, CardFits
from dptune.search.observations import Observations
from dptune.backends.base import ProbeResult
from dptune.split import even_split
from dptune.types import EvenLine

__all__ = ["EvenBaseline", "Host", "START_PURPOSES", "ON_MODEL", "OnModel", "ModelDisagrees", "on_the_model"]

#: The purposes of the probes that learn the surface before aiming at the answer.
START_PURPOSES = ("even", "spread", "start", "fit")


class Host(Protocol):
    """What the even baseline uses of the largest-batch search it runs in."""

    obs: Observations
    n: int
    m: int
    hint: int

    def infeasible(self, batch: int) -> bool: ...

    def _predicted_fit(self, split: Sequence[int], fits: CardFits) -> bool: ...

    def _stalled(self, key: str) -> bool: ...

    def _unstall(self, key: str, lo: int, hi: int) -> int: ...


class EvenBaseline:
    """The even split's bracket ``[lo, hi)`` and the next probe that narrows it."""

    def __init__(self, host: Host):
        self.host = host
        self.obs, self.n, self.m = host.obs, host.n, host.m
        self._memo: Optional[tuple[int, tuple[int, Optional[int]]]] = None   # (probes, bracket)

    def fits(self, b: int) -> bool:
        s = even_split(b, self.n)
        return valid_split(s, self.m) and self.obs.split_fits(s)

    def over(self, b: int) -> bool:
        s = even_split(b, self.n)
        return not valid_split(s, self.m) or self.obs.split_over(s) or self.host.infeasible(b)

    def upper(self) -> int:
        best = self.obs.best_within()
        top = max([r.batch_size for r in self.obs.probes] + [self.host.hint])
        return max(top, best.batch_size if best else 0) + 1

    def start(self) -> int:
        return self.m * self.n if self.m > 1 else 1   # BatchNorm: no even split below

    def _prefix(self, start: int, up: int) -> int:
        """The largest ``E`` in ``[start, up]`` with every even split from ``start`` to ``E``
        known to fit (BatchNorm: batches with a chunk of 1 skipped): where a user who raises
        DataParallel's batch until it fails stops. 0: none. Card 0's chunk grows with the
        batch (bisection); the others' do not (``torch.chunk``: ``even(328)`` on three cards is
        ``(110, 110, 108)``, lighter on the last card than ``even(327) = (109, 109, 109)``),
        but none exceeds ``ceil(b / n)``, so they are scanned only above ``n`` times the
        smallest chunk every card is known to fit."""
        n = self.n
        top = largest_true(lambda b: self.obs.card0_fits(even_split(b, n)[0], b), start, up)
        if top < start:
            return 0
        known = min((max((p.chunk for p in self.obs.fit_points(i)), default=0)
                     for i in range(1, n)), default=top)
        b = min(n * known, top)
        if b < start:
            b = start - 1       # nothing below start known: start itself is asked first
        while b + 1 <= top and (not valid_split(even_split(b + 1, n), self.m)
                                or self.fits(b + 1)):
            b += 1
        while b >= start and not self.fits(b):
            b -= 1
        return b if b >= start else 0

    def next_batch(self, lo: int) -> int:
        """The first valid even batch above ``lo`` (the one to be known over)."""
        b = max(lo + 1, self.start())
        while not valid_split(even_split(b, self.n), self.m):
            b += 1
        return b

    def bracket(self) -> tuple[int, Optional[int]]:
        """``[lo, hi)``: ``lo`` the even split's largest batch known so far (every even batch
        up to it known to fit, :meth:`_prefix`), ``hi`` a batch above it known over.
        Asked several times a probe (the bookkeeping, the certificate, the next step, the
        outcome), computed once per probe."""
        k = len(self.obs.probes)
        if self._memo is None or self._memo[0] != k:
            self._memo = (k, self._bracket())
        return self._memo[1]

    def _bracket(self) -> tuple[int, Optional[int]]:
        up, start = self.upper(), self.start()
        lo = self._prefix(start, up)
        nxt = self.next_batch(lo)
        if self.over(nxt):
            return lo, nxt
        hi = largest_true(lambda b: not self.over(b), nxt, up) + 1
        return lo, (hi if hi <= up and self.over(hi) else None)

    def _guess_missed(self, lo: int, fits: CardFits) -> bool:
        """The even split's lower end ``lo`` is known by dominance only (``even(lo)`` not
        probed), a probe that asked about the even split above ``lo`` found card 0 over its
        budget (the fits guessed too high), and card 0's own samples cost something near
        ``even(lo + 1)``: on a flat step (fitted slope at its floor, ``MIN_SLOPE_BYTES``) the
        memory a smaller batch frees takes card 0 past ``lo``, so the bet that ``lo`` is its
        cap does not hold (a staircase: it cost a probe there). Not either when card 0's chunk
        there is known only from the first probes (the caller's batch: far below card 0's
        cap)."""
        obs = self.obs
        if lo <= 0 or tuple(even_split(lo, self.n)) in obs.by_split:
            return False
        e0 = even_split(lo, self.n)[0]
        if not any(p.chunk >= e0 and p.batch >= lo and p.probe >= 0
                   and obs.probes[p.probe].purpose not in START_PURPOSES for p in obs.fit_points(0)):
            return False
        above = even_split(lo + 1, self.n)
        line = fits.card0_line(above[0], lo + 1)
        if line is not None and line.slope <= MIN_SLOPE_BYTES:
            return False
        return any(r.purpose.startswith("even-max") and r.batch_size > lo
                   and any(p.probe == k and p.over for p in obs.points[0])
                   for k, r in enumerate(obs.probes))

    def _crept(self, lo: int) -> bool:
        """The last two probes were even splits one batch apart, at ``lo - 1`` and ``lo``,
        and both fitted: the fits guessed one above the bracket twice and were wrong twice
        (card 0 on a flat step of its figure)."""
        obs = self.obs
        last = obs.probes[-2:]
        return (len(last) == 2 and lo % self.n != 0
                and all(r.purpose.startswith("even-max") and obs.within_budget(r) for r in last)
                and [r.batch_size for r in last] == [lo - 1, lo])

    def certified(self) -> bool:
        """``even(E)`` known to fit and ``even(E + 1)`` known over, from measured points (by
        dominance: ``even(E)`` need not be probed itself when a probe within budget put every
        card at least as high, see :meth:`Observations.fit_witness`)."""
        lo, hi = self.bracket()
        return hi == self.next_batch(lo)

    def step(self) -> Optional[Proposal]:
        obs = self.obs
        lo, hi = self.bracket()
        if self.certified():
            return None
        lower, upper = max(lo + 1, self.start()), (self.upper() if hi is None else hi - 1)
        above = tuple(even_split(lower, self.n))
        fits = CardFits(obs)
        if self._guess_missed(lo, fits) and valid_split(above, self.m) and above not in obs.by_split:
            # E >= lo is known by dominance (a probe loaded every card at least as much) and
            # the fits already guessed too high once: ask E + 1 directly, which closes the
            # bracket when lo is the cap, rather than walk down a few samples per probe
            return Proposal(above, "even-max")

        def fits_at(b: int) -> bool:
            return self.host._predicted_fit(even_split(b, self.n), fits)

        b = min(max(largest_true(fits_at, lower, upper), lower), upper)
        if self.host._stalled("even") and hi is not None and b > lower:
            b = self.host._unstall("even", lo, hi)       # not halved in two probes
        elif b == lower and self._crept(lo):
            # the fits put E at lo again after two even splits one batch apart fitted: card 0
            # sits on a flat step of its figure; the largest batch that leaves card 0 that
            # chunk answers every batch below it at once (each card at most as loaded)
            b = min(upper, self.n * -(-lower // self.n))
        for cand in [b, *range(b - 1, lower - 1, -1)[:4], *range(b + 1, upper + 1)[:4]]:
            s = tuple(even_split(cand, self.n))
            if valid_split(s, self.m) and s not in obs.by_split and not obs.split_fits(s) \
                    and not obs.split_over(s):
                return Proposal(s, "even-max")
        return None


#: ``purpose`` of the even split at its largest batch simulated on the allocator model beside
#: the probes (not one of them)
ON_MODEL = "even on the allocator model"


class OnModel(NamedTuple):
    """The even split's largest batch closed on the model: ``even`` the split at ``E``
    (measured, or simulated beside the probes: purpose :data:`ON_MODEL`), ``line`` what the
    model's replays found."""

    even: ProbeResult
    line: EvenLine


class ModelDisagrees(NamedTuple):
    """The even line on the model not taken: a probe of an even split, or a simulated step
    beside the probes, contradicts it (``reason`` says which); the probes' reading stands."""

    reason: str


def on_the_model(probe: Callable[[Sequence[int]], ProbeResult], base: EvenBaseline,
                 line_of: Callable[..., Optional[EvenLine]], at_lo: Optional[ProbeResult],
                 hi: Optional[int]) -> Union[OnModel, ModelDisagrees, None]:
    """The even split's largest batch ``E`` on the allocator model, whether the probes
    bracketed it or not: every even batch above the first the model draws (``n * (n - 1)``;
    up to it, the probes' reading stands) replayed until one is over (``line_of(start,
    min_chunk=m, upto=b)``, :func:`dptune.backends.simulated.even_line.even_line`; no
    monotone figure assumed, where the probes' bracket rests on dominance; where the model
    cannot replay that many, an open bracket from its lower end up), then ``even(E)``
    and the next even batch simulated for real (``probe``, not recorded: on simulated cards
    a step, not a probe of a real card) unless a probe measured that very split. ``at_lo``:
    the even split at the lower end ``lo`` of the probes' reading the search reports
    (measured, or implied by dominance), ``hi`` its upper end (``lo``'s next even batch where
    closed; ``None``: open above): later probes (past a fall) may read the bracket otherwise
    by dominance, which is what the line checks. ``None``: no line on the model;
    :class:`ModelDisagrees` where the model contradicts a probe or a real step."""
    obs = base.host.obs
    n = obs.n
    start = max(n * (n - 1), base.start())
    if at_lo is None or at_lo.batch_size < start:
        return None
    lo = at_lo.batch_size
    # from the bottom (a check of the probes' reading) where the model replays that far (it
    # must reach ``lo`` at least); else, an open bracket from ``lo`` up (its prefix read from
    # the probes, as before)
    line = line_of(start, min_chunk=obs.min_chunk, upto=hi if hi is not None else lo)
    if line is None and hi != base.next_batch(lo) and lo > start:
        line = line_of(lo, min_chunk=obs.min_chunk, upto=hi)
    if line is None:
        return None
    wrong = [r.batch_size for r in obs.probes if start < r.batch_size <= line.largest
             and tuple(r.chunk_sizes) == tuple(even_split(r.batch_size, n))
             and not obs.within_budget(r)]
    if wrong:
        return ModelDisagrees(f"on the allocator model every even batch up to {line.largest} "
                              f"fits, but even({wrong[0]}) was measured over: the model's "
                              "drawing is wrong there")

    def simulated(b: int) -> ProbeResult:
        s = tuple(even_split(b, n))
        r = obs.by_split.get(s)
        return r if r is not None else dataclasses.replace(
            probe(s), purpose=ON_MODEL,
            note=f"not probed: simulated beside the probes, the even split's largest batch on "
                 f"the allocator model ({line.describe()})")
    at = simulated(line.largest)       # never the dominance bound: a step (or the probe's)
    if not obs.within_budget(at) or obs.within_budget(simulated(line.over)):
        return ModelDisagrees(f"on the allocator model the even split's largest batch reads "
                              f"{line.largest}, but a simulated step of even({line.largest}) or "
                              f"even({line.over}) disagrees")
    return OnModel(at, line)
