"""The largest batch: every card's cap in a bracket, card 0 along the whole-batch line.

Each card ``i >= 1`` has a cap ``C_i`` (its largest chunk within budget), kept as a bracket
``[lo, hi)``. Card 0 takes what the others leave: with the others at chunks ``t``, the
batch ``B`` puts card 0 at the fewest samples it can take, ``c0(B) = max(0, B - sum(t))``
(BatchNorm: no chunk of 1), so card 0's cap is a bracket on ``B`` along that line. Every
probe puts each open card inside its bracket (where a local fit says the cap is; the
midpoint when the bracket has not halved in two probes, or, when the last probe moved one
end only, twice that move on from it if short of the midpoint: a fit that guesses to one side
of a staircase's step) and card 0 at the largest batch its fit allows inside its own bracket,
so every probe shrinks a bracket.

The answer is the largest batch measured within every budget. It is *certified* when one
more sample is measured not to fit: with each card ``i >= 1`` at most ``hi_i - 1``, every
split of ``B + 1`` leaves card 0 at least a chunk where it was measured over budget.

The first probe is the even split of the caller's batch; on the simulator with three cards
or more, the last card is set to card 1's share and a quarter, so one probe gives a slope across
the cards ``i >= 1`` (taken only when every card lies on it: cards that run the same
replica cost alike per sample). The second probe then keeps card 0's chunk (its cost per
sample of the whole batch) and puts each card ``i >= 1`` one sample above the cap that slope
gives: on an affine surface that is the cards' over-budget test, asked by a probe card 0
needed anyway, and the answer is certified in four probes instead of five.

Then the even split's largest batch ``E`` is bracketed the same way
(:mod:`dptune.search.even_baseline`, which shares this search's probes and fits), from
measured points only: every even split up to ``even(E)`` known within budget, ``even(E + 1)`` known over (the
batch a user reaches by raising DataParallel's batch until it fails; ``torch.chunk``'s splits
are not monotone per card, so a larger batch may fit again, and does not count). "Known" includes dominance
on the monotone surface (see :mod:`dptune.search.observations`): ``even(E)`` is not probed
when a probe measured within budget put every card at least as high (card 0 also in at least
as large a batch); the outcome names those probes (``even_implied_by``). Ways to spend
fewer probes, none of which returns anything not measured:

- card 0's last question (one more sample at the best batch) is asked by the even split at
  ``E + 1`` instead when that gives card 0 no more samples in no larger a batch: over there
  is over at the best batch too;
- on the simulator (every card measured in every probe), a probe that asks only about card 0
  fixes only card 0's chunk and the batch, so the other cards' one-more-sample tests ride
  along (raised cards, the samples taken from cards known to fit lower) when card 0's
  questions left can carry them all;
- when the fits put every open card's cap at its ``lo`` but card 0 can take more along that
  line, that candidate answer is probed before the cards' one-more tests;
- a card ``i >= 1`` with nothing measured over whose one-more tests fitted twice in a row
  (its fits creep up a sample at a time: a staircase) gallops, ``lo + 2 ** k`` for ``k``
  such raises, rather than walk one sample per probe;
- on a flat step of the default level's staircase (a card's two largest chunks within
  budget read the same figure, the bracket's upper end at most 1% of the budget above it;
  card 0: its last two points), where the fits cannot place the step's edge, the bracket's
  roundest chunk (:func:`dptune.search.observations.roundest`: the most trailing zero bits,
  where a block's size crosses the allocator's 2 MiB rounding; the one-more test when the
  lower end is rounder), not a fit's guess next to the lower end;
- when ``E >= lo`` is known only by dominance and the fits already guessed the even split too
  high once (card 0 measured over above ``lo``), ``even(lo + 1)`` is asked directly: a
  dominating probe usually puts ``lo`` at card 0's cap, so one probe closes the bracket
  where the fits would walk down a few samples per probe.
- when the last two probes were even splits one batch apart that both fitted and the fits
  put ``E`` at ``lo`` again (card 0 on a flat step of its figure), the even split with card 0
  at the same chunk and the largest batch (``n`` times that chunk) is asked: it answers every
  batch below it (``python -m benchmarks.search_families`` against ``--without-flat-step``:
  40 alike staircases 24 even brackets left open instead of 26, 443 probes instead of 447;
  40 mixed clusters 231 instead of 230; the default-level grid's 15 rows on 4x24GB, 8x24GB and
  4x24GB with 6 GB used on card 0: identical).

When the probes run out first, the even split is reported at the lower end of its bracket
(what the probes prove: measured or by dominance), with the upper end beside it
(:class:`dptune.search.SearchOutcome`'s ``even_open`` and ``even_at_most``).
"""

from __future__ import annotations

from typing import Optional, Sequence

from dptune.search.line import BatchLine, first_over, largest_true, last_within
from dptune.search.loop import Proposal, even_at_most, fill, raise_cards, valid_split
from dptune.search.even_baseline import EvenBaseline
from dptune.search.models import CardFits, chord_cap
from dptune.search.observations import FLAT_RISE, Bracket, Observations, next_chunk, roundest
from dptune.split import even_split

__all__ = ["MaxBatch"]

#: Largest step up a secant may take from the largest measured chunk when nothing above was
#: measured (x this); a single point scales in proportion, which undershoots.
GROWTH = 64
#: The same on real cards, where a probe that runs out of memory records only a lower bound
#: of the failing card's figure and nothing of the others' (a fit probe measures every card):
#: a secant from small chunks overshoots a staircase's cap there and wastes probes.
#: 2026-11-30, real-card semantics, one run each: the monotone staircases of
#: ``benchmarks.search_families`` (150 seeds, 16 probes) certified 115 against 98 at x64,
#: 2,079 probes against 2,149; the tests' typical and hard shapes from 2 to 512 samples a
#: card (47 cases, 12 probes) 43 against 41, 332 probes against 324 (x4: 41 and 351).
REAL_GROWTH = 8


class MaxBatch:
    """The largest-batch strategy (see the module docstring)."""

    def __init__(self, obs: Observations, hint: int, max_probes: int, compare_even: bool = True,
                 first: Optional[Sequence[int]] = None):
        self.obs = obs
        self.first = None if first is None else tuple(first)   # the first split to probe
        self.compare_even = compare_even   # False: the even split's largest batch is not asked
        self.n = obs.n
        self.m = obs.min_chunk
        self.hint = max(hint, self.m)
        self.max_probes = max_probes
        self.g_tries = 0
        #: each bracket's ``(lo, hi)``, probe after probe (its width and moves derive from it)
        self.ends: dict[str, list[tuple[int, Optional[int]]]] = {}
        self._seen = 0
        self.even = EvenBaseline(self)
        self._last_t: tuple[int, ...] = ()   # the other cards' chunks in the last line probed

    # ---- bookkeeping ------------------------------------------------------------------
    def _record_brackets(self) -> None:
        if len(self.obs.probes) == self._seen:
            return
        self._seen = len(self.obs.probes)
        if self.max_certified():     # only the phase under way counts its probes
            self.ends.setdefault("even", []).append(self.even_bracket())
            return
        for i in range(1, self.n):
            br = self.obs.bracket(i)
            self.ends.setdefault(f"card{i}", []).append((br.lo, br.hi))
        for t in {tuple(self._caps_lo()), self._last_t}:
            line = self._line(list(t))
            self.ends.setdefault(f"line{line.t}", []).append(self._line_bracket(line))

    def _stalled(self, key: str) -> bool:
        """The bracket has not halved in the last two probes."""
        h = self.ends.get(key, [])
        if len(h) < 3:
            return False
        (lo1, hi1), (lo3, hi3) = h[-1], h[-3]
        return hi1 is not None and hi3 is not None and hi1 - lo1 > (hi3 - lo3) / 2

    def _unstall(self, key: str, lo: int, hi: int) -> int:
        """A stalled bracket's next point: its middle; but on the simulator (every card's
        peak measured, over budget or not), when the last probe moved one end of the bracket
        (the fits' guess fell to one side of a staircase's step: within budget and too low,
        or over and too high), twice that move on from that end, if it stops short of the
        middle (the other end may lie far off, where a probe teaches little). On real cards
        an out-of-memory probe bounds the failing card's peak without measuring the others,
        so the fits saw less and the middle does better there (31 cases of 3+ cards under
        real-card semantics: 1,330 probes with the middle, 1,392 with the steps)."""
        h, mid = self.ends.get(key, []), (lo + hi) // 2
        if not self.obs.exact_on_oom or len(h) < 2 or h[-1][0] != lo:
            return mid
        (lo2, up), hi1 = h[-2], h[-1][1]
        if lo > lo2:
            return min(mid, lo + 2 * (lo - lo2))
        if hi1 == hi and up is not None and hi < up:
            return max(mid, hi - 2 * (up - hi))
        return mid

    def _caps_lo(self) -> list[int]:
        return [self.obs.bracket(i).lo for i in range(1, self.n)]

    # ---- card targets -----------------------------------------------------------------
    def _target(self, i: int, fits: CardFits) -> int:
        obs, m = self.obs, self.m
        br = obs.bracket(i)
        if br.closed:
            return br.lo
        lower = next_chunk(br.lo, m)
        upper = None if br.hi is None else br.hi - 1
        if upper is not None and upper < lower:
            return br.lo
        budget = obs.budgets[i]
        fit_pts = [p for p in obs.fit_points(i) if p.chunk > 0]
        over_pts = [p for p in obs.over_points(i) if p.exact]
        lo_pt = max(fit_pts, key=lambda p: p.chunk, default=None)
        hi_pt = min(over_pts, key=lambda p: p.chunk, default=None)
        guess: Optional[int] = None
        if lo_pt is not None and hi_pt is not None and hi_pt.chunk > lo_pt.chunk:
            guess = chord_cap((lo_pt.chunk, lo_pt.peak_bytes), (hi_pt.chunk, hi_pt.peak_bytes), budget)
        else:
            line = fits.card_line(i, br.lo)
            pts = [p for p in obs.points[i] if p.exact and p.chunk > 0]
            if line is not None and (len({p.chunk for p in pts}) >= 2 or fits.pooled):
                guess = int((budget - line.intercept) / line.slope)
                if upper is None:   # a secant far from its points is not trusted far
                    top = max([p.chunk for p in obs.points[i]] + [br.lo, 1])
                    # nor a flat step of a staircase: a chord from a point well below lo too
                    wide = fits.card_line(i, 2 * max(br.lo, 1))
                    if wide is not None:
                        guess = min(guess, int((budget - wide.intercept) / wide.slope))
                    guess = min(guess, self._growth() * top)
            elif pts:   # one point: in proportion (undershoots, since the intercept is >= 0)
                p = pts[-1]
                guess = int(p.chunk * budget / max(p.peak_bytes, 1))
            elif br.hi is not None:
                guess = br.hi // 2
            else:
                guess = max(lower, even_split(self.hint, self.n)[i])
        c = max(lower, guess if upper is None else min(upper, guess))
        if upper is None:
            c = max(c, self._gallop(i, br.lo))
        # a flat step whose end may be the cap: the upper end reads at most about a segment
        # above it (FLAT_RISE); further above, the cap lies steps on, where the chord points.
        # Where a bound (a real card's out-of-memory probe, a shorter bucket's) sets the upper
        # end, its figure is not measured: the step's end is asked, as before.
        hi_peak = hi_pt.peak_bytes if hi_pt is not None and hi_pt.chunk == br.hi else None
        near = obs.flat_within(i, hi_peak)
        end = obs.flat_end(i, br.lo, br.hi) if br.hi is not None and near else None
        if end is not None:
            c = max(end, lower)             # a flat step: where it likely ends (step_end)
        elif br.hi is not None and hi_pt is not None and obs.flat_within(i, hi_pt.peak_bytes):
            c = roundest(br.lo, br.hi, m) or lower    # a flat step: the roundest chunk in it
        elif self._stalled(f"card{i}") and br.hi is not None and c > lower:
            c = max(lower, self._unstall(f"card{i}", br.lo, br.hi))   # not halved in two probes
        elif br.hi is not None and c > lower and not obs.exact_on_oom:
            down = self._bound_step(i, br.lo, br.hi)      # real cards: one bound after another
            if down is not None:
                c = max(lower, min(c, down))
        return c if c == 0 or c >= m else m

    def _bound_step(self, i: int, lo: int, hi: int, line: Optional[BatchLine] = None) -> Optional[int]:
        """On real cards, card ``i``'s upper end ``hi`` set by an out-of-memory probe right
        after another one on it at a larger chunk: each records only a lower bound of the
        card's figure (its total), and a line lifted through it (:meth:`CardFits._lifted`)
        puts the cap just below it again, a few percent a probe down a step whose figure is
        not known. Twice that last move down from ``hi``, at most to the bracket's middle;
        card 0 (``i = 0``) along ``line``, ``hi`` a batch (its chunk follows the batch one
        for one there). Only where the card's latest point is that second bound and the move
        is less than half the bracket left (a halving is no creep); ``None`` elsewhere.
        Measured 2026-11-30, one run each, real-card semantics: the monotone staircases of
        ``python -m benchmarks.search_families`` (150 seeds, 16 probes) certified 115 with
        the rule on cards ``i >= 1`` (the growth cap on), 129 with card 0's as well
        (2,079 and 2,065 probes); the tests' typical and hard shapes 43 of 47 either way
        (332 and 329 probes)."""
        seen = sorted((o for o in self.obs.points[i] if o.probe >= 0 and o.chunk > 0),
                      key=lambda o: o.probe)
        bounds = [o for o in seen if o.over and not o.exact]
        # the card's latest point is the second bound in a row, a short move below the first
        if len(bounds) < 2 or seen[-1] is not bounds[-1]:
            return None
        move = bounds[-2].chunk - bounds[-1].chunk
        end = bounds[-1].chunk if line is None else \
            max(bounds[-1].batch, first_over(line, bounds[-1].chunk, bounds[-1].batch))
        if move <= 0 or end != hi or 2 * move >= hi - lo:
            return None
        return max((lo + hi) // 2, hi - 2 * move)

    def _growth(self) -> int:
        """How far a secant may step up past what was measured: :data:`GROWTH`, or
        :data:`REAL_GROWTH` on real cards."""
        return GROWTH if self.obs.exact_on_oom else REAL_GROWTH

    def _gallop(self, i: int, lo: int) -> int:
        """Card ``i``'s chunk when nothing above ``lo`` was measured over and its fits have
        been creeping: the last ``k >= 2`` probes that raised ``lo`` raised it by at most
        two samples (``min_chunk`` each) each time, one-more tests that fitted (the fits are
        wrong: a staircase; a single such raise is often a fit's exact guess). Then
        ``lo + 2 ** k`` samples rather than one more per probe; ``lo`` otherwise (the fits'
        guess stands)."""
        los, top = [], 0
        for p in sorted(self.obs.fit_points(i), key=lambda p: p.probe):
            if p.chunk > top:
                top = p.chunk
                los.append(top)
        k = 0
        while k + 1 < len(los) and los[-1 - k] - los[-2 - k] <= 2 * self.m:
            k += 1
        return lo + 2 ** k * self.m if k >= 2 else lo

    # ---- card 0 along the line -------------------------------------------------------
    def _line(self, t: list[int]) -> BatchLine:
        return BatchLine(t, self.m)

    def _line_bracket(self, line: BatchLine) -> tuple[int, Optional[int]]:
        """``[lo, hi)`` of the batch along ``line``, from card 0's measured points."""
        lo = 0
        for p in self.obs.fit_points(0):
            lo = max(lo, last_within(line, p.chunk, p.batch))
        hi: Optional[int] = None
        for p in self.obs.over_points(0):
            b = max(p.batch, first_over(line, p.chunk, p.batch))
            hi = b if hi is None else min(hi, b)
        if hi is not None and lo >= hi:
            lo = hi - 1
        return lo, hi

    def _line_target(self, line: BatchLine, fits: CardFits) -> Optional[int]:
        lo, hi = self._line_bracket(line)
        lower, upper = lo + 1, (None if hi is None else hi - 1)
        # BatchNorm: the smallest batches may have no split on this line (a chunk of 1); start
        # from the first that has one, or the fits are never asked and a guess is probed
        lower = next((b for b in range(lower, lower + 2 * self.m + 1) if line.c0(b) is not None),
                     lower)
        if upper is not None and upper < lower:
            return None
        budget = self.obs.budgets[0]
        stalled = self._stalled(f"line{line.t}") and hi is not None

        def fits_at(b: int) -> bool:
            c0 = line.c0(b)
            if c0 is None:
                return False
            p = fits.predict0(c0, b)
            return p is not None and p <= budget

        cap = upper if upper is not None else self._growth() * max(lo, line.total, self.hint, 1)
        if fits.predict0(0, max(lower, 1)) is None:
            return (lo + hi) // 2 if hi is not None else min(cap, 2 * max(lo, 1))
        b = largest_true(fits_at, lower, cap)
        if b < lower and lower <= line.total and line.c0(line.total) == 0 and \
                not any(p.exact and p.chunk == 0 for p in self.obs.points[0]):
            return line.total   # card 0 may fit only with no samples (no replica): try that
        b = b if b >= lower else lower
        end = self._end_batch(line, lo, hi) if hi is not None and self.obs.flat_within(0) else None
        if end is not None:
            b = max(lower, end)             # a flat step: where it likely ends (step_end)
        elif hi is not None and self.obs.flat_within(0, self._line_over_peak(line, hi)):
            b = max(lower, self._round_batch(line, lo, hi))   # a flat step of a staircase
        elif stalled and b > lower and hi is not None:
            b = max(lower, self._unstall(f"line{line.t}", lo, hi))    # not halved in two probes
        elif hi is not None and b > lower and not self.obs.exact_on_oom:
            down = self._bound_step(0, lo, hi, line)    # real cards: one bound after another
            if down is not None:
                b = max(lower, min(b, down))
        elif hi is not None and b > lower and self.obs.flat_over(0) \
                and self._line_rise(line, lo, hi) <= FLAT_RISE * budget:
            # card 0's over points on one flat step, and the bracket's lower end at most about
            # a segment below them (further below, the fits place the cap better than a halving)
            b = max(lower, self._round_batch(line, lo, hi))   # a flat step of a staircase
        return b

    def _round_batch(self, line: BatchLine, lo: int, hi: int) -> int:
        """The batch in ``(lo, hi)`` along ``line`` that gives card 0 the roundest chunk
        (:func:`~dptune.search.observations.roundest`); the middle where card 0's chunk does
        not follow the batch one for one there."""
        c_lo, c_hi = line.c0(lo), line.c0(hi)
        if c_lo is None or c_hi is None or c_lo <= 0 or c_hi - c_lo != hi - lo:
            return (lo + hi) // 2
        c = roundest(c_lo, c_hi, self.m)
        return (lo + hi) // 2 if c is None else lo + (c - c_lo)

    def _end_batch(self, line: BatchLine, lo: int, hi: int) -> Optional[int]:
        """The batch in ``(lo, hi)`` along ``line`` that gives card 0 the chunk where its flat
        step likely ends (:meth:`Observations.flat_end`); ``None`` where there is none or card
        0's chunk does not follow the batch one for one there."""
        c_lo, c_hi = line.c0(lo), line.c0(hi)
        if c_lo is None or c_hi is None or c_lo <= 0 or c_hi - c_lo != hi - lo:
            return None
        c = self.obs.flat_end(0, c_lo, c_hi)
        return None if c is None else lo + (c - c_lo)

    def _line_rise(self, line: BatchLine, lo: int, hi: int) -> int:
        """How far card 0's figure rises across ``line``'s bracket ``[lo, hi)``: the figure at
        the over point that sets ``hi`` less the one at the point within budget that sets
        ``lo`` (0 where either is not measured: nothing says the bracket is wide)."""
        over = self._line_over_peak(line, hi)
        within = [p.peak_bytes for p in self.obs.fit_points(0)
                  if last_within(line, p.chunk, p.batch) == lo]
        return 0 if over is None or not within else over - max(within)

    def _line_over_peak(self, line: BatchLine, hi: int) -> Optional[int]:
        """Card 0's figure at the over point that sets ``hi``, the upper end of ``line``'s
        bracket (:meth:`_line_bracket`)."""
        for p in self.obs.over_points(0):
            if p.exact and max(p.batch, first_over(line, p.chunk, p.batch)) == hi:
                return p.peak_bytes
        return None

    # ---- the largest batch --------------------------------------------------------------
    def max_certified(self) -> bool:
        best = self.obs.best_within()
        return best is not None and self.infeasible(best.batch_size + 1)

    def infeasible(self, batch: int) -> bool:
        """No split of ``batch`` fits, from measured points: with each card ``i >= 1`` at
        most ``hi_i - 1``, card 0 is left at least a chunk measured over budget."""
        caps = []
        for i in range(1, self.n):
            br = self.obs.bracket(i)
            caps.append(batch if br.hi is None else br.hi - 1)
        c0 = BatchLine(caps, self.m).c0(batch)
        return c0 is None or self.obs.card0_over(c0, batch)

    def _max_step(self) -> Optional[Proposal]:
        obs = self.obs
        fits = CardFits(obs)
        t = [self._target(i, fits) for i in range(1, self.n)]
        if fits.g is None and self.g_tries < 2:
            # card 0's cost per sample of the whole batch: card 0's chunk as in an earlier
            # probe, the others moved
            ref = next((p for p in reversed(obs.points[0]) if p.exact), None)
            if ref is not None:
                # on the simulator (every card measured, over budget or not), each open card
                # one sample above where the slope across the cards puts its cap: over there,
                # the cap is bracketed from above by a probe needed for card 0 anyway
                raise_ = fits.pooled and obs.exact_on_oom
                up = [next_chunk(x, self.m) if raise_ and not obs.bracket(i).closed else x
                      for i, x in zip(range(1, self.n), t)]
                split = (ref.chunk, *up)
                if sum(split) != ref.batch and valid_split(split, self.m) \
                        and split not in obs.by_split:
                    self.g_tries += 1
                    return Proposal(split, "fit")
        caps_lo = self._caps_lo()
        if all(x == next_chunk(lo, self.m) for x, lo, i in zip(t, caps_lo, range(1, self.n))
               if not obs.bracket(i).closed) and t != caps_lo:
            # the fits put every open card's cap at its lo: if card 0 is still predicted to
            # take more along that line, probe that (a candidate answer, every card >= 1
            # known to fit) before the cards' one-more tests
            lo_line = self._line(caps_lo)
            lo, _ = self._line_bracket(lo_line)
            b0 = self._line_target(lo_line, fits) or 0
            s0 = lo_line.split(b0) if b0 > lo else None
            if s0 is not None and (b0 > lo + 1 or self._predicted_fit(s0, fits)):
                if s0 not in obs.by_split and valid_split(s0, self.m):
                    self._last_t = tuple(caps_lo)
                    return Proposal(s0, "max")
        line = self._line(t)
        self._last_t = tuple(t)
        b = self._line_target(line, fits)
        if b is None:   # card 0 is closed on this line: move the open cards, card 0 as it was
            b = self._line_bracket(line)[0]
        for cand in (b, b + 1, b - 1):
            s = line.split(cand) if cand >= 1 else None
            if s is not None and s not in obs.by_split and valid_split(s, self.m):
                return Proposal(s, "max")
        # a split known to fit at the best batch but not probed as a whole
        lo_line = self._line(self._caps_lo())
        lo, _ = self._line_bracket(lo_line)
        known = lo_line.split(lo) if lo >= 1 else None
        best = obs.best_within()
        if known is not None and known not in obs.by_split and \
                (best is None or lo > best.batch_size):
            return Proposal(known, "max")
        return None

    def _predicted_fit(self, split: Sequence[int], fits: CardFits) -> bool:
        """The fits say every card of ``split`` is within budget (a guess, never an answer)."""
        if not valid_split(split, self.m):
            return False
        b = sum(split)
        for i, c in enumerate(split):
            p = fits.predict(i, c, b)
            if p is None or p > self.obs.budgets[i]:
                return False
        return True

    # ---- the even split's largest batch (:mod:`dptune.search.even_baseline`) -------------
    def even_bracket(self) -> tuple[int, Optional[int]]:
        return self.even.bracket()

    def even_certified(self) -> bool:
        return self.even.certified()

    # ---- the strategy -------------------------------------------------------------------
    def brackets(self) -> list[Bracket]:
        """Per card ``i >= 1`` its chunk bracket; card 0 its bracket on the batch."""
        out = [Bracket(card=i, lo=self.obs.bracket(i).lo, hi=self.obs.bracket(i).hi,
                       min_chunk=self.m) for i in range(1, self.n)]
        best = self.obs.best_within()
        lo = best.batch_size if best is not None else 0
        hi = lo + 1 if best is not None and self.infeasible(lo + 1) else None
        return [Bracket(card=0, lo=lo, hi=hi, what="batch")] + out

    def propose(self) -> Optional[Proposal]:
        obs = self.obs
        if not obs.probes:
            if self.first is not None and len(self.first) == self.n \
                    and valid_split(self.first, self.m):
                return Proposal(self.first, "start")
            s = even_split(self.hint, self.n)
            if not valid_split(s, self.m):
                s = fill(self.hint, [self.hint] * self.n, self.m) or s
            spread = self._spread(tuple(s))
            return Proposal(spread, "even" if spread == tuple(s) else "spread")
        self._record_brackets()
        halved = self._halved()
        if halved is not None:
            return halved
        even = None if not self.compare_even or self.even_certified() else self.even.step()
        if not self.max_certified():
            packed = self._packed(even)
            if packed is not None:
                return packed
            prop = self._max_step()
            if prop is not None:
                if even is not None and self._even_covers(even.split, prop.split) \
                        and not self._predicted_fit(even.split, CardFits(self.obs)):
                    # the even split's next probe puts card 0 at no more samples and no larger
                    # batch: over there means over here too (one probe for both questions)
                    return Proposal(even.split, "even-max")
                return prop
        return even

    def _halved(self) -> Optional[Proposal]:
        """On real cards, while none of two probes or more has fitted: the even split of half
        the last batch. An out-of-memory probe names one failing card only, so with many
        cards over budget the fits learn one card a probe, and an oversized first batch
        could use up every probe before anything fits (10 cards, 5 times too large: 16
        probes, none within budget); halving finds a fitting batch in about log2 of that."""
        obs = self.obs
        if obs.exact_on_oom or len(obs.probes) < 2 or any(obs.within_budget(r) for r in obs.probes):
            return None
        s = even_at_most(max(self.even.start(), obs.probes[-1].batch_size // 2), self.n, self.m)
        return Proposal(s, "max") if s is not None and s not in obs.by_split else None

    def _spread(self, s: tuple[int, ...]) -> tuple[int, ...]:
        """The first split with the cards ``i >= 1`` at two chunks (three cards or more, on
        the simulator): the last card set to card 1's share and a quarter (``torch.chunk``
        may have left it less, or none). One probe then gives a slope
        across them, so the next probe can already put each card near its cap (and one sample
        above it); the other cards keep one chunk, which the simulator runs once."""
        if self.n < 3 or not self.obs.exact_on_oom:
            return s        # real cards: an out-of-memory probe measures only the failing card
        d = s[1] // 4
        out = (*s[:-1], s[1] + d)
        return out if d > 0 and valid_split(out, self.m) else s

    def _even_covers(self, even: tuple[int, ...], prop: tuple[int, ...]) -> bool:
        """Probing ``even`` first answers ``prop``'s question when ``prop`` only asks about
        card 0 (every card ``i >= 1`` known to fit there) and ``even`` gives card 0 no more
        samples in no larger a batch (card 0 over at ``even`` is over at ``prop``)."""
        if not self._card0_question(prop):
            return False
        return even[0] <= prop[0] and sum(even) <= sum(prop)

    def _card0_question(self, split: Sequence[int]) -> bool:
        """Every card ``i >= 1`` is known to fit ``split``: a probe of it asks about card 0."""
        return all(self.obs.card_fits(i, split[i]) for i in range(1, self.n))

    # ---- packing: the cards' last tests ride along on card 0's questions -----------------
    def _packed(self, even: Optional[Proposal]) -> Optional[Proposal]:
        """When the fits say the answer is found (every open card ``i >= 1`` will close at
        one more sample, card 0 at one more sample of the whole batch), the questions left
        are card 0's (one more sample at the best batch; the even split's ``E`` and
        ``E + 1``) and one over-budget test per open card. A probe that asks card 0 fixes
        only card 0's chunk and the batch, so the other cards' chunks can be moved: raise
        open cards to their test chunk, take the samples from cards known to fit lower.
        Used only when every card is measured in every probe (the simulator) and when the
        card 0 questions left can carry every open card (otherwise one probe that raises
        every open card at once is cheaper)."""
        obs, n = self.obs, self.n
        if not obs.exact_on_oom or n < 3 or not obs.fit_points(0):
            return None
        fits = CardFits(obs)
        tests = self._card_tests(fits)
        if not tests:
            return None
        lo_line = self._line(self._caps_lo())
        lo, hi = self._line_bracket(lo_line)
        q_max: Optional[tuple[int, ...]] = None
        if hi is None or hi > lo + 1:
            if self._line_target(lo_line, fits) != lo + 1:
                return None          # card 0's cap along the line is not yet at the best batch
            q_max = lo_line.split(lo + 1)
            if q_max is None or not self._card0_question(q_max):
                return None
            if self._predicted_fit(q_max, fits):
                return None          # a candidate answer: it must be measured whole, no tests
        q_even = even.split if even is not None and self._card0_question(even.split) else None
        even_fits = q_even is not None and self._predicted_fit(q_even, fits)
        covered = q_max is not None and q_even is not None and not even_fits \
            and self._even_covers(q_even, q_max)
        questions = int(q_max is not None and not covered) + int(q_even is not None) \
            + int(even_fits)
        if len(tests) > questions * (n - 2):
            return None
        if q_even is not None and (covered or q_max is None):
            base, purpose = q_even, "even-max"
        elif q_max is not None:
            base, purpose = q_max, "max"
        else:
            return None
        split = raise_cards(base, tests, self.n, self.m)
        if split is None or split in obs.by_split or not valid_split(split, self.m):
            return None
        return Proposal(split, f"{purpose}+cards")

    def _card_tests(self, fits: CardFits) -> Optional[dict[int, int]]:
        """Each open card ``i >= 1``'s one-more-sample test chunk, when the fits put every
        open card's cap at its ``lo`` (``None`` otherwise)."""
        tests: dict[int, int] = {}
        for i in range(1, self.n):
            br = self.obs.bracket(i)
            if br.closed:
                continue
            x = self._target(i, fits)
            if br.lo <= 0 or x != next_chunk(br.lo, self.m):
                return None          # the fits do not yet put this card's cap at lo
            tests[i] = x
        return tests
