"""The certified search: brackets from measured probes, fits only to choose the next probe.

- :mod:`dptune.search.observations`: the points each probe gives each card, and the
  brackets ``[lo, hi)`` (measured within budget, measured over) they imply;
- :mod:`dptune.search.models`: local fits that pick the next point inside a bracket;
- :mod:`dptune.search.loop`: one refine loop, propose -> cached probe -> update -> accept;
- :mod:`dptune.search.balance` and :mod:`dptune.search.max_batch`: the two objectives as
  strategies of that loop.

:func:`run` is the entry point: it returns a :class:`SearchOutcome` (only splits a probe
measured within every budget are ever returned).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Hashable, NamedTuple, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.search.alike import Groups, groups_of, spread
from dptune.search.balance import Balance
from dptune.search.even_baseline import ON_MODEL, ModelDisagrees, OnModel, on_the_model
from dptune.search.loop import Proposal, measure, refine
from dptune.search.max_batch import MaxBatch
from dptune.errors import NoFeasibleSplitError
from dptune.search.messages import card0_holdings, fixed_costs_fill, infeasible_error
from dptune.search.models import CardFits
from dptune.search.observations import Bracket, Observations, Point
from dptune.search.past_falls import RESERVE, KeepForFalls, Past, brackets_of, past_the_falls
from dptune.solve.discrete import least_largest_share
from dptune.solve.memory import Fit
from dptune.split import even_split
from dptune.types import BalanceMap, EvenLine, MapCheck, Objective, WindowCheck, card_in_use

__all__ = ["SearchOutcome", "run", "Bracket", "Observations", "Proposal", "IMPLIED", "LookPast"]

#: ``look(split, over, min_chunk=m)``: past a largest-batch certificate's over points, on a
#: model of the figure (:meth:`dptune.backends.simulated.SimulatedBackend.look_past`):
#: ``split`` the answer, ``over[i]`` the smallest chunk card ``i >= 1`` was measured over at,
#: ``over[0]`` not ``None`` to look at card 0 (along the least it can take of every larger
#: batch, the others at their caps ``over[i] - 1``)
LookPast = Callable[..., WindowCheck]
#: ``map(split, share, min_chunk=m, alike=keys)``: every card's figure at every chunk of
#: ``split``'s batch that could hold it at or below ``share`` of its budget, on a model of the
#: figure (:meth:`dptune.backends.simulated.SimulatedBackend.balance_map`); ``None`` where
#: the model cannot draw it
MapBalance = Callable[..., Optional[BalanceMap]]
#: ``line(lo, min_chunk=m, upto=b)``: the even split's largest batch past ``lo`` (an even batch
#: known to fit; ``upto``: where the answer is expected at most), every even batch replayed on
#: a model of the figure
#: (:meth:`dptune.backends.simulated.SimulatedBackend.even_line`); ``None`` where the model
#: cannot draw it
EvenLineOf = Callable[..., Optional[EvenLine]]


@dataclass(frozen=True)
class SearchOutcome:
    """What one search found.

    ``best``: the probe of the split returned (measured within every budget). ``even``: the
    probe of the even split compared with (balance: at the same batch; max_batch: at the
    even split's largest batch, every even batch up to it fitting, as a user raising the
    batch finds it), ``None`` when none was measured within budget;
    ``even_split``: that split. ``even_implied_by``: when not empty, the even split was not
    probed itself; it is known to fit because these probes (1-based) measured every card
    within budget at a chunk (card 0: a chunk and a batch) at least as large, and ``even``'s
    peaks are upper bounds from them (the surface is monotone, see
    :mod:`dptune.search.observations`). ``even_open``: max_batch only, the even split's
    largest batch ``E`` was not bracketed to one sample: ``even`` is at the lower end
    (``E >= even.batch_size``, measured or implied, never less than the probes prove) and
    ``even_at_most`` the upper end (``E <= even_at_most``; ``None`` when nothing bounds it
    yet). ``certified``: the answer is proven (see the objectives). ``even_kept``: balance
    only, the even split is returned because the probes prove no split lowers its largest
    share by more than the tolerance (relative; ``certified`` then means that, and the
    brackets are taken at the proven floor).
    """

    best: ProbeResult
    even: Optional[ProbeResult]
    even_split: tuple[int, ...]
    even_implied_by: tuple[int, ...]
    probes: tuple[ProbeResult, ...]
    fits: tuple[Fit, ...]
    brackets: tuple[Bracket, ...]
    certified: bool
    card0_floor: bool
    notes: tuple[str, ...]
    even_open: bool = False
    even_at_most: Optional[int] = None
    even_kept: bool = False
    #: where the probes, or the look past the over points, contradict a figure that grows
    #: with the work (fragmentation at the reserved level: :meth:`Observations.not_monotone`),
    #: which leaves the answer uncertified unless the look proved a split past the fall
    #: (:mod:`dptune.search.past_falls`)
    not_monotone: Optional[str] = None
    #: max_batch with a look past the over points (``Known.look_past``): what the last look
    #: found
    window: Optional[WindowCheck] = None
    #: balance with a map of the figure (``Known.balance_map``): what solving it found
    mapped: Optional[MapCheck] = None
    #: max_batch with an even line on a model of the figure (``Known.even_line``): the even
    #: split's largest batch read there, which checked the probes' reading or replaced it
    #: (``even`` is then its split at that batch, simulated beside the probes unless a probe
    #: measured it; ``even_open`` false); ``None`` where the model drew none
    even_line: Optional[EvenLine] = None
    #: ``even`` is at the batch the model found, not the probes' reading (``even_line``)
    even_on_model: bool = False


def _fits(obs: Observations, split: Sequence[int]) -> tuple[Fit, ...]:
    """One fit per card near ``split`` (card 0 with its cost per sample of the whole batch)."""
    cf = CardFits(obs)
    b = sum(split)
    out = []
    for i, c in enumerate(split):
        if i == 0:
            line = cf.card0_line(max(c, 1), b)
            g = cf.g or 0.0
            zero = cf.predict0(0, b) if c == 0 else None
            fit = None if line is None else Fit(line.intercept - g * b, line.slope, g,
                                                 points=len(obs.points[0]), zero_bytes=zero)
        else:
            line = cf.card_line(i, max(c, 1))
            fit = None if line is None else Fit(line.intercept, line.slope,
                                                 points=len(obs.points[i]))
        if fit is None:
            peak = max((p.peak_bytes for p in obs.points[i] if p.exact), default=0)
            fit = Fit(float(peak), 0.0, points=1)
        out.append(_with_error(fit, obs.points[i], card0=(i == 0)))
    return tuple(out)


def _with_error(fit: Fit, points: Sequence[Point], card0: bool) -> Fit:
    """``fit`` with its ``points`` and ``max_error_bytes`` taken over every measured point of
    the card (within budget or over it, at any batch), not only the two the line was drawn
    through: a line that misses a probe by 2.7 GiB says so. Card 0 with no samples runs no
    replica (a step, not a point of the line: ``zero_bytes``), so those points are left out."""
    measured = [p for p in points if p.exact and not (card0 and p.chunk == 0)]
    if not measured:
        return fit
    err = max(abs(fit.predict(p.chunk, p.batch) - p.peak_bytes) for p in measured)
    return replace(fit, max_error_bytes=float(err), points=len(measured))


def _implied(obs: Observations, split: tuple[int, ...]) -> Optional[tuple[ProbeResult, tuple[int, ...]]]:
    """The even split known to fit without a probe of its own (see
    :meth:`Observations.fit_witness`): its peaks are upper bounds taken from the probes that
    imply it, named in ``purpose`` (1-based, as the probes are listed)."""
    w = obs.fit_witness(split)
    if w is None:
        return None
    peaks, used = w
    names = ", ".join(f"#{k + 1}" for k in used)
    r = ProbeResult(split, peaks, purpose=f"{IMPLIED} {names}",
                    note="not probed itself: every card at most as loaded as in probe(s) "
                         f"{names}, measured within budget; peaks are upper bounds")
    return r, tuple(k + 1 for k in used)


#: ``purpose`` of an even split known to fit from other probes (by dominance), not probed.
IMPLIED = "implied by probe"


@dataclass(frozen=True)
class Known:
    """What other searches on these cards already measured: ``over``, probes of a surface at
    most as high as this one (the same splits at a shorter length), whose over-budget cards
    bound the brackets from above here (:meth:`Observations.add_bound`); ``prior``, probes of
    another search whose measurements of the cards ``prior_cards`` still hold here
    (``output_device="auto"``: the cards that neither gather the outputs nor held them); their
    points narrow those cards' brackets, they are never returned. ``alike``: one key per card,
    equal for the same card with the same memory held by others
    (:func:`dptune.search.alike.device_keys`); cards ``i >= 1`` with equal keys and budgets get
    chunks within one sample of each other (they share their measurements; max_batch: an
    answer that leaves them further apart is spread by one more probe; see
    :mod:`dptune.search.alike`). ``None``: no two cards are taken to be alike.
    ``look_past``: a model of the cards' figure that can look past a certificate's over
    points (:data:`LookPast`; the simulator at the reserved level, where fragmentation can
    make the figure fall as the work grows); ``balance_map``: the same model's map of every
    chunk a balance's cards can take (:data:`MapBalance`), solved exactly after the
    balance's probes, whether they certified their answer or not; ``even_line``: the
    same model's even split at every batch (:data:`EvenLineOf`), which checks the
    largest-batch search's even baseline, or closes its bracket where the probes left it
    open."""

    over: Sequence[ProbeResult] = ()
    prior: Sequence[ProbeResult] = ()
    prior_cards: Sequence[int] = ()
    alike: Optional[Sequence[Hashable]] = None
    look_past: Optional[LookPast] = None
    balance_map: Optional[MapBalance] = None
    even_line: Optional[EvenLineOf] = None


def run(probe: Callable[[Sequence[int]], ProbeResult], budgets: Sequence[int], objective: str,
        batch_size: int, *, min_chunk: int = 1, max_probes: int = 12, tolerance: float = 0.02,
        exact_on_oom: bool = True, on_probe: Callable[[], None] = lambda: None,
        known: Known = Known(), compare_even: bool = True,
        first_split: Optional[Sequence[int]] = None) -> SearchOutcome:
    """Search for the balanced split of ``batch_size`` (``objective="balance"``) or the
    largest batch (``"max_batch"``, from ``batch_size`` as a first guess).

    ``probe(split)`` runs one training step; ``budgets`` are bytes per card; ``min_chunk=2``
    under BatchNorm (no card gets a single sample); ``exact_on_oom``: an out-of-memory probe
    still measures every card (the simulator) rather than only the failing one (real cards).
    ``known``: what is known of these cards before the search: other searches'
    measurements, and which cards are alike (:class:`Known`).
    ``compare_even=False`` (``max_batch``): the even
    split's largest batch is not searched for (``even`` is ``None``: a length bucket, or a
    search whose even baseline is taken from another); ``first_split``: the first split
    probed (``max_batch``; default the even split of ``batch_size``). With
    ``known.look_past`` (``max_batch``), a certified answer's over points are looked past on
    a model of the figure (:data:`LookPast`), and an answer whose probes met a fall is looked
    past from its own chunks; where a card fits again, the search goes past the fall
    (:mod:`dptune.search.past_falls`) and certifies only what the look then proves
    (``not_monotone`` says where the figure falls).
    Raises :class:`dptune.errors.NoFeasibleSplitError` when nothing fits.
    """
    # the throughput objective maps memory with the balance search, never stopping at the even
    # split (its planner needs each card's slope, not only a split that balances)
    goal = Objective.parse(objective)
    balance = goal in (Objective.BALANCE, Objective.THROUGHPUT)
    groups = groups_of(known.alike, budgets)
    # alike cards pool their points (a one-more test on one of them closes all their
    # brackets); the largest-batch search also evens them out in its answer (:class:`_Settle`)
    obs = Observations(budgets, exact_on_oom=exact_on_oom, min_chunk=min_chunk, alike=groups)
    for r in known.over:
        obs.add_bound(r)
    for r in known.prior:
        obs.add_prior(r, known.prior_cards)
    notes: list[str] = []
    keep: Optional[KeepForFalls] = None
    try:
        if balance:
            bal = Balance(obs, batch_size, max_probes, tolerance, notes,
                          keep_even=goal is not Objective.THROUGHPUT)
            refine(probe, bal, obs, max_probes, on_probe)
            found = _balance_found(obs, bal, batch_size, notes)
        else:
            mb = MaxBatch(obs, batch_size, max_probes, compare_even, first_split)
            # with a look past the over points, probes are kept for going past a fall
            keep = None if known.look_past is None else KeepForFalls(mb, obs, max_probes)
            refine(probe, keep or mb, obs, max_probes, on_probe)
            refine(probe, _Settle(obs, groups), obs, max_probes, on_probe)
            found = _max_batch_found(obs, mb, batch_size, min_chunk, compare_even, notes)
    except NoFeasibleSplitError as e:
        fixed = fixed_costs_fill(obs.probes, obs.budgets)
        if fixed is None or fixed in str(e):
            raise
        # the fixed costs, not the model, fill a card: the error says so and names the flags
        raise NoFeasibleSplitError(f"no split fits: {fixed}.",
                                   shortfall_bytes=e.shortfall_bytes) from None
    contradiction = obs.not_monotone(groups)
    # the search stopped with probes kept for the look, its brackets open and no fall met
    open_ = keep is not None and keep.kept and not found.certified and contradiction is None
    window: Optional[WindowCheck] = None
    past: Optional[Past] = None
    mapped: Optional[MapCheck] = None
    if not balance:
        found, window, past, contradiction = _look(probe, obs, found, known.look_past, open_,
                                                   contradiction, max_probes, on_probe)
    elif known.balance_map is not None and goal is Objective.BALANCE:
        found, mapped = _on_the_map(probe, obs, bal, found, known, groups, contradiction,
                                    max_probes, on_probe, notes)
    if keep is not None and open_ and not (past is not None and past.certified) \
            and len(obs.probes) < max_probes:
        # the look could not decide (a window too long to look at whole, or too few probes
        # to go past a fall): the search's own brackets go on with the probes left, and its
        # certificate is looked past as any other
        keep.kept = open_ = False
        refine(probe, keep.inner, obs, max_probes, on_probe)
        refine(probe, _Settle(obs, groups), obs, max_probes, on_probe)
        found = _found_again(obs, keep.inner, batch_size, min_chunk, compare_even, notes)
        contradiction = obs.not_monotone(groups)
        found, window, past, contradiction = _look(probe, obs, found, known.look_past, False,
                                                   contradiction, max_probes, on_probe)
    if keep is not None and keep.kept and compare_even:
        found = _even_after(probe, obs, keep.inner, found, batch_size, min_chunk, max_probes,
                            on_probe, notes)
    line: Optional[EvenLine] = None
    even_on_model = False
    if not balance and compare_even and known.even_line is not None:
        found, line, even_on_model = _even_closed(probe, mb, found, known.even_line, notes)
    found = _said(found, obs, past, window, mapped, contradiction, open_,
                  keep.left if keep is not None else RESERVE, max_probes, notes)
    return SearchOutcome(best=found.best, even=found.even, even_split=found.even_split,
                         even_implied_by=found.even_implied_by, probes=tuple(obs.probes),
                         fits=_fits(obs, found.best.chunk_sizes), brackets=tuple(found.brackets),
                         certified=found.certified, card0_floor=found.floor, notes=tuple(notes),
                         even_open=found.even_open, even_at_most=found.even_at_most,
                         even_kept=found.even_kept, not_monotone=contradiction, window=window,
                         mapped=mapped, even_line=line, even_on_model=even_on_model)


def _said(found: "_Found", obs: Observations, past: Optional[Past], window: Optional[WindowCheck],
          mapped: Optional[MapCheck], contradiction: Optional[str], open_: bool, left: int,
          max_probes: int, notes: list[str]) -> "_Found":
    """The answer's certificate as the looks and the map left it, said in ``notes``: what
    the look past a fall, the look past an answer left open (``left`` probes kept for it) or
    a balance's map proved, or why the answer is not certified."""
    moved = ("" if past is None or not past.raised else
             f"past the fall the split {list(past.best.chunk_sizes)} was measured within "
             "every budget, and ")
    if past is not None and past.certified and open_:
        found = found._replace(certified=True)
        notes.append(f"the probes left brackets open with {left} of {max_probes} probes kept "
                     f"for the look past the answer on the allocator model: "
                     f"{moved.replace('past the fall ', '') or 'yet '}"
                     "every card stays over past the answer there: " + past.window.describe()
                     + f" ({past.window.replays} replays). The answer is certified on the "
                     "allocator model")
    elif past is not None and past.certified:
        found = found._replace(certified=True)
        notes.append(f"the figures fall as the work grows ({contradiction}; the caching "
                     "allocator's fragmentation), so the probes' over points proved nothing; "
                     f"{moved or 'yet '}on the allocator model every card stays over past the "
                     "answer: " + past.window.describe() + f" ({past.window.replays} replays). "
                     "The answer is certified on the allocator model; PYTORCH_CUDA_ALLOC_CONF="
                     "expandable_segments:True makes the reserved figure follow the allocated "
                     "one")
    elif mapped is not None:
        pass                            # solved on the model's map: said there
    elif contradiction is not None:
        raised = ("" if past is None or not past.raised else
                  f"; past the fall, {past.raised} larger split(s) measured within every "
                  f"budget, the answer now {list(found.best.chunk_sizes)}, and the look past it "
                  "found " + ("; ".join(w.describe() for w in past.window.falls) or "no proof"))
        notes.append(f"the figures are not monotone ({contradiction}{raised}; the caching "
                     "allocator's reserved peak depends on fragmentation): one more sample "
                     "measured over does not prove that no larger batch fits, so the answer is "
                     "not certified; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (on "
                     "simulated cards --allocator expandable_segments:True) makes the reserved "
                     "figure follow the allocated one")
        found = found._replace(certified=False)
    elif not found.certified:
        gaps = [b.describe() for b in found.brackets if not b.closed]
        looked = ("" if window is None else
                  "; the look past the answer on the allocator model found "
                  + "; ".join(w.describe() for w in window.cards if not w.closed))
        notes.append(f"not certified: {len(obs.probes)} of {max_probes} probes run and "
                     f"{len(gaps)} bracket(s) still open ({'; '.join(gaps)}){looked}; the best "
                     "split measured within every budget is returned")
    elif window is not None:
        notes.append("looked past the over points on the allocator model: " +
                     "; ".join(w.describe() for w in window.cards) +
                     f" ({window.replays} replays)")
    return found


def _look(probe: Callable[[Sequence[int]], ProbeResult], obs: Observations, found: "_Found",
          look_past: Optional[LookPast], open_: bool, contradiction: Optional[str],
          max_probes: int, on_probe: Callable[[], None]
          ) -> tuple["_Found", Optional[WindowCheck], Optional[Past], Optional[str]]:
    """The largest batch's answer looked past on the model (``look_past``; see :func:`run`),
    taken past a fall where a card fits again: the answer, the last look, the rounds past
    the fall, and what contradicts the monotone surface (the probes, or the look)."""
    window, past = None, None
    if look_past is not None and (found.certified or contradiction is not None or open_):
        best = found.best.chunk_sizes
        # past the probes' over points; where they contradict each other (a fall the probes
        # met) or are missing (brackets left open), past the answer itself, every card from
        # one sample above its chunk
        over = ([best[0] + 1] + [obs.bracket(i).hi for i in range(1, obs.n)]
                if found.certified and contradiction is None else [c + 1 for c in best])
        window = look_past(best, over, min_chunk=obs.min_chunk)
        if window.falls:
            if not open_:
                contradiction = contradiction or ("on the allocator model, past the over points: "
                                                  + "; ".join(w.describe() for w in window.falls))
            past = past_the_falls(probe, obs, found.best, window, over, look_past, max_probes,
                                  on_probe, "past the answer" if open_ else "past a fall")
            window = past.window
            if past.raised:
                found = found._replace(best=past.best, brackets=brackets_of(past, obs.min_chunk))
        elif (contradiction is not None or open_) and window.closed:
            past = Past(found.best, window, tuple(over), True)  # proven as it is, on the model
            found = found._replace(brackets=brackets_of(past, obs.min_chunk))
    return found, window, past, contradiction


def _on_the_map(probe: Callable[[Sequence[int]], ProbeResult], obs: Observations, bal: Balance,
                found: "_Found", known: Known, groups: Groups, contradiction: Optional[str],
                max_probes: int, on_probe: Callable[[], None], notes: list[str]
                ) -> tuple["_Found", Optional[MapCheck]]:
    """The balance solved on the model's map (``known.balance_map``; see :func:`run`) where
    the probes' certificate may fail: every card's figure at every chunk it can take in a split
    at most as high as the answer's, the least largest share found exactly
    (:func:`dptune.solve.discrete.least_largest_share`), its split probed once; certified
    where the probe measures what the map says, or where the even split kept is within the
    tolerance of that least share; what the map found (``None``: no map)."""
    assert known.balance_map is not None
    best = found.best
    level = max(obs.shares(best))
    mp = known.balance_map(best.chunk_sizes, level, min_chunk=obs.min_chunk, alike=known.alike)
    if mp is None:
        return found, None
    m = obs.min_chunk
    # shares as the probes read them (a card i >= 1 with no samples holds none of the batch)
    shares = [{c: (f / obs.budgets[cv.card] if card_in_use(cv.card, c) else 0.0)
               for c, f in cv.chunks().items() if c == 0 or c >= m} for cv in mp.curves]
    together = [g for g in groups if obs.agree(g)]
    sol = least_largest_share(shares, mp.batch, together, prefer=best.chunk_sizes)
    if sol is None:
        return found, None
    apart = ""
    if sol.alike and sol.level > (1 + bal.tol) * sol.least:
        # keeping alike cards together costs more than the tolerance: the least split wins
        sol = least_largest_share(shares, mp.batch, (), prefer=best.chunk_sizes)
        assert sol is not None
        sol = sol._replace(alike=False)
        apart = ("; alike cards are more than one sample apart there: no split that keeps "
                 f"them within one comes within {bal.tol:.0%} of that share")
    why = (f"the figures fall as the work grows ({contradiction}; the caching allocator's "
           "fragmentation), so the probes' chunks at the largest share proved nothing"
           if contradiction is not None else "the probes' certificate holds where the figures "
           "grow with the work" if found.certified else "the probes left brackets open")
    check = MapCheck(level, sol.least, sol.level,
                     tuple((0 if cv.zero is not None else cv.lo, cv.lo + len(cv.figures))
                           for cv in mp.curves), mp.replays)
    proof = f"{why}; on the allocator model {check.describe()}"
    if sol.least > level + _SAME:
        # the probes measured a split below the least the map allows: the map is wrong
        notes.append(f"{proof}; yet the probes measured {list(best.chunk_sizes)} at "
                     f"{level:.2%}, below it: the map missed a step, so the answer is not "
                     "certified")
        return found._replace(certified=False), check
    # the even split's note from the probes is replaced by the map's
    notes[:] = [n for n in notes if not n.startswith(EVEN_KEPT)]
    floor_notes = [n for n in notes if n.startswith(CARD0_FLOOR)]
    even_s = tuple(even_split(best.batch_size, obs.n))
    even = obs.by_split.get(even_s)
    if bal.keep_even and even is not None and obs.within_budget(even) \
            and max(obs.shares(even)) <= (1 + bal.tol) * sol.least:
        if even is not best:
            notes[:] = [n for n in notes if n not in floor_notes]
        notes.append(f"{EVEN_KEPT}: its largest share ({max(obs.shares(even)):.2%} of a budget) "
                     f"is within {bal.tol:.0%} of the least any split of the batch reaches on "
                     f"the allocator model, so a changed split would gain nothing worth a "
                     f"change; certified on the allocator model ({proof})")
        return found._replace(best=even, even=even, certified=True, even_kept=True,
                              floor=found.floor and even is best,
                              brackets=bal.brackets(even, sol.least)), check
    r = obs.by_split.get(sol.split)
    if level <= sol.level + _SAME and (not sol.alike or all(
            max(best.chunk_sizes[i] for i in g) - min(best.chunk_sizes[i] for i in g) <= 1
            for g in together)):
        r = best                        # the answer already reaches the least share
    if r is None:
        if len(obs.probes) >= max_probes:
            notes.append(f"{proof}; its split {list(sol.split)} was not probed ({max_probes} "
                         "probes run), so the answer is not certified")
            return found._replace(certified=False), check
        r = measure(probe, obs, Proposal(sol.split, "map"), on_probe)
    top = max(obs.shares(r))
    if not obs.within_budget(r) or top > max(level, sol.level) + _SAME:
        notes.append(f"{proof}; yet its split {list(sol.split)} measured {top:.2%}: the map "
                     "missed the step, so the answer is not certified")
        return found._replace(certified=False), check
    exact = abs(top - sol.level) <= _SAME
    if r is not best:                   # the probes' floor, if they read one, was not one
        notes[:] = [n for n in notes if n not in floor_notes]
    if sol.level > sol.least and not apart:
        proof += (f"; with alike cards within one sample of each other, at {sol.level:.2%}, "
                  f"within {bal.tol:.0%}")
    notes.append(f"{proof}, and {list(r.chunk_sizes)} reaches it{apart}: "
                 + ("certified on the allocator model" if exact else
                    f"measured at {top:.2%}, not what the map says, so not certified"))
    return found._replace(best=r, certified=exact, even_kept=False,
                          floor=found.floor and r is best,
                          brackets=bal.brackets(r, sol.level)), check


#: how :func:`_max_batch_found`'s note on an open even bracket begins
_EVEN_OPEN = "the even split's largest batch was not bracketed"


def _found_again(obs: Observations, mb: MaxBatch, batch_size: int, min_chunk: int,
                 compare_even: bool, notes: list[str]) -> "_Found":
    """:func:`_max_batch_found` read again after more probes, its note on the even bracket
    in ``notes`` replaced where it was."""
    fresh: list[str] = []
    again = _max_batch_found(obs, mb, batch_size, min_chunk, compare_even, fresh)
    at = next((k for k, n in enumerate(notes) if n.startswith(_EVEN_OPEN)), len(notes))
    notes[:] = notes[:at] + fresh + [n for n in notes[at:] if not n.startswith(_EVEN_OPEN)]
    return again


def _even_after(probe: Callable[[Sequence[int]], ProbeResult], obs: Observations, mb: MaxBatch,
                found: "_Found", batch_size: int, min_chunk: int, max_probes: int,
                on_probe: Callable[[], None], notes: list[str]) -> "_Found":
    """The probes the look left (the search stopped early for it, :class:`KeepForFalls`) go
    to the even split's baseline, its bracket asked as the search asks it; the answer and its
    certificate stay as the look left them, the even fields and their note are read again."""
    even = mb.even
    if len(obs.probes) >= max_probes or even.certified():
        return found

    class _Even:
        def propose(self) -> Optional[Proposal]:
            return even.step()
    refine(probe, _Even(), obs, max_probes, on_probe)
    again = _found_again(obs, mb, batch_size, min_chunk, True, notes)
    return found._replace(even=again.even, even_split=again.even_split,
                          even_implied_by=again.even_implied_by, even_open=again.even_open,
                          even_at_most=again.even_at_most)


def _even_closed(probe: Callable[[Sequence[int]], ProbeResult], mb: MaxBatch, found: "_Found",
                 line_of: EvenLineOf, notes: list[str]
                 ) -> tuple["_Found", Optional[EvenLine], bool]:
    """The even split's largest batch on the model
    (:func:`dptune.search.even_baseline.on_the_model`): the probes' reading checked, or
    replaced (closed where they left it open, moved where the model and the real steps
    disprove it); the even fields and their note replaced where the model moves them, or a
    note on why it was not taken. Returns the found, the line, and whether ``E`` is now the
    model's."""
    even = found.even
    hi = (None if found.even_at_most is None else found.even_at_most + 1) if found.even_open \
        else None if even is None else mb.even.next_batch(even.batch_size)
    got = on_the_model(probe, mb.even, line_of, even, hi)
    if isinstance(got, ModelDisagrees):
        notes.append(f"the even split's largest batch rests on the probes: {got.reason}")
    if not isinstance(got, OnModel) or even is None:
        return found, None, False
    line, lo = got.line, even.batch_size
    stepped = ("simulated beside the probes (not counted among them)"
               if got.even.purpose == ON_MODEL else "measured by a probe")
    below = ("" if line.start < lo else
             f"; up to {lo}, the probes' reading (the model replays no further down)")
    if line.largest == lo and not found.even_open:
        notes.append(f"the even split's largest batch, {lo}, checked on the allocator model: "
                     f"{line.describe()}{below}; even({lo}) {stepped}, within every budget, "
                     "and the next over")
        return found, line, False
    notes[:] = [n for n in notes if not n.startswith(_EVEN_OPEN)]
    wrong = ("" if found.even_open else
             f"the probes' reading, {lo} (every even batch up to it known to fit from probes "
             "that loaded every card at least as much), does not hold there: the figures fall "
             "as the work grows; " if line.largest < lo else
             f"the probes' reading, {lo} (the next even batch known over from a probe that "
             "loaded every card at most as much), does not hold there: the figures fall as the "
             "work grows; ")
    notes.append(f"the even split's largest batch, {line.largest}, found on the allocator "
                 f"model: {wrong}{line.describe()}{below}; even({line.largest}) {stepped}, "
                 "within every budget, and the next over")
    found = found._replace(even=got.even, even_split=tuple(got.even.chunk_sizes),
                           even_implied_by=(), even_open=False, even_at_most=None)
    if got.even.batch_size > found.best.batch_size:
        # the even split fits a larger batch than the search's answer: that is the answer
        notes.append(f"the even split of {got.even.batch_size} fits a larger batch than the "
                     f"search's answer ({found.best.batch_size}): it is returned, uncertified")
        found = found._replace(best=got.even, certified=False)
    return found, line, True


class _Settle:
    """The largest batch's answer with alike cards more than one sample apart (the others
    sharing what card 0's whole-batch term leaves): the same batch with each group's samples
    spread evenly over it, probed once so that the answer is measured. It fits (each alike
    card at most at the group's largest chunk, every other card as it was) and no card's
    peak is higher, so it becomes the answer."""

    def __init__(self, obs: Observations, groups: Groups):
        self.obs, self.groups, self.done = obs, groups, False

    def propose(self) -> Optional[Proposal]:
        best = self.obs.best_within()
        groups = tuple(g for g in self.groups if self.obs.agree(g))
        if self.done or best is None or not groups:
            return None
        self.done = True
        s = spread(best.chunk_sizes, groups, self.obs.min_chunk)
        apart = any(max(best.chunk_sizes[i] for i in g) - min(best.chunk_sizes[i] for i in g) > 1
                    for g in groups)
        return Proposal(s, "alike") if apart and s not in self.obs.by_split else None


class _Found(NamedTuple):
    """What one objective's strategy left: the answer, the even baseline, the certificate."""

    best: ProbeResult
    even: Optional[ProbeResult]
    even_split: tuple[int, ...]
    certified: bool
    brackets: list[Bracket]
    floor: bool = False
    even_implied_by: tuple[int, ...] = ()
    even_open: bool = False
    even_at_most: Optional[int] = None
    even_kept: bool = False


#: two shares this close are one (a share read from bytes over a budget, twice)
_SAME = 1e-12

#: how :func:`_balance_found`'s note on card 0's floor begins
CARD0_FLOOR = "card 0 with no samples already holds the largest share"
#: how :func:`_balance_found`'s note on an even split kept begins
EVEN_KEPT = "the even split is kept"


def _balance_found(obs: Observations, bal: Balance, batch_size: int, notes: list[str]) -> _Found:
    best = obs.best_within(batch_size)
    if best is None:
        raise bal.no_split()
    even_s = tuple(even_split(batch_size, obs.n))
    kept = bal.even_kept()
    if kept is not None:
        even, level = kept
        top = max(obs.shares(even))
        notes.append(f"{EVEN_KEPT}: its largest share ({top:.2%} of a budget) is "
                     f"within {bal.tol:.0%} of the lowest any split of the batch can reach "
                     f"(at least {level:.2%}, proven by the probes), so a changed split would "
                     "gain nothing worth a change")
        return _Found(even, even, even_s, True, bal.brackets(even, level), False,
                      even_kept=True)
    floor = bal.floor(best)
    if floor:
        notes.append(f"{CARD0_FLOOR} (its "
                     f"{card0_holdings(obs.probes)}): no "
                     "split can do better; the imbalance is given among the cards that "
                     "hold samples")
    return _Found(best, obs.by_split.get(even_s), even_s, bal.certified(best),
                  bal.brackets(best), floor)


def _max_batch_found(obs: Observations, mb: MaxBatch, batch_size: int, min_chunk: int,
                     compare_even: bool, notes: list[str]) -> _Found:
    best = obs.best_within()
    if best is None:
        card = next((r.oom_device for r in reversed(obs.probes) if not r.feasible), None)
        smallest = min((r.batch_size for r in obs.probes), default=min_chunk)
        detail = f"not even the smallest batch was measured within budget in {len(obs.probes)} probes"
        ran_out = smallest > min_chunk  # the probes ran out before a batch that small was asked
        if ran_out:
            detail = (f"the smallest batch probed was {smallest}: a smaller one was not tried "
                      "(more probes would)")
        # proven only where the probes show every split of it over (card 0 with no samples
        # included: a card 0 that sheds its replica may fit with none)
        raise infeasible_error(card, None, smallest, detail, probes=obs.probes,
                               budgets=obs.budgets, proven=not ran_out and mb.infeasible(smallest))
    lo, hi = mb.even_bracket() if compare_even else (0, None)
    even_s = tuple(even_split(lo, obs.n)) if lo > 0 else tuple(even_split(batch_size, obs.n))
    even = obs.by_split.get(even_s) if lo > 0 else None
    if even is not None and not obs.within_budget(even):
        even = None
    implied_by: tuple[int, ...] = ()
    if even is None and lo > 0:
        imp = _implied(obs, even_s)
        if imp is not None:
            even, implied_by = imp
    even_open = compare_even and not mb.even_certified()
    at_most = None
    if even_open:
        at_most = None if hi is None else hi - 1
        known = ", ".join([f"at least {lo}"] * (lo > 0) + [f"at most {at_most}"] *
                          (at_most is not None)) or "not known"
        notes.append(f"{_EVEN_OPEN} to one sample within the probes: {known}")
    if even is not None and even.batch_size > best.batch_size:  # pragma: no cover - guard
        best = even
    return _Found(best, even, even_s, mb.max_certified(), mb.brackets(), False, implied_by,
                  even_open, at_most)
