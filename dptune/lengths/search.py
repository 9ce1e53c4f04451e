"""The per-bucket search: the largest batch at every bucket's longest length, certified.

Each bucket runs dptune's own certified search (:func:`dptune.search.run`, objective
``max_batch``) on a backend whose batches are built at that bucket's length. Memory only
grows with the length, so the buckets are searched shortest first and each one starts from
its neighbour's answer:

- every card its neighbour's search measured over budget is over at the longer length too,
  so those probes close the brackets from above before any probe is run here
  (``search.Known.over``, lower bounds never taken as answers);
- the first batch probed is the neighbour's fits carried to the new length (per-sample
  cost in proportion to the length): a guess that only chooses where to probe.

The answer of every bucket is a split measured within every budget at that length; it is
certified when one more sample was measured not to fit (here, or at a shorter length).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

from dptune import search
from dptune.backends.base import Backend, ProbeResult
from dptune.backends.simulated.look import look_past_of
from dptune.budget import RESERVED_CERTIFICATE, RESERVED_MODEL, BudgetLevel, at_level
from dptune.errors import NoFeasibleSplitError, UsageError
from dptune.lengths.buckets import Buckets, assign, bucket_edges
from dptune.lengths.plan import BucketPlan, LengthPlan
from dptune.search.alike import device_keys, groups_of, spread
from dptune.split import scale_split
from dptune.settings import SearchSettings, sort_keywords
from dptune.types import Objective, WindowCheck, card_in_use

__all__ = ["LengthSample", "BucketSearch", "search_buckets", "plan_lengths", "next_split"]


class LengthSample:
    """``sample(n)`` for the backends: the user's ``sample(n, length)`` at :attr:`length`.

    Every batch is checked along ``axis``: some tensor in it must have exactly ``length``
    there, else the sample function ignores the length (a :class:`UsageError`).
    """

    def __init__(self, fn: Callable[[int, int], Any], axis: int = 1, length: int = 1):
        if not callable(fn):
            raise UsageError("sample must be a function sample(batch_size, length) -> batch")
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 1:
            raise UsageError(f"length_axis must be an int >= 1 (dim 0 is the batch), got {axis!r}")
        self.fn, self.axis, self.length = fn, axis, length
        self.__name__ = getattr(fn, "__name__", "sample")

    def __call__(self, batch_size: int) -> Any:
        from dptune.step import tree as _tree

        batch = self.fn(batch_size, self.length)
        sizes = {tuple(t.shape)[self.axis] for t in _tree.leaves(batch) if t.dim() > self.axis}
        if self.length not in sizes:
            raise UsageError(
                f"sample({batch_size}, {self.length}) returned no tensor of length {self.length} "
                f"along axis {self.axis} (found {sorted(sizes) or 'none'}): the sample function "
                "must build its batch at the length it is given (or set length_axis / "
                "--length-axis to the batch's length dimension)")
        return batch


@dataclass(frozen=True)
class BucketSearch:
    """One bucket's search: its length and the outcome of :func:`dptune.search.run`."""

    length: int
    outcome: search.SearchOutcome

    @property
    def best(self) -> ProbeResult:
        return self.outcome.best


def growth(done: Sequence[BucketSearch]) -> float:
    """How a sample's cost grows with the length, ``cost ~ length ** a``: from the cards'
    fitted slopes at the last two lengths searched (1 with fewer; kept within [1, 2]:
    linear layers to attention's square)."""
    if len(done) < 2:
        return 1.0
    a, b = done[-2], done[-1]
    ratios = [fb.slope_bytes / fa.slope_bytes for fa, fb in zip(a.outcome.fits[1:], b.outcome.fits[1:])
              if fa.slope_bytes > 0 and fb.slope_bytes > 0]
    if not ratios or b.length <= a.length:
        return 1.0
    r = sorted(ratios)[len(ratios) // 2]
    return min(2.0, max(1.0, math.log(r) / math.log(b.length / a.length)))


def next_split(done: Sequence[BucketSearch], length: int, budgets: Sequence[int]) -> list[int]:
    """Where to start at ``length`` from the neighbour's answer at a shorter length (a guess:
    it only picks the first probe). Each card keeps the part of its peak that does not grow
    with the samples; its fitted cost per sample grows with the length as between the last
    two lengths (:func:`growth`), card 0's cost per sample of the whole batch (the gathered
    outputs, from the last bucket that measured it) in proportion to the length. Never above
    the neighbour's chunks."""
    prev = done[-1]
    scale = (length / prev.length) ** growth(done)
    fits, best = prev.outcome.fits, prev.best
    sizes, peaks, b = best.chunk_sizes, best.peak_bytes, best.batch_size
    ref = next((d for d in reversed(done) if d.outcome.fits[0].batch_slope_bytes > 0), None)
    g_prev = 0.0 if ref is None else ref.outcome.fits[0].batch_slope_bytes * prev.length / ref.length
    g = g_prev * length / prev.length
    rest = []
    for i in range(1, len(sizes)):
        s = max(fits[i].slope_bytes, 0.0)
        cap = (budgets[i] - peaks[i]) / (s * scale) + sizes[i] / scale if s > 0 else sizes[i] / scale
        rest.append(max(0, min(int(cap), sizes[i])) if sizes[i] > 0 else 0)
    s0 = max(fits[0].slope_bytes, 0.0)
    fixed0 = peaks[0] - s0 * sizes[0] - g_prev * b
    room0 = budgets[0] - fixed0
    if g * sum(rest) > room0:   # card 0 binds through the whole batch: fewer samples in all
        whole = int(room0 / g) if g > 0 else int(b / scale)
        rest = scale_split(rest, max(1, min(sum(rest), whole))) if sum(rest) else rest
        c0 = 0
    else:
        per = s0 * scale + g
        c0 = int((room0 - g * sum(rest)) / per) if per > 0 else int(sizes[0] / scale)
    split = [max(0, min(c0, sizes[0])), *rest]
    return split if sum(split) > 0 else [1] + [0] * (len(sizes) - 1)


def search_buckets(probe_at: Callable[[int, Sequence[int]], ProbeResult], budgets: Sequence[int],
                   edges: Sequence[int], *, start: int = 256, min_chunk: int = 1,
                   max_probes: int = 16, tolerance: float = 0.02, exact_on_oom: bool = True,
                   from_neighbour: bool = True,
                   on_bucket: Callable[[BucketSearch], None] = lambda s: None,
                   alike: Optional[Sequence[Hashable]] = None,
                   look_past_at: Optional[Callable[[int, Sequence[int], Sequence[Optional[int]], int],
                                                   WindowCheck]] = None) -> list[BucketSearch]:
    """The largest batch at every edge, shortest first (``probe_at(length, split)`` runs one
    step). ``from_neighbour=False`` searches every bucket on its own from ``start`` (what a
    per-bucket search such as NeMo's OOMptimizer does; the benchmark compares the two).
    ``alike``: one key per card, equal for identical cards (:func:`dptune.search.run`): their
    chunks in each bucket's answer are within one sample of each other.
    ``look_past_at(length, split, over, min_chunk)``: a certified bucket's over points looked
    past on a model of the figure (``search.Known.look_past``).
    Raises :class:`NoFeasibleSplitError` naming the length at which nothing fits."""
    out: list[BucketSearch] = []
    known: list[ProbeResult] = []
    groups = groups_of(alike, budgets)
    for length in sorted(edges):
        first = None
        if from_neighbour and out:
            # alike cards' fits differ only by where they were measured: one guess for all
            first = list(spread(next_split(out, length, budgets), groups, min_chunk))

        def probe(split: Sequence[int], length: int = length) -> ProbeResult:
            return probe_at(length, split)

        def look(split: Sequence[int], over: Sequence[Optional[int]], min_chunk: int = 1,
                 length: int = length) -> WindowCheck:
            assert look_past_at is not None
            return look_past_at(length, split, over, min_chunk)
        try:
            outcome = search.run(probe, budgets, Objective.MAX_BATCH, sum(first) if first else start,
                                 min_chunk=min_chunk, first_split=first,
                                 max_probes=max_probes, tolerance=tolerance,
                                 exact_on_oom=exact_on_oom, compare_even=False,
                                 known=search.Known(over=known if from_neighbour else (), alike=alike,
                                                    look_past=look if look_past_at else None))
        except NoFeasibleSplitError as e:
            prev = f"; the lengths up to {out[-1].length} fit" if out else ""
            raise NoFeasibleSplitError(
                f"at length {length}, not even the smallest batch fits every card ({e}){prev}. "
                "Truncate the longest samples, or plan with more memory per card (a smaller "
                "headroom, larger cards, gradient checkpointing)", e.shortfall_bytes) from None
        done = BucketSearch(length, outcome)
        out.append(done)
        on_bucket(done)
        known = [r for r in outcome.probes if not r.within_budget(budgets)] + known
    return out


def binding_card(r: ProbeResult, budgets: Sequence[int]) -> int:
    """The card with the largest share of its budget (card 0, or one holding samples)."""
    cards = [i for i, c in enumerate(r.chunk_sizes) if card_in_use(i, c)]
    return max(cards, key=lambda i: (r.peak_bytes[i] / max(budgets[i], 1), -i))


def _bucket_plans(found: Sequence[BucketSearch], counts: Sequence[int], budgets: Sequence[int],
                  ddp: bool) -> list[BucketPlan]:
    plans = []
    lo = 0
    for s, n in zip(found, counts):
        r = s.best
        if ddp and 0 in r.chunk_sizes:
            raise NoFeasibleSplitError(
                f"at length {s.length}, rank {r.chunk_sizes.index(0)} cannot fit one sequence "
                "and DDP needs every rank in every step: truncate the longest samples or plan "
                "without that card")
        plans.append(BucketPlan(lo=lo, length=s.length, samples=n, chunk_sizes=tuple(r.chunk_sizes),
                                peak_bytes=tuple(int(p) for p in r.peak_bytes),
                                binding_card=binding_card(r, budgets),
                                certified=s.outcome.certified, probes=len(s.outcome.probes)))
        lo = s.length
    return plans


def _min_chunk(workload: Any) -> int:
    from dptune.step.workload import smallest_chunk

    try:
        return smallest_chunk(workload.model)
    except Exception:   # the backend runs the factory and reports its errors
        return 1


_LENGTH_KEYWORDS = ("pad_to_multiple_of", "length_axis", "max_length", "from_neighbour", "choice",
                    "compute_loss")
_QUIET_SEARCH = SearchSettings(max_probes=16, verbose=False)     # per bucket


def _level_notes(level: BudgetLevel, simulated: bool, given: Sequence[str]) -> list[str]:
    """The note saying which level the budgets were checked against (and the refusal of
    allocator-model options, named in ``given``, where real cards are measured)."""
    from dptune.budget import real_cards_measured

    if given and not simulated:
        raise UsageError(real_cards_measured(given))
    if level is BudgetLevel.ALLOCATED:
        return []
    return ["budgets checked against the reserved level: each bucket's peaks are the caching "
            "allocator's reserved peak plus NCCL's buffers" + (
                f", predicted by {RESERVED_MODEL}"
                if simulated else " (max_memory_reserved)"),
            f"a bucket certified (one more sample measured over): {RESERVED_CERTIFICATE}"]


def plan_lengths(model: Any, sample: Callable[[int, int], Any], lengths: Iterable[int],
                 buckets: Buckets = 8, *, loss_fn: Optional[Callable[[Any, Any], Any]] = None,
                 optimizer: Optional[Callable[..., Any]] = None, simulate: Any = None,
                 device_ids: Optional[Sequence[int]] = None, batch_size: int = 256,
                 objective: str = "max_batch", ddp: bool = False, **keywords: Any) -> LengthPlan:
    """For every bucket of ``lengths``, the largest DataParallel batch that fits each card at
    the bucket's longest (padded) length, and its per-card split (a :class:`LengthPlan`).

    ``sample(batch_size, length)`` builds a batch padded to ``length`` along
    ``length_axis``; ``lengths`` are the training samples' lengths (any iterable of ints, a
    ``datasets`` column); ``buckets``: a count (quantile edges) or the edges (see
    :func:`dptune.lengths.bucket_edges`). The training step (``loss_fn``, ``optimizer``,
    ``amp``, ...), the cards (``simulate``, ``device_ids``), ``headroom``, ``max_probes`` (per
    bucket) and ``tolerance`` are as for :class:`dptune.Tuner`; ``batch_size`` is where the
    shortest bucket's search starts. ``ddp=True`` (simulated cards only): each card is a
    DDP rank with its own batch (nothing gathered); every rank must fit at least one sequence.
    Where the backend times its steps (the DDP ranks' too, estimated), the plan's notes give
    each bucket's tokens per second and the epoch's (:mod:`dptune.lengths.speed`);
    ``objective="throughput"`` splits each bucket's batch for the most tokens per second that
    fits (with ``ddp=True``, each rank's batch at most its own largest and at least one
    sequence: :func:`dptune.lengths.ddp_speed.fastest_ranks`).
    ``budget_level``, ``allocator``, ``nccl_bytes`` and the default ``headroom`` are as for
    :class:`dptune.Tuner`: at ``"reserved"`` (the default) each bucket's probe is replayed
    through the allocator model (simulated cards) or measured (``max_memory_reserved``).
    ``choice``: the cards, already chosen (a :class:`dptune.backends.choice.BackendChoice`).
    ``budget=`` (a :class:`dptune.Budget`) and ``search=`` (a :class:`dptune.SearchSettings`,
    default 16 probes per bucket, quiet) may stand for their keywords; the length options are
    ``pad_to_multiple_of``, ``length_axis`` (default 1), ``max_length`` and ``from_neighbour``
    (default True: a bucket's search starts from its neighbour's answer).
    ``compute_loss(model, batch)``: the forward and the loss in one call, in place of
    ``model(**batch)`` and ``loss_fn`` (a Trainer's ``compute_loss``, as
    :class:`dptune.step.workload.Workload` takes it).
    """
    from dptune.step.workload import Workload, model_name

    t0 = time.perf_counter()
    budget_given, search_given = keywords.pop("budget", None), keywords.pop("search", None)
    kw = sort_keywords("plan_lengths()", keywords, budget=budget_given, search=search_given,
                       search_default=_QUIET_SEARCH, own=_LENGTH_KEYWORDS)
    pad_to_multiple_of: Optional[int] = kw.rest.get("pad_to_multiple_of")
    length_axis: int = kw.rest.get("length_axis", 1)
    data = list(lengths)
    edges = bucket_edges(data, buckets, pad_to_multiple_of=pad_to_multiple_of,
                         max_length=kw.rest.get("max_length"))
    bucket_of = assign(data, edges, pad_to_multiple_of)
    counts, tokens = [0] * len(edges), [0] * len(edges)
    for k, x in zip(bucket_of, data):
        counts[k] += 1
        tokens[k] += x
    goal = Objective.parse(objective)
    if goal is Objective.BALANCE:
        raise UsageError(f"objective={objective!r}: a length plan takes 'max_batch' (the largest "
                         "batch per bucket) or 'throughput' (its fastest split, or with ddp=True "
                         "the DDP ranks' fastest batches)")
    budget, look = kw.budget, kw.search
    level, headroom_bytes, reserved = budget.level, budget.headroom_bytes, budget.reserved
    ls = LengthSample(sample, length_axis, edges[0])
    wl = Workload(model=model, sample=ls, loss_fn=loss_fn, optimizer=optimizer, **kw.step,
                  compute_loss=kw.rest.get("compute_loss"))
    choice = kw.rest.get("choice") or _choose(device_ids, simulate)
    notes = ([choice.notice] if choice.notice else []) + _level_notes(   # checks them first
        level, choice.simulated, budget.model_options)
    backend = _backend(wl, choice, ddp, reserved)
    budgets = [d.budget_bytes(headroom_bytes) for d in backend.devices]

    def probe_at(length: int, split: Sequence[int]) -> ProbeResult:
        ls.length = length
        r = backend.probe(split)
        return r if ddp else at_level(r, backend.devices, level)
    past = None if ddp else look_past_of(backend, budgets, level)

    def look_at(length: int, split: Sequence[int], over: Sequence[Optional[int]],
                min_chunk: int = 1) -> WindowCheck:
        assert past is not None
        ls.length = length
        return past(split, over, min_chunk)
    try:
        found = search_buckets(probe_at, budgets, edges, start=batch_size,
                               min_chunk=_min_chunk(wl), max_probes=look.max_probes,
                               tolerance=look.tolerance,
                               exact_on_oom=getattr(backend, "kind", "") == "simulated",
                               from_neighbour=kw.rest.get("from_neighbour", True),
                               on_bucket=_say if look.verbose else lambda s: None,
                               alike=device_keys(backend.devices),
                               look_past_at=look_at if past is not None else None)
        found, speed_notes = _speed(found, probe_at, budgets, counts, tokens, objective, wl,
                                    backend if ddp else None)
    finally:
        backend.close()
    plans = _bucket_plans(found, counts, budgets, ddp)
    notes.extend(f"length <= {s.length}: {n}" for s in found for n in s.outcome.notes)
    return LengthPlan(buckets=tuple(plans), devices=tuple(d.name for d in backend.devices),
                      budget_bytes=tuple(budgets), length_axis=length_axis,
                      pad_to_multiple_of=pad_to_multiple_of, cluster=backend.describe(),
                      model_name=model_name(wl.model), headroom_bytes=headroom_bytes,
                      seconds=time.perf_counter() - t0, notes=tuple(notes + speed_notes), ddp=ddp)


def _speed(found: list, probe_at: Callable[[int, Sequence[int]], ProbeResult], budgets: list[int],
           counts: list[int], tokens: list[int], objective: str, wl: Any,
           ranks: Any) -> tuple[list, list[str]]:
    """Each bucket's tokens per second and the epoch's (the fastest split with
    ``objective="throughput"``; ``ranks``: the DDP ranks, else ``None``):
    :func:`dptune.lengths.speed.plan_speed`."""
    from dptune.lengths.speed import plan_speed

    found, speed, notes = plan_speed(found, probe_at, budgets, counts, tokens,
                                     fastest=objective == Objective.THROUGHPUT,
                                     min_chunk=_min_chunk(wl), ranks=ranks)
    return found, list(notes) + speed.lines()


def _choose(device_ids: Optional[Sequence[int]], simulate: Any) -> Any:
    from dptune.backends.choice import choose_backend

    return choose_backend(device_ids, simulate)


def _backend(wl: Any, choice: Any, ddp: bool, reserved: Any) -> Backend:
    """The cards to plan on: DDP ranks on simulated cards with ``ddp``, else the chosen
    cards, timed (for tokens per second); ``reserved``: the allocator model, or ``None``."""
    from dptune.backends.choice import build_backend, timed

    if ddp and not choice.simulated:
        raise UsageError("ddp=True plans on simulated cards (simulate=...); planning inside a "
                         "torchrun job per bucket is not supported yet")
    if ddp:
        from dptune.lengths.ddp_speed import DDPRanks

        return DDPRanks(wl, choice.cluster, reserved)
    return timed(build_backend(wl, choice, reserved=reserved))


def _say(s: BucketSearch) -> None:
    """``verbose``: each bucket's answer on stderr as it is found."""
    import sys

    r = s.best
    print(f"dptune: length <= {s.length}: batch {r.batch_size} = {list(r.chunk_sizes)} "
          f"({len(s.outcome.probes)} probes)", file=sys.stderr)
