"""Tokens per second with the variable-length plan: each bucket's and the epoch's.

Each bucket's step is the time of its answer's probe (``ProbeResult.time``: estimated on the
simulated cluster, measured on real cards). A bucket runs ``ceil(samples / batch)`` steps
per epoch, each timed as a full batch (the last, partial one too: an upper bound on the
epoch), padded to the bucket's length. Two rates are given: **padded** tokens per second
(a bucket's: batch x bucket length per step time, what the cards compute; the epoch's: its
samples, each padded to its bucket's length, per second of the epoch) and, for the epoch,
the data's own tokens (the sum of the samples' lengths) per second.

With ``fastest=True`` (``--objective throughput``), every bucket takes the batch (at most
its largest) and split with the most tokens per second that fits every card
(:func:`dptune.search.throughput.fastest` with ``up_to``: time fits from the bucket's
probes, a few more timed probes; a slow card may get fewer samples, or none).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dptune.backends.base import ProbeResult

__all__ = ["BucketSpeed", "LengthSpeed", "plan_speed"]


@dataclass(frozen=True)
class BucketSpeed:
    """One bucket's step: its time and what it moves."""

    length: int
    batch_size: int
    samples: int                 # the epoch's samples in this bucket
    tokens: int                  # the sum of their own lengths
    step_seconds: Optional[float]
    source: str                  # "measured", "estimated" or "unknown"

    @property
    def steps(self) -> int:
        return math.ceil(self.samples / self.batch_size) if self.batch_size else 0

    @property
    def tokens_per_second(self) -> Optional[float]:
        """Padded tokens (batch x length) per second of a step."""
        if not self.step_seconds:
            return None
        return self.batch_size * self.length / self.step_seconds

    def describe(self) -> str:
        if self.tokens_per_second is None:
            return f"length <= {self.length}: step time unknown"
        return (f"length <= {self.length}: step {self.step_seconds * 1e3:.2f} ms, "  # type: ignore[operator]
                f"{self.tokens_per_second:,.0f} padded tokens/s ({self.source})")

    def to_dict(self) -> dict[str, Any]:
        return dict(length=self.length, batch_size=self.batch_size, samples=self.samples,
                    tokens=self.tokens, steps=self.steps, step_seconds=self.step_seconds,
                    tokens_per_second=self.tokens_per_second, source=self.source)


@dataclass(frozen=True)
class LengthSpeed:
    """Every bucket's speed and the epoch's (``None`` figures where a bucket has no time)."""

    buckets: tuple[BucketSpeed, ...]

    @property
    def epoch_seconds(self) -> Optional[float]:
        if any(b.step_seconds is None for b in self.buckets if b.samples):
            return None
        return sum(b.steps * (b.step_seconds or 0.0) for b in self.buckets)

    @property
    def padded_tokens(self) -> int:
        """The epoch's samples, each padded to its bucket's length."""
        return sum(b.samples * b.length for b in self.buckets)

    @property
    def tokens_per_second(self) -> Optional[float]:
        """The data's own tokens per second of the epoch."""
        t = self.epoch_seconds
        return sum(b.tokens for b in self.buckets) / t if t else None

    @property
    def source(self) -> str:
        kinds = {b.source for b in self.buckets if b.samples}
        return kinds.pop() if len(kinds) == 1 else " and ".join(sorted(kinds))

    def lines(self) -> list[str]:
        out = ["speed: " + "; ".join(b.describe() for b in self.buckets)]
        t = self.epoch_seconds
        if t is None:
            out.append("epoch: time unknown (a bucket's step was not timed)")
        else:
            padded = self.padded_tokens / t if t else 0.0
            took = f"{t:,.2f} s" if t >= 1 else f"{t * 1e3:,.2f} ms"
            out.append(f"epoch: {sum(b.steps for b in self.buckets):,} steps, {took}, "
                       f"{self.tokens_per_second or 0.0:,.0f} tokens/s of the data's own lengths "
                       f"({padded:,.0f} padded tokens/s; {self.source}; each bucket's last, "
                       "partial batch timed as a full one)")
        return out

    def to_dict(self) -> dict[str, Any]:
        return dict(buckets=[b.to_dict() for b in self.buckets], epoch_seconds=self.epoch_seconds,
                    tokens_per_second=self.tokens_per_second, padded_tokens=self.padded_tokens,
                    source=self.source)


def _fastest_outcome(outcome: Any, probe: Callable[[Sequence[int]], ProbeResult],
                     budgets: Sequence[int], min_chunk: int) -> tuple[Any, tuple[str, ...]]:
    """The bucket's search outcome with the fastest split of its batch that fits."""
    from dptune.search import throughput

    best = outcome.best
    fast = throughput.fastest(probe, budgets, best.batch_size, outcome.probes, outcome.fits,
                              best, min_chunk=min_chunk, up_to=True)
    return dataclasses.replace(outcome, best=fast.best, probes=fast.probes), fast.notes


def _at(probe_at: Callable[[int, Sequence[int]], ProbeResult], length: int
        ) -> Callable[[Sequence[int]], ProbeResult]:
    return lambda split: probe_at(length, split)


def _fastest_ranks(outcome: Any, probe: Callable[[Sequence[int]], ProbeResult],
                   budgets: Sequence[int], min_chunk: int, ranks: Any,
                   length: int) -> tuple[Any, tuple[str, ...]]:
    """The bucket's search outcome with the DDP ranks' fastest batches that fit."""
    from dptune.lengths.ddp_speed import fastest_ranks

    return fastest_ranks(outcome, probe, budgets, min_chunk, ranks.grad_bytes(),
                         ranks.speed.link.bandwidth, length=length)


def plan_speed(found: Sequence[Any], probe_at: Callable[[int, Sequence[int]], ProbeResult],
               budgets: Sequence[int], counts: Sequence[int], tokens: Sequence[int], *,
               fastest: bool = False, min_chunk: int = 1,
               ranks: Any = None) -> tuple[list[Any], LengthSpeed, list[str]]:
    """Each bucket's speed (``found``: the buckets' searches, shortest first; ``counts`` and
    ``tokens``: each bucket's samples and the sum of their lengths). With ``fastest``, each
    bucket's answer is first replaced by the fastest split of its batch that fits (``ranks``:
    the DDP ranks, :class:`dptune.lengths.ddp_speed.DDPRanks`: their fastest batches, each at
    most its largest). Returns the searches (updated), the speeds, and notes."""
    out: list[Any] = []
    speeds: list[BucketSpeed] = []
    notes: list[str] = []
    for s, n, tok in zip(found, counts, tokens):
        if fastest:
            if ranks is not None:
                outcome, said = _fastest_ranks(s.outcome, _at(probe_at, s.length), budgets,
                                               min_chunk, ranks, s.length)
            else:
                outcome, said = _fastest_outcome(s.outcome, _at(probe_at, s.length), budgets,
                                                 min_chunk)
            s = dataclasses.replace(s, outcome=outcome)
            notes.extend(f"length <= {s.length}: {line}" for line in said if not line.startswith("speed:"))
        out.append(s)
        t = s.best.time
        speeds.append(BucketSpeed(s.length, s.best.batch_size, n, tok,
                                  None if t is None else t.step_seconds,
                                  "unknown" if t is None else t.source.value))
    return out, LengthSpeed(tuple(speeds)), notes
