"""Balance: the split of a fixed batch with the lowest largest share of budget.

Probe the even split and a second split that changes every card's chunk; fit each card near
the split of interest (a secant through its two nearest measured points; card 0 only on
points at this batch, chunk 0 apart); solve for the split that minimises the largest share
(:func:`dptune.solve.memory.solve_balance`), with every card capped below a chunk measured over
budget; verify it with a probe. When the probe matches its prediction within ``tolerance``,
one more probe certifies it: every card whose next chunk is not yet known to reach the
largest share is given one more sample (the heaviest card gives them). Where a card's figure
rises in steps (two chunks measured with one figure: the reserved level), one more sample
stays on the step, and the probe tests the largest share ``L`` instead
(:meth:`Balance._level_test`): every card at the same fraction of the range where its last
chunk below ``L`` lies, so each probe narrows every card's range at once.

The certificate (:meth:`Balance.proven`): for a share level ``L``, each card may take at
most the chunk before the first one measured at or above ``L`` (memory is non-decreasing);
when these add up to less than the batch, every split has a card at ``L`` or more. Proven
at the returned split's largest share, the split is optimal. When card 0 with no samples
already holds the largest share (its master weights, gradients, optimizer state and
gathered outputs), no split can do better: certified at once.

On real cards an out-of-memory probe measures only the failing card: near the largest batch
the probes of this batch could each learn one card and none fit. Once a card other than card 0
has run out, the balance first probes at a smaller batch (:meth:`Balance._scout`), where every
card is measured, and a card's line that its out-of-memory probe shows too low is turned up
through that probe's figure (:meth:`dptune.search.models.CardFits._lifted`).

Ties are ties: alike cards (the same card with the same memory held by others, as the
caller names them; :mod:`dptune.search.alike`) share their measurements and every split
the solver proposes gives them chunks within one sample of each other. When the even split
was measured within budget and its largest share is within ``tolerance`` (relative) of the
floor the probes prove, it is kept (:meth:`Balance.even_kept`): a changed split would gain
nothing worth the change (one probe when the even split's own shares are that close).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dptune.solve import memory as solver
from dptune.backends.base import ProbeResult
from dptune.errors import NoFeasibleSplitError
from dptune.search.alike import spread
from dptune.search.loop import Proposal, even_at_most, valid_split
from dptune.search.messages import card0_holdings, infeasible_error
from dptune.search.models import MIN_SLOPE_BYTES, CardFits
from dptune.search.observations import Bracket, Observations, next_chunk, round_middle, roundest
from dptune.split import even_split
from dptune.types import card_in_use
from dptune.units import format_bytes

__all__ = ["Balance"]

#: Fraction of the donor card's chunk moved by the second probe.
SECOND_SPLIT_SHARE = 0.25

#: Real cards: at most this many halved scouts while none fits (a card 0 that holds no sample
#: at all runs out in every one of them; the shift at the batch then moves its samples off).
MAX_HALVINGS = 5


class Balance:
    """The balance strategy (see the module docstring)."""

    def __init__(self, obs: Observations, batch: int, max_probes: int, tolerance: float,
                 notes: list[str], keep_even: bool = True):
        self.obs = obs
        #: whether an even split within the tolerance ends the search (not when the search
        #: only maps memory for the throughput objective, which needs the cards' slopes)
        self.keep_even = keep_even
        self.B = batch
        self.n = obs.n
        self.m = obs.min_chunk
        self.max_probes = max_probes
        self.tol = tolerance
        self.notes = notes
        self.pred: dict[tuple[int, ...], list[float]] = {}

    # ---- what the probes prove ----------------------------------------------------------
    def heaviest(self, r: ProbeResult) -> tuple[int, float]:
        s = self.obs.shares(r)
        h = max(range(self.n), key=lambda i: (s[i], -i))
        return h, s[h]

    def floor(self, r: ProbeResult) -> bool:
        """Card 0 with no samples holds the largest share: no split can do better."""
        h, _ = self.heaviest(r)
        return h == 0 and r.chunk_sizes[0] == 0

    def first_at(self, i: int, level: float) -> Optional[int]:
        """The smallest chunk at which card ``i`` was measured (on an alike card too) at or
        above ``level`` of its budget with a batch at most this one; ``None``: none was.
        Every larger chunk is at or above ``level`` too (memory is non-decreasing)."""
        bud = self.obs.budgets[i]
        return min((p.chunk for p in self.obs.points[i]
                    if card_in_use(i, p.chunk) and (i > 0 or p.batch <= self.B)
                    and bud > 0 and p.peak_bytes / bud >= level), default=None)

    def proven(self, level: float) -> bool:
        """No split of the batch gives every card a share below ``level``: the chunks each
        card may take below it (up to the chunk before the first one measured at or above
        it) add up to less than the batch, or card 0 reaches it with no samples at all."""
        total = 0
        for i in range(self.n):
            if self.obs.budgets[i] <= 0:    # no room at all: card 0 holds the weights in
                if i == 0:                  # every split; another card takes no samples
                    return True
                continue
            f = self.first_at(i, level)
            if f is None:
                return False            # nothing bounds this card below the level
            if f == 0:
                return True             # card 0 with no samples: every split reaches it
            c = f - 1
            total += 0 if 0 < c < self.m else c
        return total < self.B

    def none_fits(self) -> bool:
        """The probes prove that no split of the batch fits: :meth:`proven` just above a
        share of 1 (every point counted is over its budget, a lower bound included)."""
        return self.proven(math.nextafter(1.0, math.inf))

    def floor_level(self) -> float:
        """The largest share the probes prove every split of the batch reaches (0 if none)."""
        levels = sorted({p.peak_bytes / self.obs.budgets[i] for i in range(self.n)
                         for p in self.obs.points[i] if self.obs.budgets[i] > 0
                         and card_in_use(i, p.chunk) and (i > 0 or p.batch <= self.B)})
        lo, hi, best = 0, len(levels) - 1, 0.0
        while lo <= hi:             # proven() is true up to some level, false above it
            mid = (lo + hi) // 2
            if self.proven(levels[mid]):
                best, lo = levels[mid], mid + 1
            else:
                hi = mid - 1
        return best

    def brackets(self, r: ProbeResult, level: Optional[float] = None) -> list[Bracket]:
        """Per card: ``[its chunk, the first chunk measured at or above the level)`` (the
        largest share of ``r`` unless given), closed when that is its next chunk."""
        level = max(self.obs.shares(r)) if level is None else level
        floor = self.floor(r)
        out = []
        for i, c in enumerate(r.chunk_sizes):
            nxt = next_chunk(c, self.m)
            f = self.first_at(i, level)
            hi = nxt if floor or (f is not None and f <= nxt) else f
            out.append(Bracket(card=i, lo=c, hi=hi, min_chunk=self.m))
        return out

    def certified(self, r: ProbeResult) -> bool:
        return self.floor(r) or self.proven(max(self.obs.shares(r)))

    def even_kept(self) -> Optional[tuple[ProbeResult, float]]:
        """The even split's probe and the floor the probes prove, when the even split was
        measured within budget and its largest share is within ``tolerance`` (relative) of
        that floor: no split can lower it by more, so the even split is kept."""
        even = self.obs.by_split.get(tuple(even_split(self.B, self.n)))
        if not self.keep_even or even is None or not self.obs.within_budget(even):
            return None
        level = self.floor_level()
        return (even, level) if max(self.obs.shares(even)) <= (1 + self.tol) * level else None

    def _certificate_split(self, r: ProbeResult) -> Optional[tuple[int, ...]]:
        h, _ = self.heaviest(r)
        split = list(r.chunk_sizes)
        for b in self.brackets(r):
            if not b.closed:
                step = next_chunk(b.lo, self.m) - b.lo
                split[b.card] += step
                split[h] -= step
        if not valid_split(split, self.m) or min(split) < 0:
            return None
        return tuple(split)

    def _on_steps(self) -> bool:
        """Some card was measured at two chunks (card 0: at this batch) with one figure: its
        figure rises in steps (the reserved level), where one more sample tells little."""
        for i in range(self.n):
            seen: dict[int, int] = {}
            for p in self.obs.points[i]:
                if p.exact and p.chunk > 0 and (i > 0 or p.batch == self.B):
                    if seen.setdefault(p.peak_bytes, p.chunk) != p.chunk:
                        return True
        return False

    def _level_test(self, r: ProbeResult, cliffs: Sequence[int] = ()) -> Optional[tuple[int, ...]]:
        """A split that tests whether every card fits below the largest share ``L`` of ``r``.
        Each card's largest chunk below ``L`` lies between the largest measured below it
        (``lo``) and the chunk before the first measured at or above it (``hi``; from its line
        where none is); its line puts it at ``t`` in that range. When the ``t`` add up to the
        batch or more, the cards take the same fraction of ``[lo, t]`` (the probe may find a
        split below ``L``); else they take ``t`` and share the rest in proportion to
        ``(t, hi]`` (the probe may find the certificate: the ``hi`` adding up to less than the
        batch). Either way each card the probe finds at or above ``L`` lowers its ``hi`` and
        each below it raises its ``lo``, where one more sample per card can stay on a flat
        step of the staircase. When the ``lo`` alone add up to the batch, a split below ``L``
        is known (memory never falls as the work grows): the cards take the same fraction of
        ``[0, lo]``. A line flat to the byte places nothing. ``None`` when the ranges leave
        nothing to test.

        ``cliffs``: cards whose fits missed (:meth:`missed_cards`). The one of them with
        the widest open range is not placed by its line but on a round chunk of the range
        (:func:`~dptune.search.observations.round_middle`, or the one-more test above a round
        ``lo``: a staircase's cliffs rise where a block crosses a power of two), the others
        sharing the rest within their ranges: a bisection of that card's range."""
        level = max(self.obs.shares(r))
        lows, tops, highs = [], [], []
        cf = CardFits(self.obs, across_steps=True)
        for i in range(self.n):
            bud = self.obs.budgets[i]
            if bud <= 0:
                return None
            below = [p.chunk for p in self.obs.points[i] if p.exact and card_in_use(i, p.chunk)
                     and (i > 0 or p.batch >= self.B) and p.peak_bytes / bud < level]
            lo = max(below, default=0)
            f = self.first_at(i, level)
            line = cf.card0_line(max(lo, 1), self.B) if i == 0 else cf.card_line(i, max(lo, 1))
            guess = None if line is None or line.slope <= MIN_SLOPE_BYTES else \
                math.ceil((level * bud - line.intercept) / line.slope)
            if f is None:
                if guess is None:
                    return None
                f = max(lo + 1, guess)
            hi = max(lo, f - 1)
            lows.append(lo)
            highs.append(hi)
            tops.append(hi if guess is None else min(hi, max(lo, guess - 1)))
        if sum(highs) < self.B or sum(highs) == sum(lows):
            return None
        for pinned in (self._on_cliff(cliffs, lows, tops, highs), None):
            if pinned is not None:
                split = pinned
            elif sum(lows) >= self.B:     # every card below L at its lo: a split below L, measured
                split = _spread([0] * self.n, lows, self.B)
            else:
                split = _fill(lows, tops, highs, self.B)
            key = spread(_fix_batchnorm(split, self.m), self.obs.groups, self.m)
            if sum(key) == self.B and valid_split(key, self.m) and key not in self.obs.by_split:
                return key
        return None

    def _on_cliff(self, cliffs: Sequence[int], lows: list[int], tops: list[int],
                  highs: list[int]) -> Optional[list[int]]:
        """The level test's split with the cliff card of the widest open range on a round
        chunk of it, and its alike cards with it (see :meth:`_level_test`); ``None`` when no
        such card or the other cards cannot take the rest within their ranges."""
        open_ = [i for i in cliffs if highs[i] > lows[i]]
        if not open_ or sum(lows) >= self.B:    # a split below L already measured: spread it
            return None
        i = max(open_, key=lambda k: (highs[k] - lows[k], -k))
        lo, hi = lows[i], highs[i] + 1
        c = roundest(lo, hi, self.m)
        if c != next_chunk(lo, self.m):
            c = round_middle(lo, hi, self.m)
        if c is None:
            return None
        pinned = next((set(g) for g in self.obs.groups if i in g), {i})
        others = [k for k in range(self.n) if k not in pinned]
        rest = self.B - c * len(pinned)
        o_lows, o_tops, o_highs = ([v[k] for k in others] for v in (lows, tops, highs))
        if not others or not sum(o_lows) <= rest <= sum(o_highs):
            return None
        split = [c] * self.n
        for k, x in zip(others, _fill(o_lows, o_tops, o_highs, rest)):
            split[k] = x
        return split

    # ---- fits -------------------------------------------------------------------------
    def fits(self, target: Sequence[int]) -> Optional[list[solver.Fit]]:
        cf = CardFits(self.obs, across_steps=True)
        out: list[solver.Fit] = []
        for i in range(self.n):
            if i == 0:
                line = cf.card0_line(max(target[0], 1), self.B)
                if line is None:
                    return None
                zero = [p for p in self.obs.points[0] if p.exact and p.chunk == 0 and p.batch == self.B]
                out.append(solver.Fit(line.intercept, line.slope,
                                      zero_bytes=float(zero[-1].peak_bytes) if zero else None))
            else:
                line = cf.card_line(i, max(target[i], 1))
                if line is None:
                    return None
                out.append(solver.Fit(line.intercept, line.slope))
        return out

    def caps(self) -> list[Optional[int]]:
        """Each card's largest chunk not measured over budget at this batch (or below)."""
        out: list[Optional[int]] = []
        for i in range(self.n):
            overs = [p.chunk for p in self.obs.over_points(i) if i > 0 or p.batch <= self.B]
            out.append(min(overs) - 1 if overs else None)
        return out

    def error(self, r: ProbeResult) -> float:
        """Largest miss of the prediction for a probe, as a share of each card's budget (or of
        its peak where that is smaller)."""
        return max(self.card_error(r, i) for i in range(self.n))

    def card_error(self, r: ProbeResult, i: int) -> float:
        """The miss of the prediction for card ``i`` in a probe (see :meth:`error`); 0 for a
        card that ran no replica, infinite for a probe that was not predicted or failed."""
        pred = self.pred.get(tuple(r.chunk_sizes))
        if pred is None or not r.feasible:
            return float("inf")
        p, q, b, c = r.peak_bytes[i], pred[i], self.obs.budgets[i], r.chunk_sizes[i]
        if not card_in_use(i, c):
            return 0.0
        scale = min(b, max(p, q))
        return abs(p - q) / scale if scale > 0 else float("inf")

    def missed_cards(self) -> set[int]:
        """Cards whose fits missed (beyond the tolerance) on a refine probe. Asked once the
        fits missed twice (``misled``): a cliff in such a card's figure, whose place no line
        tells."""
        refine = [p for p in self.obs.probes if p.purpose == "refine" and p.feasible]
        return {i for i in range(self.n) if any(self.card_error(p, i) > self.tol for p in refine)}

    # ---- the second split -------------------------------------------------------------
    def shift(self, base: Sequence[int], r: Optional[ProbeResult]) -> list[int]:
        """Every card changed: the heaviest card (or the one that ran out of memory) gives a
        share of its samples, in equal parts, to every other card."""
        n, m = self.n, self.m
        base = list(base)
        if r is not None and not r.feasible:
            donor = int(r.oom_device)  # type: ignore[arg-type]
        elif r is not None:
            donor = self.heaviest(r)[0]
        else:
            donor = 0
        if base[donor] == 0:
            donor = max(range(n), key=lambda i: (base[i], -i))
        receivers = [i for i in range(n) if i != donor]
        streak = 0   # the donor ran out of memory this many times in a row: move more
        for q in reversed(self.obs.probes):
            if q.feasible or q.oom_device != donor:
                break
            streak += 1
        share = min(1.0, SECOND_SPLIT_SHARE * 2 ** max(0, streak - 1))
        k = max(1, round(share * base[donor] / max(1, len(receivers))))
        k = min(k, base[donor] // max(1, len(receivers)))
        out = list(base)
        if k >= 1:
            for i in receivers:
                give = k if out[i] > 0 else max(k, m)
                if out[donor] - give < 0:
                    continue
                out[i] += give
                out[donor] -= give
        else:
            for i in receivers:
                give = 1 if out[i] > 0 else m
                if out[donor] >= give:
                    out[i] += give
                    out[donor] -= give
        return _fix_batchnorm(out, m)

    # ---- real cards: learn the cards below the batch ------------------------------------
    def _scout(self) -> Optional[Proposal]:
        """On real cards, while nothing at this batch was measured within budget: two probes
        at a smaller batch. An out-of-memory probe measures only the failing card (the
        others' peaks are lower bounds), so near the largest batch the probes at this batch
        can each learn one card, and none fits (8 cards, 12 probes). A smaller batch fits
        and measures every card: first the even split of half the smallest batch probed
        (again while none fits), then that split with card 0 at its chunk and every other
        card a quarter fewer samples (it fits: no card has more work): every card's slope,
        and card 0's cost per sample of the whole batch. The fits then solve for this batch,
        and the probes at this batch decide as on the simulator."""
        obs, B = self.obs, self.B
        if obs.exact_on_oom or obs.best_within(B) is not None or \
                not any(r.oom_device not in (None, 0) for r in obs.probes):
            return None     # only card 0 ran out: its holdings, which the shift moves off
        fitted = [r for r in obs.probes if obs.within_budget(r)]
        if not fitted:
            if sum(r.purpose == "scout" for r in obs.probes) >= MAX_HALVINGS:
                return None     # card 0 may hold no sample at all: the shift at this batch
            half = even_at_most(min(r.batch_size for r in obs.probes) // 2, self.n, self.m)
            return Proposal(half, "scout") if half is not None and half not in obs.by_split \
                else None
        if len(fitted) >= 2:
            return None
        base = fitted[0].chunk_sizes
        s = [base[0]] + [c - max(1, c // 4) if c > self.m else c for c in base[1:]]
        key = tuple(_fix_batchnorm(s, self.m))
        return Proposal(key, "scout") if sum(key) > 0 and key != tuple(base) \
            and key not in obs.by_split else None

    # ---- the strategy -------------------------------------------------------------------
    def propose(self) -> Optional[Proposal]:
        obs, B, n = self.obs, self.B, self.n
        even = even_split(B, n)
        if not obs.probes:
            if valid_split(even, self.m):
                return Proposal(tuple(even), "even")
            self.notes.append(f"the even split {even} gives a card a single sample, which "
                              "BatchNorm cannot train on; it was not probed")
            return Proposal(tuple(self.shift(even, None)), "fit")
        if n == 1 or self.even_kept() is not None:
            return None
        scout = self._scout()
        if scout is not None:
            return scout
        if len(obs.probes) == 1:
            s = tuple(self.shift(obs.probes[0].chunk_sizes, obs.probes[0]))
            if s not in obs.by_split and sum(s) == B:
                return Proposal(s, "fit")
        self._check_card0_alone()
        last = obs.probes[-1]
        best = obs.best_within(B)
        if best is not None and self.certified(best):
            # alike cards more than one sample apart (a floor certifies any split): spread
            # them; no card's peak rises, so the spread split is certified as well
            s = spread(best.chunk_sizes, obs.groups, self.m)
            return Proposal(s, "alike") if s not in obs.by_split else None
        good = (best is not None and last is best and last.purpose in ("verify", "refine")
                and self.error(last) <= self.tol)
        # fits that missed twice (a cliff in a card's figure, say): the level tests lead; on a
        # staircase they stand in for the one-more-sample certificate below
        misled = sum(p.purpose == "refine" and self.error(p) > self.tol for p in obs.probes) >= 2
        steps = self._on_steps()
        test = self._level_test(best, sorted(self.missed_cards()) if misled else ()) \
            if best is not None and (misled or steps) else None
        if misled and test is not None:
            return Proposal(test, "certify")
        if not good:
            prop = self._solve(last)
            if prop is not None:
                return prop
            if best is None:
                return None
        assert best is not None
        cert = (test if steps else None) or self._certificate_split(best)
        if cert is None or cert in obs.by_split:
            return self._solve(last) if good else None
        return Proposal(cert, "certify")

    def _solve(self, last: ProbeResult) -> Optional[Proposal]:
        obs, B = self.obs, self.B
        target = list(last.chunk_sizes) if last.batch_size == B else even_split(B, self.n)
        fits = self.fits(target)
        if fits is None:
            at_b = next((r for r in reversed(obs.probes) if r.batch_size == B), None)
            s = tuple(self.shift(at_b.chunk_sizes, at_b)) if at_b is not None else None
            return Proposal(s, "fit") if s is not None and s not in obs.by_split else None
        caps = self.caps()
        try:
            prop = solver.solve_balance(fits, obs.budgets, B, min_chunk_nonzero=self.m,
                                        caps=caps, strict=False)
        except NoFeasibleSplitError:
            # the cards may not take the batch below the chunks measured over budget: no
            # split fits; the shortfall is the fits' estimate for the best split without caps.
            # A split of the batch measured within budget says the figure is not monotone
            # (a chunk over below one within): that split stands, nothing is raised
            if obs.best_within(B) is not None:
                return None
            raise self.no_split(fits) from None
        prop = list(spread(prop, self.obs.groups, self.m))
        peaks = solver.predict(fits, prop, B)
        over = max(solver.shares_of(peaks, obs.budgets, prop)) > 1.0
        if over and self.error(last) <= self.tol and last.purpose in ("verify", "refine") \
                and obs.best_within(B) is None:     # a split measured within budget stands
            worst, short = self._tightest(prop, peaks)
            raise infeasible_error(worst, short, B,
                                   f"predicted for the best split {list(prop)} by fits "
                                   f"the last probe matched within {self.tol:.0%}",
                                   proven=self.none_fits())
        key = tuple(prop)
        if key in obs.by_split:
            return None
        self.pred[key] = peaks
        verified = any(p.purpose in ("verify", "refine") for p in obs.probes)
        return Proposal(key, "refine" if verified else "verify")

    # ---- errors -----------------------------------------------------------------------
    def _check_card0_alone(self) -> None:
        for p in self.obs.over_points(0):
            if p.chunk == 0 and p.batch <= self.B:
                raise infeasible_error(
                    0, None, self.B,
                    f"card 0 runs out of memory with no samples at all ({card0_holdings(self.obs.probes)} "
                    "of the whole batch)", probes=self.obs.probes, budgets=self.obs.budgets)

    def no_split(self, fits: Optional[Sequence[solver.Fit]] = None) -> NoFeasibleSplitError:
        """The error when nothing at this batch was measured within budget."""
        obs = self.obs
        # proven: the chunks each card may take below a chunk measured over budget add up to
        # less than the batch (or card 0 is over with no samples); else the probes ran out
        proven = self.none_fits()
        if fits is not None:
            best = self._predicted_best(fits)
            if best is not None:
                worst, short, prop = best
                return infeasible_error(worst, short, self.B,
                                        f"measured caps leave no split; predicted for the best "
                                        f"split {prop}", proven=proven)
        fits = None if proven else self.fits(even_split(self.B, self.n))
        best = None if fits is None else self._predicted_best(fits)
        predicted, far = "", False
        if best is not None:    # not proven: what the fits say, a prediction
            worst, short, prop = best
            verdict = "also over" if short > 0 else "within budget"
            amount = f", card {worst} by {format_bytes(max(short, 0))}" if short > 0 else ""
            predicted = (f"; the fits predict the best split {prop} {verdict}{amount} "
                         "(a prediction, not a measurement)")
            far = short > self.tol * obs.budgets[worst]
        measured = [r for r in obs.probes if r.feasible and r.batch_size == self.B]
        if measured:
            def over(r: ProbeResult) -> tuple[float, int]:
                return max((p - b, i) for i, (p, b, c) in enumerate(
                    zip(r.peak_bytes, obs.budgets, r.chunk_sizes)) if card_in_use(i, c))
            r = min(measured, key=over)
            short, card = over(r)
            return infeasible_error(card, short, self.B,
                                    f"measured for the best split {list(r.chunk_sizes)}"
                                    f"{predicted}", proven=proven, likely=far)
        at_b = [r for r in obs.probes if r.batch_size == self.B]
        failed = at_b[-1].oom_device if at_b else None
        every = "the one probe" if len(at_b) == 1 else f"every one of the {len(at_b)} probes"
        return infeasible_error(failed, None, self.B,
                                f"{every} of this batch ran out of memory{predicted}",
                                probes=at_b, budgets=obs.budgets, proven=proven, likely=far)

    def _predicted_best(self, fits: Sequence[solver.Fit]
                        ) -> Optional[tuple[int, float, list[int]]]:
        """The fits' best split of the batch (no caps), its tightest card and how far over
        its budget it is predicted (bytes; negative: within); ``None`` where the solver
        finds no split at all (a budget of nothing, the BatchNorm rule)."""
        obs = self.obs
        try:
            prop = solver.solve_balance(fits, obs.budgets, self.B, min_chunk_nonzero=self.m,
                                        strict=False)
        except NoFeasibleSplitError:
            return None
        worst, short = self._tightest(prop, solver.predict(fits, prop, self.B))
        return worst, short, list(prop)

    def _tightest(self, split: Sequence[int], peaks: Sequence[float]) -> tuple[int, float]:
        """The card in use furthest over (or least within) its budget in ``split`` and by how
        many bytes (negative: within)."""
        bud = self.obs.budgets
        worst = max(range(self.n), key=lambda i: (peaks[i] - bud[i])
                    if card_in_use(i, split[i]) else -float("inf"))
        return worst, peaks[worst] - bud[worst]


def _fix_batchnorm(split: list[int], m: int) -> list[int]:
    """No card gets 1..m-1 samples (BatchNorm)."""
    if m < 2:
        return split
    split = list(split)
    for j in range(len(split)):
        if 0 < split[j] < m:
            others = [k for k in range(len(split)) if k != j and split[k] > 0]
            if not others:
                break
            k = max(others, key=lambda k: (split[k], -k))
            split[k] += split[j]
            split[j] = 0
    return split


def _fill(lows: Sequence[int], tops: Sequence[int], highs: Sequence[int], total: int) -> list[int]:
    """``total`` samples over cards with ranges ``lows <= tops <= highs`` (the level test's):
    the same fraction of each ``[lo, top]`` when the tops hold the total, else every card at
    its top and the rest in proportion to each ``(top, high]``."""
    if sum(tops) >= total:
        return _spread(lows, tops, total - sum(lows))
    return _spread(tops, highs, total - sum(tops))


def _spread(lows: Sequence[int], highs: Sequence[int], extra: int) -> list[int]:
    """``lows`` plus ``extra`` samples shared in proportion to each ``highs - lows`` (none past
    its high; the remainder one by one, most room first)."""
    span = sum(h - lo for lo, h in zip(lows, highs))
    out = [lo + (extra * (h - lo)) // span if span > 0 else lo for lo, h in zip(lows, highs)]
    left = extra - (sum(out) - sum(lows))
    while left > 0 and any(o < h for o, h in zip(out, highs)):
        for i in sorted(range(len(out)), key=lambda i: (out[i] - highs[i], i)):
            if left > 0 and out[i] < highs[i]:
                out[i] += 1
                left -= 1
    return out
