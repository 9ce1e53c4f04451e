"""dptune.search against analytic per-card memory curves (no torch work in the probes).

Every answer is checked against a brute-force optimum over the same curves: the largest
batch (each card >= 1 at its cap, card 0 the rest, as ``benchmarks/search.py`` computes it)
and the balanced split (the lowest largest share over all splits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import pytest

from dptune import search
from dptune.backends.base import Device, ProbeResult
from dptune.errors import NoFeasibleSplitError
from dptune.report import render_table
from dptune.search.loop import fill
from dptune.split import even_split

GiB = 2**30
MiB = 2**20
HEAD = 1 * GiB


@dataclass
class Shape:
    """Card ``i >= 1``: ``f(i, c)`` bytes (0 with no samples); card 0: ``g(c0, B)``."""

    name: str
    totals: list[int]
    f: Callable[[int, int], int]
    g: Callable[[int, int], int]
    used: Optional[list[int]] = None
    bn: bool = False


class CurveBackend:
    """Probes read off the curves; out of memory above a card's available bytes.

    ``real=True`` gives real-GPU semantics: an out-of-memory probe names the failing card,
    whose figure is what the card holds (no more than its memory: the step stopped at the
    allocation that failed), and the others' peaks are only lower bounds (half of what they
    would have reached)."""

    def __init__(self, shape: Shape, real: bool = False):
        used = shape.used or [0] * len(shape.totals)
        self.kind = "cuda" if real else "simulated"
        self.devices = [Device(i, f"card{i}", t, used_bytes=u)
                        for i, (t, u) in enumerate(zip(shape.totals, used))]
        self.shape = shape
        self.real = real
        self.calls: list[list[int]] = []

    def describe(self) -> str:
        return self.shape.name

    def peaks(self, split: Sequence[int]) -> list[int]:
        b = sum(split)
        return [self.shape.g(split[0], b)] + [self.shape.f(i, c) if c else 0
                                              for i, c in enumerate(split) if i > 0]

    def probe(self, chunk_sizes: Sequence[int]) -> ProbeResult:
        split = tuple(int(c) for c in chunk_sizes)
        assert sum(split) > 0 and min(split) >= 0
        if self.shape.bn:
            assert 1 not in split, "a chunk of 1 sample under BatchNorm"
        self.calls.append(list(split))
        peaks = self.peaks(split)
        over = [i for i in list(range(1, len(split))) + [0]
                if (i == 0 or split[i] > 0) and peaks[i] > self.devices[i].available_bytes]
        if not over:
            return ProbeResult(split, tuple(peaks))
        d = over[0]
        if self.real:
            peaks = [min(p, self.devices[i].available_bytes) if i == d else p // 2
                     for i, p in enumerate(peaks)]
        return ProbeResult(split, tuple(peaks), oom_device=d)

    def close(self) -> None:
        pass


# ---- brute force ----------------------------------------------------------------------------

def budgets(shape: Shape) -> list[int]:
    used = shape.used or [0] * len(shape.totals)
    return [t - u - HEAD for t, u in zip(shape.totals, used)]


def fits(shape: Shape, split: Sequence[int]) -> bool:
    be = CurveBackend(shape)
    m = 2 if shape.bn else 1
    return all(c == 0 or c >= m for c in split) and all(
        p <= b for i, (p, b) in enumerate(zip(be.peaks(split), budgets(shape)))
        if i == 0 or split[i] > 0)


def cap(shape: Shape, i: int) -> int:
    b, m = budgets(shape)[i], (2 if shape.bn else 1)
    c = 0
    while shape.f(i, c + 1) <= b:
        c += 1
    return c if c >= m else 0


def best_batch(shape: Shape) -> int:
    """The largest batch any split fits (card 0 takes what the capped others leave)."""
    n, m = len(shape.totals), (2 if shape.bn else 1)
    caps = [cap(shape, i) for i in range(1, n)]
    best, b = 0, m
    while True:
        ok = False
        for c0 in range(max(0, b - sum(caps)), b + 1):
            if c0 and c0 < m:
                continue
            rest = fill(b - c0, caps, m)
            if rest is not None:
                ok = fits(shape, [c0] + rest)
                break
        if not ok:
            return best
        best, b = b, b + 1


def best_even(shape: Shape) -> int:
    """The even split's largest batch as a user finds it: it fits at E, not at E + 1."""
    n, m = len(shape.totals), (2 if shape.bn else 1)
    last, b = 0, 1
    while True:
        s = even_split(b, n)
        if all(c == 0 or c >= m for c in s):   # BatchNorm: batches with a chunk of 1 are skipped
            if not fits(shape, s):
                return last
            last = b
        b += 1


def best_share(shape: Shape, batch: int) -> float:
    """The lowest largest share of budget over every split of ``batch`` (exact)."""
    be, bud, n = CurveBackend(shape), budgets(shape), len(shape.totals)
    m = 2 if shape.bn else 1
    share0 = [shape.g(c, batch) / bud[0] for c in range(batch + 1)]
    shares = [[shape.f(i, c) / bud[i] if c else 0.0 for c in range(batch + 1)] for i in range(1, n)]
    levels = sorted(set(share0) | {s for row in shares for s in row})

    def ok(level: float) -> bool:
        u0 = [c for c in range(batch + 1) if share0[c] <= level and (c == 0 or c >= m)]
        if not u0:
            return False
        total = max(u0) + sum(max([c for c in range(batch + 1) if row[c] <= level
                                   and (c == 0 or c >= m)], default=0) for row in shares)
        return total >= batch

    lo, hi = 0, len(levels) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(levels[mid]):
            hi = mid
        else:
            lo = mid + 1
    del be
    return levels[lo]


def run(shape: Shape, objective: str, batch: int, *, real: bool = False, max_probes: int = 16):
    be = CurveBackend(shape, real=real)
    out = search.run(be.probe, budgets(shape), objective, batch, min_chunk=2 if shape.bn else 1,
                     max_probes=max_probes, exact_on_oom=not real)
    return out, be


def measured_within(shape: Shape, out: search.SearchOutcome) -> None:
    """The split returned was probed and measured within every budget."""
    r = out.best
    assert any(p.chunk_sizes == r.chunk_sizes for p in out.probes)
    assert fits(shape, r.chunk_sizes)


# ---- shapes ---------------------------------------------------------------------------------

def mlp(n: int = 4, totals: Optional[list[int]] = None, used: Optional[list[int]] = None,
        opt: int = 4 * GiB) -> Shape:
    """A wide MLP with a tiny output: replicas of 2 GiB, 30 MiB per sample, card 0 pays the
    optimizer state and a few KiB per sample of the whole batch."""
    w, a = 2 * GiB, 30 * MiB
    return Shape(f"mlp{n}", totals or [24 * GiB] * n,
                 f=lambda i, c: w + a * c,
                 g=lambda c0, b: w + opt + a * c0 + 4096 * b, used=used)


def slope_drop(n: int = 4) -> Shape:
    """Per-card slope 15% lower at small chunks: a maximum of two affine pieces."""
    w, a = 2 * GiB, 30 * MiB

    def f(i: int, c: int) -> int:
        return w + max(int(0.85 * a * c), a * c - 40 * a)

    return Shape("slope-drop", [24 * GiB] * n, f=f, g=lambda c0, b: f(1, c0) + 4 * GiB + 8192 * b)


def big_output(n: int = 4) -> Shape:
    """A gathered output of 1.5 MiB per sample on card 0 (a segmentation-like model)."""
    w, a = 1 * GiB, 40 * MiB
    return Shape("big-output", [24 * GiB] * n, f=lambda i, c: w + a * c,
                 g=lambda c0, b: w + 2 * GiB + a * c0 + 3 * MiB * b // 2)


def sheds_replica(n: int = 4) -> Shape:
    """Tiny output, heavy card 0: card 0 drops a 3 GiB replica when it gets no samples, so
    the optimum gives card 0 nothing (a step at chunk 0, not a slope)."""
    w, a = 3 * GiB, 50 * MiB

    def g(c0: int, b: int) -> int:
        return 20 * GiB + 2048 * b + (w + a * c0 if c0 else 0)

    return Shape("sheds", [24 * GiB] * n, f=lambda i, c: w + a * c, g=g)


def plateau(n: int = 4) -> Shape:
    """Card 0's peak is set by the optimizer step over a range of chunks (zero slope), then
    by the forward pass."""
    w, a = 2 * GiB, 30 * MiB

    def g(c0: int, b: int) -> int:
        return max(10 * GiB, w + 2 * GiB + a * c0) + 6000 * b

    return Shape("plateau", [24 * GiB] * n, f=lambda i, c: w + a * c, g=g)


def batchnorm(n: int = 4) -> Shape:
    w, a = 1 * GiB, 200 * MiB
    return Shape("bn", [24 * GiB] * n, f=lambda i, c: w + a * c,
                 g=lambda c0, b: w + 2 * GiB + a * c0 + 100_000 * b, bn=True)


TYPICAL = [
    mlp(2), mlp(4), mlp(8),
    mlp(4, totals=[80 * GiB, 80 * GiB, 40 * GiB, 40 * GiB]),
    mlp(4, used=[6 * GiB, 0, 0, 0]),
    big_output(), batchnorm(),
]
HARD = [slope_drop(), sheds_replica(), plateau(), slope_drop(8), sheds_replica(2)]


# ---- the largest batch ------------------------------------------------------------------------

@pytest.mark.parametrize("shape", TYPICAL + HARD, ids=lambda s: s.name)
def test_max_batch_is_the_exhaustive_optimum_and_certified(shape):
    out, be = run(shape, "max_batch", 64 * len(shape.totals))
    assert out.best.batch_size == best_batch(shape)
    assert out.certified and all(b.closed for b in out.brackets)
    measured_within(shape, out)
    e = best_even(shape)
    assert (out.even.batch_size if out.even is not None else 0) == e
    assert out.best.batch_size >= e
    limit = 8 if shape in HARD else 6     # the targets, the even baseline counted
    assert len(be.calls) <= limit, be.calls


@pytest.mark.parametrize("shape", TYPICAL + HARD, ids=lambda s: s.name)
def test_max_batch_with_real_gpu_oom_semantics(shape):
    out, be = run(shape, "max_batch", 64 * len(shape.totals), real=True, max_probes=12)
    assert out.best.batch_size == best_batch(shape)
    assert out.certified
    measured_within(shape, out)
    assert len(be.calls) <= 12


def test_max_batch_exact_probe_sequence_mlp4():
    # the one exact sequence test of the max_batch objective; the others assert invariants
    out, be = run(mlp(4), "max_batch", 256)
    assert be.calls == [
        [64, 64, 64, 80],        # the hint's even split, the last card a quarter more: a slope
                                 # across the cards >= 1
        [64, 717, 717, 717],     # card 0 as before (its batch term); each card >= 1 one sample
                                 # above the cap that slope gives: over, so hi = 717
        [579, 716, 716, 716],    # every card >= 1 at its cap, card 0 the largest batch left
        [580, 580, 580, 577],    # the even split at E + 1 = 2317: card 0 over at chunk 580, so
                                 # also over at 580 in the larger batch B + 1 = 2728 (certified)
    ]
    assert [p.purpose for p in out.probes] == ["spread", "fit", "max", "even-max"]
    assert out.best.chunk_sizes == (579, 716, 716, 716) and out.certified
    # even(2316) = [579] * 4 was never probed: it fits because probe 3 measured card 0 within
    # budget at 579 samples in a batch of 2727 and card 3 at 716, probe 4 cards 1 and 2 at 580
    # (card 3 had 577 < 579 there); the peaks are upper bounds, the lowest that dominate
    assert out.even is not None and out.even.batch_size == 2316
    assert out.even.chunk_sizes == (579, 579, 579, 579) and out.even_implied_by == (3, 4)
    p3, p4 = out.probes[2].peak_bytes, out.probes[3].peak_bytes
    assert list(out.even.peak_bytes) == [p3[0], p4[1], p4[2], p3[3]]
    true = CurveBackend(mlp(4)).peaks(out.even.chunk_sizes)
    assert all(b >= t for b, t in zip(out.even.peak_bytes, true))
    assert fits(mlp(4), out.even.chunk_sizes) and not fits(mlp(4), even_split(2317, 4))


def test_max_batch_big_output_card0_left_with_three_questions():
    """A large gathered output: card 0 takes fewer samples at the largest batch (432) than in
    the even split's (445), so card 0 has three questions left (one more sample at the best
    batch, the even split at E and at E + 1), each probed; the cards' over-budget tests were
    asked by the second probe, one sample above the cap the first probe's slope gave."""
    shape = big_output()
    out, be = run(shape, "max_batch", 256)
    assert out.certified and out.best.batch_size == best_batch(shape) == 2121
    measured_within(shape, out)
    assert out.even is not None and out.even.batch_size == best_even(shape) == 1780
    assert out.even.chunk_sizes == (445, 445, 445, 445) and out.even_implied_by == ()
    assert out.best.chunk_sizes[0] < out.even.chunk_sizes[0]
    assert len(be.calls) <= 6, be.calls
    # card 0's three questions, each a probe of its own: B + 1 (over), even(E), even(E + 1)
    c0 = out.best.chunk_sizes[0]
    assert any(c[0] == c0 + 1 and sum(c) == 2122 for c in be.calls)
    assert list(out.even.chunk_sizes) in be.calls
    assert any(c[0] == 446 and sum(c) == 1781 for c in be.calls)
    assert not fits(shape, even_split(1781, 4))


def test_max_batch_packs_the_cards_tests_on_card0_questions():
    """From the caller's even split (no slope across the cards after one probe), the cards'
    over-budget tests are left for the end and ride along on card 0's questions."""
    shape = big_output()
    be = CurveBackend(shape)
    out = search.run(be.probe, budgets(shape), "max_batch", 256, first_split=[64] * 4)
    assert len(be.calls) <= 6, be.calls
    # the cards' one-more tests rode along on probes asked for card 0 (no probe of their own)
    assert any(p.purpose.endswith("+cards") for p in out.probes), [p.purpose for p in out.probes]
    assert out.certified and out.best.batch_size == best_batch(shape) == 2121
    assert out.even is not None and out.even.batch_size == best_even(shape) == 1780
    # not probed itself: implied by the probes that measured each card within budget at a
    # chunk >= 445 (card 0 in a batch >= 1780)
    assert list(out.even.chunk_sizes) not in be.calls and out.even_implied_by
    for k in out.even_implied_by:
        assert 1 <= k <= len(out.probes)
    assert fits(shape, out.even.chunk_sizes) and not fits(shape, even_split(1781, 4))


def test_max_batch_card0_sheds_its_replica():
    """Card 0 fits at no chunk (20 GiB + a replica): the largest batch leaves it empty, and one
    probe of the even split of 1 (card 0 over at one sample, so at any batch) certifies it and
    shows that no even split fits."""
    shape = sheds_replica(2)
    out, be = run(shape, "max_batch", 128)
    assert out.best.chunk_sizes == (0, 409) and out.certified and out.even is None
    assert out.best.batch_size == best_batch(shape)
    measured_within(shape, out)
    assert [1, 0] in be.calls and not fits(shape, [1, 0])
    assert len(be.calls) <= 5, be.calls


def test_hint_far_too_large_still_certified():
    shape = mlp(4)
    out, be = run(shape, "max_batch", 40000)
    assert out.best.batch_size == best_batch(shape) and out.certified
    assert len(be.calls) <= 8


def test_max_batch_single_card():
    shape = Shape("one", [24 * GiB], f=lambda i, c: 0, g=lambda c0, b: 2 * GiB + 100 * MiB * c0)
    out, be = run(shape, "max_batch", 16)
    assert out.best.batch_size == best_batch(shape) == 215 and out.certified


def test_nothing_fits_raises():
    shape = mlp(2, opt=30 * GiB)
    with pytest.raises(NoFeasibleSplitError):
        run(shape, "max_batch", 64)


def test_smallest_batch_over_is_not_proof_while_card_0_may_shed_its_replica():
    """Card 0 runs out with the one sample of batch 1, but holds less with none: the probes
    ran out before [0, 1, 0, 0] was asked, so "no split of batch size 1 fits" is not proven;
    with more probes the search finds the split that leaves card 0 no samples."""
    w, a = 3 * GiB, 50 * MiB
    shape = Shape("sheds-at-one", [24 * GiB] * 4, f=lambda i, c: w + a * c,
                  g=lambda c0, b: 21 * GiB + 2048 * b + (w + a * c0 if c0 else 0))
    with pytest.raises(NoFeasibleSplitError) as e:
        run(shape, "max_batch", 1, real=True, max_probes=1)
    assert "none is proven not to fit" in str(e.value) and "More probes may find one" in str(e.value)
    out, _ = run(shape, "max_batch", 1, real=True)
    assert out.best.chunk_sizes[0] == 0 and out.best.batch_size == best_batch(shape)


# ---- staircases: any monotone surface ends within max_probes with a verified split ----------

def staircase(seed: int) -> Shape:
    """Monotone staircases (steps of random height every few samples), card 0 with a batch
    term; nothing affine for a fit to find."""
    import random

    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    steps = [[rng.randint(1, 9) * 37 * MiB for _ in range(400)] for _ in range(n)]
    width = [rng.randint(1, 7) for _ in range(n)]
    base = [rng.randint(1, 4) * GiB for _ in range(n)]

    def level(i: int, c: int) -> int:
        return base[i] + sum(steps[i][: c // width[i] + 1])

    return Shape(f"stairs{seed}", [24 * GiB] * n, f=level,
                 g=lambda c0, b: level(0, c0) + 2 * GiB + rng_b[0] * b)


rng_b = [3 * MiB]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("objective", ["max_batch", "balance"])
def test_staircases_end_within_max_probes_with_a_verified_split(seed, objective):
    shape = staircase(seed)
    n = len(shape.totals)
    max_probes = 12
    batch = 20 * n if objective == "balance" else 8 * n
    try:
        out, be = run(shape, objective, batch, max_probes=max_probes)
    except NoFeasibleSplitError:
        assert objective == "balance" and best_share(shape, batch) > 1.0
        return
    assert len(be.calls) <= max_probes
    measured_within(shape, out)
    if out.certified:
        if objective == "max_batch":
            assert out.best.batch_size == best_batch(shape)
        else:
            s = CurveBackend(shape).peaks(out.best.chunk_sizes)
            share = max(p / b for i, (p, b) in enumerate(zip(s, budgets(shape)))
                        if i == 0 or out.best.chunk_sizes[i] > 0)
            assert share == pytest.approx(best_share(shape, batch))
    else:
        assert any(not b.closed for b in out.brackets)
        assert any("not certified" in note for note in out.notes)


#: staircase seeds the real-card search left uncertified at 16 probes before each rule
REAL_CARD_RULES = {
    # a card out of memory a few percent lower probe after probe (seed 0: 395, 376, 358
    # samples): a second bound in a row sends it twice that move down
    "card bound step": [0, 14, 25],
    # a secant from about 20 samples stepped 64-fold (to 1,408, then card 0 to 124,740), each
    # such probe out of memory: at most 8-fold past the largest chunk measured on real cards
    "growth cap": [11, 16, 58],
    # card 0 out of memory at batches a few percent apart (seed 7: 343, 322, 302 samples)
    "card 0 bound step": [7, 17, 19],
}


@pytest.mark.parametrize("seed", [k for seeds in REAL_CARD_RULES.values() for k in seeds])
def test_real_cards_certify_staircases_that_wasted_out_of_memory_probes(seed):
    """Real-card semantics: an out-of-memory probe records only a lower bound of the failing
    card's figure (its total) and nothing of the others'. Each of these staircases ended
    uncertified at 16 probes before its rule (:data:`REAL_CARD_RULES`); now certified at the
    brute-force answer within the same probes."""
    shape = staircase(seed)
    out, be = run(shape, "max_batch", 64, real=True, max_probes=16)
    assert len(be.calls) <= 16
    measured_within(shape, out)
    assert out.certified and out.best.batch_size == best_batch(shape), out.notes


# ---- balance ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", TYPICAL + HARD, ids=lambda s: s.name)
def test_balance_matches_the_exhaustive_optimum(shape):
    n = len(shape.totals)
    batch = max(2 * n, best_even(shape) // 2)
    out, be = run(shape, "balance", batch)
    s = CurveBackend(shape).peaks(out.best.chunk_sizes)
    share = max(p / b for i, (p, b) in enumerate(zip(s, budgets(shape)))
                if i == 0 or out.best.chunk_sizes[i] > 0)
    assert share == pytest.approx(best_share(shape, batch), abs=1e-9)
    measured_within(shape, out)
    assert out.certified
    assert len(be.calls) <= (8 if shape in HARD else 6)


def test_balance_card0_floor_is_said_and_certified():
    shape = sheds_replica(4)
    out, be = run(shape, "balance", 120)
    assert out.best.chunk_sizes[0] == 0 and out.card0_floor and out.certified
    assert any("no split can do better" in n for n in out.notes)


def test_batchnorm_never_gets_one_sample():
    shape = batchnorm(4)
    for objective, batch in (("balance", 10), ("max_batch", 9), ("balance", 7)):
        out, be = run(shape, objective, batch)
        assert all(1 not in c for c in be.calls)
        assert 1 not in out.best.chunk_sizes


def test_fill_respects_caps_and_the_batchnorm_rule():
    assert fill(10, [5, 5, 5], 1) is not None and sum(fill(10, [5, 5, 5], 1)) == 10
    out = fill(7, [2, 10, 10], 2)
    assert out is not None and sum(out) == 7 and 1 not in out
    assert fill(31, [10, 10, 10], 1) is None


# ---- the even baseline: what the probes prove, and its last question asked directly ---------

def workspace_jump(jump: int = 256 * MiB) -> Shape:
    """The issue's case in curves: a BatchNorm CNN with SGD (a tiny output, so card 0 pays
    nothing per sample of the whole batch) on ``4x24GB,used=0:6GB``, whose card 0 steps up
    once above a batch of 1000 (a workspace that comes with a kernel choice). The cost per
    sample of the batch fitted between the first probes is then far too high, the fits put the
    even split's cap too high, and the even split's largest batch is known first by
    dominance (the best split loads card 0 as much, in a larger batch)."""
    w, a = 1 * GiB, 10 * MiB
    return Shape("workspace-jump", [24 * GiB] * 4, f=lambda i, c: w + a * c,
                 g=lambda c0, b: w + 2 * GiB + a * c0 + (jump if b > 1000 else 0),
                 used=[6 * GiB, 0, 0, 0], bn=True)


def proven_even(shape: Shape, calls: list[list[int]]) -> int:
    """The largest even batch the probes prove fits, by brute force: some probe measured
    every card within budget with at least as many samples (card 0: also in at least as
    large a batch). 0 when none."""
    bud, n = budgets(shape), len(shape.totals)
    peaks = [CurveBackend(shape).peaks(c) for c in calls]

    def proven(s: list[int]) -> bool:
        b = sum(s)
        for i, c in enumerate(s):
            if i > 0 and c == 0:
                continue
            if not any(call[i] >= c and p[i] <= bud[i] and (i > 0 or sum(call) >= b)
                       for call, p in zip(calls, peaks)):
                return False
        return True

    top = max(sum(c) for c in calls)
    return max((b for b in range(2 * n, top + 1) if proven(even_split(b, n))), default=0)


def test_even_cap_known_by_dominance_is_closed_by_one_direct_probe():
    shape = workspace_jump()
    e = best_even(shape)
    out, be = run(shape, "max_batch", 256, max_probes=12)
    assert out.best.batch_size == best_batch(shape) and out.certified
    assert out.even is not None and out.even.batch_size == e and not out.even_open
    assert out.even_implied_by                                  # E itself was never probed
    # E + 1 was asked directly (card 0 as in even(E + 1), in that batch; the other cards'
    # own tests may ride along)
    assert any(c[0] == even_split(e + 1, 4)[0] and sum(c) == e + 1 for c in be.calls)
    assert len(be.calls) <= 8, [sum(c) for c in be.calls]       # the old walk: open after 12


@pytest.mark.parametrize("jump", [64 * MiB, 256 * MiB, 1 * GiB])
@pytest.mark.parametrize("max_probes", [5, 6, 7])
def test_an_open_even_bracket_reports_what_the_probes_prove(jump, max_probes):
    shape = workspace_jump(jump)
    e = best_even(shape)
    out, be = run(shape, "max_batch", 256, max_probes=max_probes)
    lo = out.even.batch_size if out.even is not None else 0
    assert lo == proven_even(shape, be.calls)                   # never less than proven
    assert lo <= e
    if out.even_open:
        assert out.even_at_most is None or out.even_at_most >= e
        assert any("not bracketed" in n and f"at least {lo}" in n for n in out.notes)
    else:
        assert lo == e


def test_the_headline_gives_an_open_even_bracket_as_a_range():
    import torch.nn as nn

    from dptune import Tuner

    shape = workspace_jump()
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    r = Tuner(model, lambda b: None, batch_size=256, objective="max_batch", max_probes=6,
              backend=CurveBackend(shape), headroom=HEAD, verbose=False,
              budget_level="allocated").fit()   # CurveBackend's peaks are allocated peaks
    calls = [list(p.chunk_sizes) for p in r.probes]
    lo = proven_even(shape, calls)
    assert r.even.open_bracket and r.even.batch_size == lo > 256
    hi = r.even.at_most
    assert hi is not None and lo <= best_even(shape) <= hi
    low, high = r.batch_size / hi - 1, r.batch_size / lo - 1
    head = f"max batch that fits: even {lo} to {hi} -> balanced {r.batch_size} "
    text = render_table(r)
    if high - low <= 0.10:      # a narrow range: both ends, as the probes prove them
        assert f"{head}(+{100 * low:.1f}% to +{100 * high:.1f}%)" in text, text
    else:                       # a wide one is no headline: no figure at all
        assert f"{head}(gain not proven" in text, text


def test_no_even_split_known_to_fit_is_not_a_headline_figure():
    import torch.nn as nn

    from dptune import Tuner

    # card 0 steps up by 14 GiB above a batch of 1000: the start (40000) is far over, and the
    # third probe (the best split) gives card 0 no samples, so after 3 probes no even split is
    # known to fit (with a smaller step the third probe already proves one by dominance)
    shape = workspace_jump(14 * GiB)
    r = Tuner(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), lambda b: None,
              batch_size=40000, objective="max_batch", max_probes=3, backend=CurveBackend(shape),
              headroom=HEAD, verbose=False, budget_level="allocated").fit()
    assert proven_even(shape, [list(p.chunk_sizes) for p in r.probes]) == 0
    assert r.even.open_bracket and not r.even.feasible
    assert r.even.at_most is not None and r.even.at_most >= best_even(shape)
    line = next(x for x in render_table(r).splitlines() if x.startswith("max batch that fits"))
    assert line == (f"max batch that fits: even none known to fit (at most {r.even.at_most}) "
                    f"-> balanced {r.batch_size}")


def test_even_baseline_does_not_restart_from_the_first_probe():
    """Card 0 convex in its chunk (the even guesses overshoot): the search asks the even split
    between what is measured, never ``even(hint + 1)``, which only the first probe (the
    caller's batch, far below card 0's cap) implies; it was 2 probes more on such a surface."""
    w, a = 2 * GiB, 40 * MiB
    shape = Shape("convex-card0", [24 * GiB] * 4, f=lambda i, c: w + a * c,
                  g=lambda c0, b: w + GiB + a * c0 + 20 * MiB * b + 100 * 1024 * c0 * c0)
    out, be = run(shape, "max_batch", 256)
    assert out.certified and out.best.batch_size == best_batch(shape)
    assert out.even is not None and out.even.batch_size == best_even(shape)
    assert 257 not in [sum(c) for c in be.calls]
    assert len(be.calls) <= 9


def test_first_probe_spreads_the_cards_only_where_every_card_is_measured():
    """The spread first probe (a slope across the cards) needs every card's peak: on real
    cards an out-of-memory probe measures only the failing card, so the search starts from
    the even split there; with two cards there is no slope across cards >= 1 to take."""
    assert run(mlp(4), "max_batch", 256)[1].calls[0] == [64, 64, 64, 80]
    assert run(mlp(4), "max_batch", 256, real=True)[1].calls[0] == [64, 64, 64, 64]
    assert run(mlp(2), "max_batch", 128)[1].calls[0] == [64, 64]
    out, be = run(batchnorm(), "max_batch", 256)      # BatchNorm: still no chunk of 1
    assert be.calls[0] == [64, 64, 64, 80] and out.certified


def test_stalled_bracket_steps_from_an_end_only_on_the_simulator():
    """A card's bracket [100, 200) whose lower end rose by 4 in the last probe (the fits'
    guess fitted, too low): on the simulator the next point is 4 x 2 above it (a staircase's
    step); on real cards, where an out-of-memory probe measures only the failing card, the
    middle (fewer probes there over the 3+-card synthetic cases: 1,330 against 1,392)."""
    from dptune.search.max_batch import MaxBatch
    from dptune.search.observations import Observations

    for exact, want in ((True, 108), (False, 150)):
        mb = MaxBatch(Observations([10**12] * 3, exact_on_oom=exact), 64, 12)
        mb.ends["card1"] = [(96, 200), (100, 200)]
        assert mb._unstall("card1", 100, 200) == want


def test_probes_run_out_before_anything_fits_says_so_not_that_nothing_fits():
    """Real cards, a first batch 15 times too large and 2 probes: nothing measured within
    budget, but a batch of 1 was never asked, so the error does not claim it does not fit."""
    from dptune.errors import NoFeasibleSplitError

    with pytest.raises(NoFeasibleSplitError) as e:
        run(mlp(4), "max_batch", 40000, real=True, max_probes=2)
    msg = str(e.value)
    assert "batch size 1 " not in msg and "a smaller one was not tried" in msg


def near_limit(seed: int) -> tuple[Shape, int]:
    """A random cluster of 2-8 mixed cards (12-80 GiB, some memory held by others) running
    one of the shapes above, with a batch at most 1% below the largest any split fits: a
    balance near the limit, where the even split runs out of memory."""
    import random

    rng = random.Random(seed)
    while True:             # clusters where some split fits a few samples a card
        n = rng.choice([2, 3, 4, 6, 8])
        shape = rng.choice([mlp, big_output, plateau, slope_drop])(n)
        shape.totals = [rng.choice([12, 16, 24, 40, 80]) * GiB for _ in range(n)]
        shape.used = [rng.choice([0, 0, 2, 6]) * GiB for _ in range(n)]
        top = best_batch(shape)
        if top >= 4 * n:
            return shape, top - rng.randint(0, max(1, top // 100))


def test_balance_near_the_limit_on_real_cards_finds_a_split():
    """Real cards, 24 random clusters a balance near the largest batch (:func:`near_limit`):
    an out-of-memory probe measures only the failing card, and probes at the batch each
    learnt one card (none fitting: the balance raised "no split fits" on 16 of the 24, where
    a split with a largest share of 0.97-0.999 exists, and certified 6). Now two scouts at a
    smaller batch measure every card first: a split measured within budget, the exhaustive
    optimum wherever certified (within the 2% tolerance where the even split is kept),
    certified on at least 20, and at most one run out of probes, saying so (no claim that
    no split fits)."""
    certified = ran_out = 0
    for seed in range(24):
        shape, batch = near_limit(seed)
        assert best_share(shape, batch) <= 1.0
        try:
            out, be = run(shape, "balance", batch, real=True, max_probes=12)
        except NoFeasibleSplitError as e:
            assert "none is proven not to fit" in str(e), seed
            ran_out += 1
            continue
        measured_within(shape, out)
        assert len(be.calls) <= 12
        if out.certified:
            certified += 1
            assert_balanced(shape, batch, out, seed)
    assert certified >= 20 and ran_out <= 1


def test_balance_probes_run_out_says_so_not_that_nothing_fits():
    """A balance whose probes ran out before any split of the batch fitted says that none
    is proven not to fit and that more probes may find one; a batch the probes prove too
    large (the chunks below those measured over add up to less) says no split fits."""
    shape, batch = near_limit(1)        # the even split runs out of memory there
    with pytest.raises(NoFeasibleSplitError) as e:
        run(shape, "balance", batch, real=True, max_probes=2)
    assert "none is proven not to fit" in str(e.value) and "--max-probes" in str(e.value)
    assert "fits every card's budget" not in str(e.value)
    assert "the one probe of this batch ran out of memory" in str(e.value)
    shape = mlp(4)          # 30% over the largest batch: the fits' prediction is said as one
    with pytest.raises(NoFeasibleSplitError) as e:
        run(shape, "balance", 13 * best_batch(shape) // 10, real=True, max_probes=12)
    assert "none is proven not to fit" in str(e.value)
    assert "the fits predict the best split" in str(e.value) and "also over" in str(e.value)
    # predicted over by far more than the tolerance: a smaller batch leads the advice
    assert "Try a smaller batch_size" in str(e.value) and "would settle it" in str(e.value)
    assert "More probes may find one" not in str(e.value)
    shape = mlp(2)
    with pytest.raises(NoFeasibleSplitError) as e:
        run(shape, "balance", 4 * best_batch(shape), max_probes=12)
    assert "fits every card's budget" in str(e.value) and "proven" not in str(e.value)


def test_real_cards_halve_an_oversized_first_batch_until_one_fits():
    """Real cards, many over budget at the first batch: an out-of-memory probe names one
    card, so the search halves the even batch while nothing has fitted, rather than learn
    the cards one probe each; the answer is then found and certified."""
    shape = mlp(4)
    out, be = run(shape, "max_batch", 40000, real=True, max_probes=16)
    sums = [sum(c) for c in be.calls]
    first_fit = next(k for k, c in enumerate(be.calls) if fits(shape, c))
    assert all(b2 <= b1 // 2 + 1 for b1, b2 in zip(sums[1:first_fit], sums[2:first_fit + 1]))
    assert out.best.batch_size == best_batch(shape) and out.certified


# ---- balance on the reserved level's staircases ----------------------------------------------

def rounded_staircase(seed: int) -> Shape:
    """A card's reserved figure as the caching allocator rounds it: one to three activations
    of a random width, each block rounded up to 2 MiB (steps every 8 to 64 samples), over a
    fixed 2-6 GiB; card 0 adds the gathered outputs of the whole batch. Mixed cards."""
    import random

    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    two = 2 * MiB
    layers = [[(two // rng.choice([8, 16, 32, 64]), rng.randint(2, 12))
               for _ in range(rng.randint(1, 3))] for _ in range(n)]
    base = [rng.randint(2, 6) * GiB for _ in range(n)]
    totals = [rng.choice([24, 40, 80]) * GiB for _ in range(n)]

    def level(i: int, c: int) -> int:
        return base[i] + sum(k * (-(-c * s // two) * two) for s, k in layers[i])

    return Shape(f"rounded{seed}", totals, f=level, g=lambda c0, b: level(0, c0) + 64 * 1024 * b)


def test_balance_on_rounded_staircases_is_exact_and_certified():
    """Balance where every card's figure is flat for 8-64 samples at a time (the reserved
    level), 40 random clusters: every answer measured within budget, the exhaustive optimum
    wherever certified, and certified within the default 12 probes on at least 38 (one more
    sample per card stays on a flat step, so the certificate needs each card's step edges:
    with that rule alone, 34)."""
    cases = [(s, 600 * len(s.totals)) for s in map(rounded_staircase, range(40))]
    assert balance_certified(cases) >= 38


def assert_balanced(shape: Shape, batch: int, out: search.SearchOutcome, tag: object) -> None:
    """A certified balance's largest share (on the true curves) is the exhaustive optimum;
    where the even split was kept, within the 2% tolerance above it."""
    peaks = CurveBackend(shape).peaks(out.best.chunk_sizes)
    share = max(p / b for i, (p, b) in enumerate(zip(peaks, budgets(shape)))
                if i == 0 or out.best.chunk_sizes[i] > 0)
    best = best_share(shape, batch)
    if out.even_kept:
        assert best <= share <= 1.02 * best, tag
    else:
        assert share == pytest.approx(best, abs=1e-12), tag


def balance_certified(cases: Sequence[tuple[Shape, int]]) -> int:
    """Balance on each ``(shape, batch)`` within the default 12 probes: every answer measured
    within budget, the exhaustive optimum wherever certified, the reason said wherever not.
    Returns how many were certified."""
    certified = 0
    for k, (shape, batch) in enumerate(cases):
        out, be = run(shape, "balance", batch, max_probes=12)
        measured_within(shape, out)
        assert len(be.calls) <= 12
        if out.certified:
            certified += 1
            assert_balanced(shape, batch, out, (k, shape.name))
        else:
            assert any("not certified" in n for n in out.notes), (k, shape.name)
    return certified


def cliff_shape(seed: int) -> tuple[Shape, int]:
    """The wide MLP with card 0 partly taken (6 GiB) whose card 0 jumps by 4-8 GiB past a
    chunk ``K`` a little below where the balanced split would put it (the reserved level's
    cliff when a block crosses a power of two: the simulated MLP's card 0 reads 8.9 GB at
    8,192 samples and 11.1 GB at 8,193). ``K`` is a multiple of 64 on even seeds, any chunk on
    odd ones. Returns the shape and its batch."""
    import random

    rng = random.Random(seed)
    w, a, opt = 2 * GiB, 30 * MiB, 4 * GiB
    n = rng.choice([3, 4])
    batch = 2000 if n == 4 else 1400
    jump = rng.choice([4, 6, 8]) * GiB
    used = [6 * GiB] + [0] * (n - 1)
    bud0, bud1 = 24 * GiB - used[0] - HEAD, 24 * GiB - HEAD

    def g0(c0: int, b: int) -> int:
        return w + opt + a * c0 + 4096 * b

    def worst(c0: int) -> float:
        return max(g0(c0, batch) / bud0, (w + a * -(-(batch - c0) // (n - 1))) / bud1)

    k = min(range(batch + 1), key=worst) - rng.randint(5, 120)
    if seed % 2 == 0:
        k -= k % 64
    return Shape(f"cliff{seed}", [24 * GiB] * n, f=lambda i, c: w + a * c,
                 g=lambda c0, b: g0(c0, b) + (jump if c0 > k else 0), used=used), batch


def test_balance_past_a_cliff_on_card_0():
    """A cliff in card 0's figure (40 random clusters, see :func:`cliff_shape`): its fits miss
    it, and once they have missed twice the level test puts card 0 on a round chunk of its
    range (where such cliffs rise) instead of its line. Every answer measured within budget,
    the exhaustive optimum wherever certified, certified within the default 12 probes on at
    least 32 (29 with the line alone, 445 probes in all against 410)."""
    assert balance_certified([cliff_shape(seed) for seed in range(40)]) >= 32


def test_spread_shares_the_extra_in_proportion_to_the_room():
    """``_spread`` (the balance's level test): the lows plus the extra, summing exactly, none
    past its high, in proportion to each room (the remainder one by one)."""
    import random

    from dptune.search.balance import _spread

    assert _spread([10, 20], [30, 60], 30) == [20, 40]
    assert _spread([0, 0, 0], [5, 5, 5], 7) == [3, 2, 2]
    rng = random.Random(2)
    for _ in range(500):
        lows = [rng.randint(0, 50) for _ in range(rng.randint(1, 6))]
        highs = [lo + rng.randint(0, 40) for lo in lows]
        extra = rng.randint(0, sum(highs) - sum(lows))
        out = _spread(lows, highs, extra)
        assert sum(out) == sum(lows) + extra
        assert all(lo <= o <= h for lo, o, h in zip(lows, out, highs))


def test_balance_caps_below_a_measured_split_do_not_raise():
    """A card measured over at a chunk below one it was measured within at (a figure that
    is not monotone: fragmentation at the reserved level) caps the solver below the batch;
    the split measured within budget stands, and no "no split fits" is raised for it."""
    from dptune.backends.base import ProbeResult
    from dptune.search.balance import Balance
    from dptune.search.observations import Observations

    budget = 10 * GiB
    obs = Observations([budget, budget], exact_on_oom=True)
    bal = Balance(obs, 300, 12, 0.02, [])
    for split, peaks in (((150, 150), (9 * GiB, 9 * GiB)),
                         ((140, 160), (8 * GiB, 9 * GiB + GiB // 2)),
                         ((195, 105), (11 * GiB, 11 * GiB))):     # card 1 over at 105 < 150
        bal.pred[split] = [float(p) for p in peaks]
        obs.add(ProbeResult(split, peaks, purpose="refine"))
    assert bal.caps() == [194, 104]         # 298 samples in all: the solver finds no split
    assert bal._solve(obs.probes[-1]) is None
    assert obs.best_within(300) is not None


def test_a_line_below_an_out_of_memory_bound_is_turned_up_through_it():
    """Real cards: an out-of-memory probe records the failing card's figure as a lower bound
    (not a fit point). A line through two small chunks that predicted that chunk to fit is
    turned up about its largest measured chunk below to pass through the bound, so it puts
    the card well below the failure rather than one sample under it; a bound carried over
    from another search (``add_bound``) does not move it, nor does one the line clears."""
    from dptune.backends.base import ProbeResult
    from dptune.search.models import CardFits
    from dptune.search.observations import Observations

    budget = 10 * GiB
    obs = Observations([budget, budget], exact_on_oom=False)
    obs.add(ProbeResult((10, 10), (2 * GiB, 2 * GiB)))
    obs.add(ProbeResult((10, 20), (2 * GiB, 3 * GiB)))       # card 1: a GiB per 10 samples
    flat = CardFits(obs).card_line(1, 20)
    assert flat is not None and flat.at(200) == pytest.approx(21 * GiB)
    obs.add_bound(ProbeResult((10, 60), (2 * GiB, 12 * GiB)))  # another search's: ignored
    assert CardFits(obs).card_line(1, 20) == flat
    obs.add(ProbeResult((10, 100), (GiB, 11 * GiB), oom_device=1))  # the line said 11 GiB: clears
    assert CardFits(obs).card_line(1, 20) == flat
    obs.add(ProbeResult((10, 80), (GiB, 13 * GiB), oom_device=1))   # the line said 9 GiB here
    line = CardFits(obs).card_line(1, 20)
    assert line is not None and line.at(80) == pytest.approx(13 * GiB)
    assert line.at(20) == pytest.approx(3 * GiB)                    # pivoted on chunk 20
    assert (budget - line.intercept) / line.slope < 65               # the bound says it


def test_balance_on_real_cards_stops_halving_when_card_0_holds_no_sample():
    """Real cards, 8 mixed cards, card 0 holding 20 GiB of optimizer state and gathered
    outputs (it fits only with no samples: :func:`sheds_replica`), the batch near the
    largest. Every halved scout gives card 0 samples and runs out on it; after a few the
    shift at the batch moves card 0's samples off, and the balance is found and certified
    (halving down to one sample a card used every probe, and the error said none was found)."""
    shape = sheds_replica(8)
    shape.totals = [g * GiB for g in (24, 12, 40, 12, 16, 80, 24, 16)]
    shape.used = [g * GiB for g in (0, 0, 2, 0, 0, 0, 6, 6)]
    out, be = run(shape, "balance", 3069, real=True, max_probes=12)
    assert out.certified and out.best.chunk_sizes[0] == 0
    measured_within(shape, out)
    assert_balanced(shape, 3069, out, shape.name)
