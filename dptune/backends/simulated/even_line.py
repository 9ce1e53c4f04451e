"""The even split's largest batch on the allocator model, past the probes' last known fit.

The largest-batch search compares its answer with ``E``, the batch a user reaches by raising
DataParallel's batch until it fails: every even split (``torch.chunk``'s) up to ``E`` within
budget, the next one over. Its probes go to the answer first; where they leave ``E``'s
bracket open, simulated cards at the reserved level can close it without probes: every even
batch above the last one known to fit is replayed on the allocator model, one after the
other (no monotone figure assumed), until one is over.

``torch.chunk`` gives batch ``n*c - r`` (``0 <= r < n``, ``c > r``) the split ``(c, ..., c,
c - r)``: along each residue ``r`` every card's chunk grows by one sample a step, so each
card's step is drawn on the line through two simulated steps of the even split itself
(:class:`~dptune.backends.simulated.look.ScaledTraces`, checked against a third, as the look
past a largest batch's over points draws them; nothing is assumed of how a card's figure
depends on the others' chunks). Three simulated steps a residue, a replay per card and batch.
The search (``search.Known.even_line``) then simulates ``even(E)`` and the next even batch
for real before it takes the answer.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from dptune.backends.simulated.allocator import AllocatorConfig
from dptune.backends.simulated.look import ScaledTraces, Traces, agrees, window_end
from dptune.split import even_split, valid_split
from dptune.types import EvenLine

__all__ = ["even_line", "EVEN_MAX_CARDS", "EVEN_EVENTS", "EVEN_MAX_BATCHES"]

#: the most cards whose even line is drawn (three simulated steps a card)
EVEN_MAX_CARDS = 8
#: the most allocator events the replays may take in all (about 2 µs each on this project's
#: CI machine: about a minute)
EVEN_EVENTS = 32_000_000
#: the most batches replayed past the last known fit, however short the step
EVEN_MAX_BATCHES = 65_536


def even_line(traces_of: Callable[[Sequence[int]], Sequence[Traces]], lo: int,
              budgets: Sequence[int], config: AllocatorConfig, nccl: int, min_chunk: int = 1,
              max_events: int = EVEN_EVENTS, upto: Optional[int] = None) -> Optional[EvenLine]:
    """The largest ``E >= lo`` with every valid even batch from ``lo + 1`` to ``E`` within
    budget on the model (the reserved peak + ``nccl`` against ``budgets``), the next valid
    one over (see the module): ``lo`` an even batch known to fit (the probes' lower end);
    ``traces_of(split)`` every card's replay traces of one simulated step; ``min_chunk=2``
    under BatchNorm (even batches with a chunk of 1 skipped, as DataParallel cannot run them).
    ``None`` where the line cannot be drawn: too many cards, ``lo`` below ``n * (n - 1)``
    (the chunks do not yet follow the residue lines), a step whose mallocs do not scale
    with the samples, or more than ``max_events`` replayed events before a batch is over
    (known after one simulated step where ``upto``, a batch the answer is expected at or
    below, lies further than that)."""
    n, m = len(budgets), max(1, min_chunk)
    if n < 2 or n > EVEN_MAX_CARDS or lo < n * (n - 1) or any(b <= 0 for b in budgets):
        return None
    simulated: dict[int, Sequence[Traces]] = {}

    def sim(b: int) -> Sequence[Traces]:
        if b not in simulated:
            simulated[b] = traces_of(tuple(even_split(b, n)))
        return simulated[b]

    # each residue's line from the first c with n*c - r > lo whose last chunk, c - r, a card
    # can run (under BatchNorm a chunk of 1 is no step: those batches are skipped below)
    first = {r: max((lo + r) // n + 1, r + m) for r in range(n)}
    events = max(1, max(sum(len(t) for t in card) for card in sim(n * first[0])))
    most = min(EVEN_MAX_BATCHES, max_events // (events * n))
    if upto is not None and upto - lo >= most:
        return None
    lines: dict[int, list[ScaledTraces]] = {}
    for r, a in first.items():
        base, near = sim(n * a - r), sim(n * (a + 1) - r)
        close = [ScaledTraces.of(base[k], near[k], 1) for k in range(n)]
        if any(sc is None for sc in close):
            return None
        # the far end: where some card's allocated peak alone passes its budget
        ends = [window_end(sc, budgets[k] + sc.margin, nccl, config, most // n + 2)
                for k, sc in enumerate(close) if sc is not None]
        far = a + max(1, min(ends))
        drawn = [ScaledTraces.of(base[k], sim(n * far - r)[k], far - a) for k in range(n)]
        if any(sc is None or not agrees(sc, near[k], config) for k, sc in enumerate(drawn)):
            return None
        lines[r] = [sc for sc in drawn if sc is not None]
    replays, last, b = 0, lo, lo
    while b - lo < most:
        b += 1
        if not valid_split(even_split(b, n), m):
            continue
        r = -b % n
        k = (b + r) // n - first[r]
        for card, sc in enumerate(lines[r]):
            replays += 1
            if sc.stats(k, config).reserved_peak + nccl > budgets[card]:
                return EvenLine(start=lo, largest=last, over=b, card=card, replays=replays,
                                steps=len(simulated))
        last = b
    return None
