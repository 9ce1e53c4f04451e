"""Past a fall: a larger answer where the look past the over points finds cards fitting again.

At the reserved level a card can be over at a chunk and within budget again further on (the
caching allocator's fragmentation). Where the look past a certificate's over points
(``search.Known.look_past``, on the simulator's allocator model) finds that, the answer is
not proven, and may not be the largest: :func:`past_the_falls` probes the answer with each
card that fits again raised to the last chunk of its window within budget (its cap on the
model: every chunk above it is over), or, where only card 0 fits again, the split of the
larger batch its window found within budget (the others at their caps). A split measured
within every budget becomes the answer and is looked past in turn, its raised cards from one
sample above their caps; where every window is looked at whole and none fits again, the
answer is certified on the model (a proof of the same form as the probes', its over points
from the look instead of probes).
Only splits measured within every budget are returned; the probes are the search's own,
within its cap.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.search.loop import Proposal, measure
from dptune.search.observations import Bracket, Observations
from dptune.split import fill_within, spread_within, valid_split
from dptune.types import CardWindow, WindowCheck

__all__ = ["Past", "past_the_falls", "ROUNDS", "RESERVE", "KeepForFalls"]

#: the most raised splits probed after a look finds a fall
ROUNDS = 3
#: probes the largest-batch search leaves for the look past its answer and the rounds past a
#: fall (a round probes a raised split, and card 0's share of it where card 0 alone is over)
RESERVE = 2 * ROUNDS


class KeepForFalls:
    """A largest-batch strategy that stops with :data:`RESERVE` probes left once it has a
    split measured within every budget, for the look past the answer on the model: where
    its probes met a fall their brackets prove nothing, and where they are still open the
    look finds each card's last chunk within budget past the answer (the whole window, not a
    bisection of it); :func:`past_the_falls` probes the answer raised there and the look
    certifies it, or not. Only where the search has a look (simulated cards at the reserved
    level)."""

    def __init__(self, inner: Any, obs: Observations, max_probes: int):
        self.inner, self.obs, self.max_probes = inner, obs, max_probes
        self.kept, self.left = False, 0      # stopped, with ``left`` probes kept

    def propose(self) -> Any:
        obs = self.obs
        if len(obs.probes) >= self.max_probes - RESERVE and obs.best_within() is not None:
            self.kept, self.left = True, self.max_probes - len(obs.probes)
            return None
        return self.inner.propose()


class Past(NamedTuple):
    """What the rounds left: the answer (``best``, measured within every budget), the last
    look, the over points it was taken from, and whether it proves the answer."""

    best: ProbeResult
    window: WindowCheck
    over: tuple[Optional[int], ...]
    certified: bool
    raised: int = 0            # splits probed past a fall


def _frontier(w: CardWindow, over: Sequence[Optional[int]]) -> Optional[tuple[int, ...]]:
    """The split of card 0's window where it fits last: the others at their caps (card 0 at
    its chunk), or with no samples on card 0, the batch spread below the caps."""
    caps = [None if o is None else o - 1 for o in over[1:]]
    x = w.last_fits
    if x is None or any(c is None for c in caps):
        return None
    capped = [int(c) for c in caps if c is not None]
    if not w.no_samples:
        return (x, *capped)
    rest, left = fill_within([0] * len(capped), x, capped, range(len(capped)))
    return None if left else (0, *rest)


def raised_split(best: Sequence[int], window: WindowCheck,
                 over: Sequence[Optional[int]]) -> Optional[tuple[tuple[int, ...], list[Optional[int]]]]:
    """The next split to probe and the over points to look past it from: every card ``i >=
    1`` that fits again at its cap on the model (``last_fits``), the others as in ``best``;
    else card 0's last fitting split along its window. ``None``: nothing to raise."""
    cards = [w for w in window.falls if w.card and w.last_fits is not None]
    if cards:
        split, new_over = list(best), list(over)
        for w in cards:
            split[w.card] = int(w.last_fits or 0)
            new_over[w.card] = split[w.card] + 1
        return tuple(split), new_over
    for w in window.falls:
        if w.card == 0:
            s = _frontier(w, over)
            if s is not None:
                return s, list(over)
    return None


def past_the_falls(probe: Callable[[Sequence[int]], ProbeResult], obs: Observations,
                   best: ProbeResult, window: WindowCheck, over: Sequence[Optional[int]],
                   look: Callable[..., WindowCheck], max_probes: int,
                   on_probe: Callable[[], None] = lambda: None,
                   purpose: str = "past a fall") -> Past:
    """Up to :data:`ROUNDS` raised splits, each probed (within ``max_probes`` in all) and,
    measured within every budget, looked past in turn (see the module); ``purpose``: the
    probes' (``"past the answer"`` where the search left its brackets open for the look
    rather than met a fall)."""
    past = Past(best, window, tuple(over), False)

    def measured(split: tuple[int, ...]) -> Optional[ProbeResult]:
        r = obs.by_split.get(split)
        if r is None:
            if len(obs.probes) >= max_probes:
                return None
            r = measure(probe, obs, Proposal(split, purpose), on_probe)
        return r
    # once a raised split is over on card 0 alone with no samples on it, the whole batch (the
    # outputs gathered onto card 0) is the limit: card 0's window alone decides from there
    alone: list[Optional[int]] = [None] * (obs.n - 1)
    for _ in range(ROUNDS):
        bound = past.over[0] is not None and list(past.over[1:]) == alone
        nxt: Optional[tuple[tuple[int, ...], list[Optional[int]]]]
        if bound:
            front = _card0_frontier(past.window, obs, past.best, None)
            nxt = None if front is None else (front, [None, *alone])
        else:
            nxt = raised_split(past.best.chunk_sizes, past.window, past.over)
        if nxt is None:
            return past
        split, new_over = nxt
        r = measured(split)
        if r is not None and not bound and not obs.within_budget(r) and _card0_only(r, obs):
            # card 0 cannot take the larger batch at its chunk: it gives the raised cards
            # its samples, down to the batch one larger than the answer
            # (none where the raised cards alone hold more than that)
            c0 = max(0, past.best.batch_size + 1 - sum(split[1:]))
            c0 = obs.min_chunk if 0 < c0 < obs.min_chunk else c0
            if c0 < split[0]:
                split = (c0, *split[1:])
                r = measured(split)
            if r is not None and split[0] == 0 and not obs.within_budget(r) and _card0_only(r, obs):
                # with no samples on it card 0 is still over: the whole batch is its limit,
                # which the raised cards passed; the last batch it fits on the model
                w0 = look(past.best.chunk_sizes, [past.best.chunk_sizes[0] + 1, *alone],
                          min_chunk=obs.min_chunk)
                front = _card0_frontier(w0, obs, past.best, split[1:])
                if front is None:
                    return past
                split, new_over = front, [None, *alone]
                r = measured(split)
        if r is None or not obs.within_budget(r) or r.batch_size <= past.best.batch_size:
            return past
        new_over[0] = split[0] + 1
        w = look(split, new_over, min_chunk=obs.min_chunk)
        # a proof only where every window was looked at whole (card 0's over point past a
        # raised split was never measured: the look is all it rests on)
        past = Past(r, w, tuple(new_over), w.closed, past.raised + 1)
        if past.certified or not w.falls:
            return past
    return past


def _card0_frontier(window: WindowCheck, obs: Observations, best: ProbeResult,
                    caps: Optional[Sequence[int]]) -> Optional[tuple[int, ...]]:
    """Card 0 is the limit with no samples on it (the outputs of the whole batch gathered
    onto it): its window on the model past the answer ``best`` with no samples (``window``,
    looked at with no other card capped) gives the last batch it fits before its allocated
    peak alone is over; that batch split with card 0 at none and the other cards from their
    chunks in ``best`` up, the samples spread evenly, each at most at its ``caps`` entry
    (``None``: at most its chunk in ``best`` plus every sample added, which binds only on a
    very uneven ``best``). ``None``: the model finds no larger batch, or the caps cannot hold
    it."""
    card0 = next((c for c in window.cards if c.card == 0 and c.no_samples), None)
    if card0 is None or card0.last_fits is None or card0.last_fits <= best.batch_size:
        return None
    base = [int(c) for c in best.chunk_sizes[1:]]
    more = card0.last_fits - sum(base)
    top = [b + more for b in base] if caps is None else [max(int(c), b) for c, b in zip(caps, base)]
    spread = spread_within(card0.last_fits, top)
    if spread is None or not valid_split((0, *spread), obs.min_chunk):
        return None
    return (0, *spread)


def _card0_only(r: ProbeResult, obs: Observations) -> bool:
    """Only card 0 is over budget in ``r`` (every other card measured within its own)."""
    return r.peak_bytes[0] > obs.budgets[0] and all(
        p <= b for p, b in zip(r.peak_bytes[1:], obs.budgets[1:])) and r.oom_device in (None, 0)


def brackets_of(past: Past, min_chunk: int) -> list[Bracket]:
    """The brackets a certificate on the model rests on: each card ``i >= 1`` from its chunk
    in the answer to its over point (measured, or found by the look), card 0 on the batch."""
    best = past.best
    out = [Bracket(card=0, lo=best.batch_size, hi=best.batch_size + 1 if past.certified else None,
                   what="batch")]
    out += [Bracket(card=i, lo=c, hi=past.over[i], min_chunk=min_chunk)
            for i, c in enumerate(best.chunk_sizes) if i]
    return out
