"""The refine loop shared by both objectives: propose -> cached probe -> update -> accept.

A strategy (:class:`dptune.search.balance.Balance`, :class:`dptune.search.max_batch.MaxBatch`)
looks at the observations and proposes the next split, or ``None`` when it has its answer
(or can make no more progress). The loop runs the probe, records it, and stops at
``max_probes``. A split is never probed twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from dptune.backends.base import ProbeResult
from dptune.search.observations import Observations
from dptune.split import even_split, valid_split

__all__ = ["Proposal", "Strategy", "refine", "valid_split", "even_at_most", "fill", "raise_cards"]


@dataclass(frozen=True)
class Proposal:
    """The next split to probe, and why (recorded as the probe's ``purpose``)."""

    split: tuple[int, ...]
    purpose: str


class Strategy(Protocol):
    def propose(self) -> Optional[Proposal]:
        ...



def even_at_most(batch: int, n: int, min_chunk: int) -> Optional[tuple[int, ...]]:
    """The even split of the largest batch ``<= batch`` that gives no card ``1..min_chunk - 1``
    samples; ``None`` when none does."""
    s = even_split(batch, n)
    while not valid_split(s, min_chunk) and batch > 1:
        batch -= 1
        s = even_split(batch, n)
    return tuple(s) if valid_split(s, min_chunk) else None


def fill(total: int, caps: Sequence[int], min_chunk: int) -> Optional[list[int]]:
    """Chunks ``0`` or ``min_chunk..caps[i]`` summing to ``total``, in proportion to the caps."""
    cap_sum = sum(caps)
    if total > cap_sum or total < 0:
        return None
    if total == cap_sum:
        return list(caps)
    out = [c * total // cap_sum for c in caps] if cap_sum else [0] * len(caps)
    left = total - sum(out)
    for i in sorted(range(len(caps)), key=lambda i: -(caps[i] * total % max(cap_sum, 1))):
        if left == 0:
            break
        if out[i] < caps[i]:
            out[i] += 1
            left -= 1
    # the BatchNorm rule: a chunk of 1..m-1 goes to 0 or up to m
    for i, c in enumerate(out):
        if 0 < c < min_chunk:
            need = min_chunk - c
            donors = [j for j in range(len(out)) if j != i and out[j] - need >= min_chunk]
            if caps[i] >= min_chunk and donors:
                j = max(donors, key=lambda j: out[j])
                out[j] -= need
                out[i] = min_chunk
            else:
                takers = [j for j in range(len(out)) if j != i and out[j] > 0 and out[j] + c <= caps[j]]
                if not takers:
                    return None
                out[takers[0]] += c
                out[i] = 0
    ok = all((c == 0 or c >= min_chunk) and c <= cap for c, cap in zip(out, caps))
    return out if ok and sum(out) == total else None


def measure(probe: Callable[[Sequence[int]], ProbeResult], obs: Observations, prop: Proposal,
            on_probe: Callable[[], None] = lambda: None) -> ProbeResult:
    """One probe of ``prop``'s split, checked (the split asked, a peak per card) and recorded
    in ``obs`` with its purpose."""
    r = probe(list(prop.split))
    if tuple(r.chunk_sizes) != prop.split or len(r.peak_bytes) != obs.n:
        raise RuntimeError(f"the backend returned a probe for {list(r.chunk_sizes)} with "
                           f"{len(r.peak_bytes)} peaks; asked for {list(prop.split)}")
    r = dataclasses.replace(r, purpose=prop.purpose)
    obs.add(r)
    on_probe()
    return r


def refine(probe: Callable[[Sequence[int]], ProbeResult], strategy: Strategy,
           obs: Observations, max_probes: int, on_probe: Callable[[], None] = lambda: None) -> None:
    """Run ``strategy`` until it is done or ``max_probes`` probes have been run in all."""
    while len(obs.probes) < max_probes:
        prop = strategy.propose()
        if prop is None or prop.split in obs.by_split:
            return
        measure(probe, obs, prop, on_probe)


def raise_cards(base: Sequence[int], tests: dict[int, int], n: int,
                m: int) -> Optional[tuple[int, ...]]:
    """``base`` with the tested cards raised to their test chunks, the samples taken from the
    other cards ``i >= 1`` (untested ones first) down to ``m`` (``min_chunk``); ``None`` when
    no card could be raised (the largest-batch search's packed probes)."""
    s = list(base)
    raised: list[int] = []
    for i in sorted(tests):
        need = tests[i] - s[i]
        if need <= 0:
            continue
        donors = sorted((j for j in range(1, n) if j != i and j not in raised and s[j] > m),
                        key=lambda j: (j in tests, -s[j]))
        if sum(s[j] - m for j in donors) < need:
            continue
        for j in donors:
            take = min(need, s[j] - m)
            s[j] -= take
            need -= take
            if need == 0:
                break
        s[i] = tests[i]
        raised.append(i)
    return tuple(s) if raised else None
