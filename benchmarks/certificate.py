"""dptune's largest-batch probes against the certificate's own minimum:
``python -m benchmarks.certificate [--level reserved|allocated] [--quick] [--no-models]``.

The synthetic surfaces have no level; the model cases do. At dptune's default level
(``reserved``, the default here) they are the small models of
:data:`benchmarks.certificate_levels.LEVEL_MODELS` (2-3 cards of 2 GB, and the audited wide MLP
on 4 x 24 GB), each card's figure the simulator's reserved peak plus NCCL's buffers; at
``--level allocated`` the small models of :data:`benchmarks.certificate_cases.MODELS` on 1 GB
cards (NCCL's buffers alone fill a 1 GB card at the reserved level), at the allocated peak.

For each case (a memory surface: card ``i >= 1`` peaks at ``f(i, c)``, card 0 at
``g(c0, B)``; synthetic families, and small models whose curves are measured on the
simulator, see :mod:`benchmarks.certificate_cases`) this runs ``dptune.search.run(...,
"max_batch")`` and counts its probes, then computes, independently of the search, the fewest
probes that could prove the same answer with the same proof rules (the monotone surface of
:mod:`dptune.search.observations`):

- (A) a probe of a split of the largest batch ``B*`` measured within every budget;
- (B) ``B* + 1`` proven infeasible: each card ``i >= 1`` capped below the smallest chunk
  measured over its budget, and card 0 measured over at a chunk no larger than what those
  caps leave it, in a batch no larger than ``B* + 1``;
- (C) the even split's largest batch ``E``: ``even(E)`` fits by dominance (every card
  measured within budget at a chunk at least as large; card 0 also in a batch at least as
  large);
- (D) ``even(E + 1)`` over: a card measured over at a point it dominates (or (B) when
  ``E = B*``).

A probe serves several of these at once (its every card gives a point). The minimum is
found by brute force over sets of candidate probes: each card ``i >= 1`` at one of its
critical chunks (0, its cap ``C_i``, ``C_i + 1``, its chunk in ``even(E)`` and in
``even(E + 1)``), card 0 at any chunk (for each choice of the others only the points that
matter are kept: the largest chunk within budget, the smallest over, and the chunks that
make the batch ``B*``, ``B* + 1``, ``E``, ``E + 1``), candidates dominated by another
(every card's point at least as informative) dropped, then sets of 2, 3, ... probes tried
in turn. ``min_max`` is the same without (C) and (D): what the largest batch alone needs.

The exhaustive answers (``B*``, ``E``) come from the surface itself (caps by scan, the
largest batch and the even batch by bisection on the monotone surface). Every dptune
answer is checked against them; a mismatch is reported as ``WRONG``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from dptune import search as dsearch
from dptune.split import even_split

from benchmarks.certificate_answer import Answer, _last_true, answer, card0_chunk
from benchmarks.certificate_surface import GiB, MiB, Surface, _valid  # noqa: F401  (used here and re-exported)


# ---- the certificate's own minimum ---------------------------------------------------------

#: One card's point in a probe: card 0 ``(chunk, batch, over)``, card ``i >= 1``
#: ``(chunk, over)``; ``None`` for a card ``i >= 1`` with no samples (nothing measured).
Cand = tuple


def _cand(s: Surface, split: Sequence[int]) -> Cand:
    ov = s.over(split)
    pts: list[object] = [(split[0], sum(split), ov[0])]
    pts += [(c, ov[i]) if c else None for i, c in enumerate(split) if i]
    return tuple(pts)


def _dominates(p: Cand, q: Cand) -> bool:
    """Every card's point in ``p`` proves at least what it proves in ``q``."""
    for a, b in zip(p, q):
        if b is None:
            continue
        if a is None or a[-1] != b[-1]:
            return False
        ge = all(x >= y for x, y in zip(a[:-1], b[:-1]))
        le = all(x <= y for x, y in zip(a[:-1], b[:-1]))
        if not (le if b[-1] else ge):
            return False
    return True


def _critical(s: Surface, ans: Answer, i: int) -> set[int]:
    e0, e1 = even_split(ans.even, s.n), ans.even_next
    vals = {0, ans.caps[i - 1], ans.caps[i - 1] + 1, e0[i], e1[i]}
    return {v for v in vals if v == 0 or v >= s.m}


def _card0_points(s: Surface, ans: Answer, fixed: int, free: int) -> set[tuple[int, int]]:
    """Card 0's useful ``(chunk, batch)`` with the other cards at ``fixed`` samples in all
    and ``0..free`` more (cards free to take what fills the batch)."""
    bud, top = s.budgets[0], ans.best + 1
    pts = set()

    def last_within(batch_of: Callable[[int], int], hi: int, guess: int) -> int:
        if hi < 0 or s.g(0, batch_of(0)) > bud:
            return -1
        return min(hi, _last_true(lambda c: c <= hi and s.g(c, batch_of(c)) <= bud, 0,
                                  max(0, min(hi, guess))))
    near = ans.best - fixed - free      # card 0's chunk near the answer: a guess to start from
    w = last_within(lambda c: c + fixed + free, top, near)
    pts |= {(w, w + fixed + free), (w + 1, w + 1 + fixed + free)}
    a = last_within(lambda c: ans.best, ans.best - fixed, near)       # a split of B*
    if a >= ans.best - fixed - free:
        pts.add((a, ans.best))
    for cap in (top, sum(ans.even_next)):                       # over, in a batch <= cap
        o = last_within(lambda c, cap=cap: min(cap, c + fixed + free), cap - fixed,
                        cap - fixed - free) + 1
        if o + fixed <= cap:
            pts.add((o, min(cap, o + fixed + free)))
    e0 = even_split(ans.even, s.n)[0]
    pts.add((e0, e0 + fixed + free))
    if e0 + fixed <= ans.even <= e0 + fixed + free:
        pts.add((e0, ans.even))
    return {(c, b) for c, b in pts if 0 <= c <= b and b > 0}


FREE = -1


def candidates(s: Surface, ans: Answer) -> tuple[list[Cand], list[Cand]]:
    """(probes of a split of ``B*`` within budget, every other candidate probe not dominated).

    A card ``i >= 1`` is at a critical chunk or *free*: any chunk up to its cap, to fill the
    batch; a free card is credited with a point within budget at its cap, the most it could
    show (generous, so the minimum stays a lower bound)."""
    pool: dict[Cand, None] = {}
    for t in itertools.product(*[sorted(_critical(s, ans, i)) + [FREE] for i in range(1, s.n)]):
        fixed = sum(c for c in t if c != FREE)
        free = sum(ans.caps[i] for i, c in enumerate(t) if c == FREE and ans.caps[i] >= s.m)
        others = [None if c == 0 or (c == FREE and ans.caps[i] < s.m) else
                  (ans.caps[i], False) if c == FREE else (c, s.f(i + 1, c) > s.budgets[i + 1])
                  for i, c in enumerate(t)]
        for c0, b in _card0_points(s, ans, fixed, free):
            pool[((c0, b, s.g(c0, b) > s.budgets[0]), *others)] = None
    every = list(pool)
    fit_a = [c for c in every if c[0][1] == ans.best and not any(p[-1] for p in c if p)]
    kept = [c for c in every if not any(_dominates(d, c) and d != c for d in every)]
    return fit_a, kept


class _Checker:
    """Whether a set of candidate probes proves the answer (the rules of the module doc)."""

    def __init__(self, s: Surface, ans: Answer, with_even: bool):
        self.s, self.ans, self.with_even = s, ans, with_even
        self._c0: dict[tuple[int, ...], Optional[int]] = {}

    def _card0_left(self, h: tuple[int, ...]) -> Optional[int]:
        if h not in self._c0:
            capped = [x - 1 if x else self.ans.best + 1 for x in h]
            self._c0[h] = card0_chunk(self.ans.best + 1, capped, self.s.m)
        return self._c0[h]

    def infeasible(self, probes: Sequence[Cand]) -> bool:
        n = self.s.n
        h = tuple(min((p[i][0] for p in probes if p[i] is not None and p[i][1]), default=0)
                  for i in range(1, n))
        c0 = self._card0_left(h)
        return c0 is None or any(p[0][2] and p[0][0] <= c0 and p[0][1] <= self.ans.best + 1
                                 for p in probes)

    def even_fits(self, probes: Sequence[Cand]) -> bool:
        if self.ans.even == 0:
            return True
        e = even_split(self.ans.even, self.s.n)
        if not any(not p[0][2] and p[0][0] >= e[0] and p[0][1] >= self.ans.even for p in probes):
            return False
        return all(e[i] == 0 or any(p[i] is not None and not p[i][1] and p[i][0] >= e[i]
                                    for p in probes) for i in range(1, self.s.n))

    def even_over(self, probes: Sequence[Cand]) -> bool:
        e, b = self.ans.even_next, sum(self.ans.even_next)
        if any(p[0][2] and p[0][0] <= e[0] and p[0][1] <= b for p in probes):
            return True
        if any(e[i] > 0 and p[i] is not None and p[i][1] and p[i][0] <= e[i]
               for p in probes for i in range(1, self.s.n)):
            return True
        return b == self.ans.best + 1 and self.infeasible(probes)

    def __call__(self, probes: Sequence[Cand]) -> bool:
        if not self.infeasible(probes):
            return False
        return not self.with_even or (self.even_fits(probes) and self.even_over(probes))


def minimum(s: Surface, ans: Answer, with_even: bool = True, most: int = 6) -> Optional[int]:
    """The fewest candidate probes that prove ``ans`` (None: not within ``most``)."""
    fit_a, kept = candidates(s, ans)
    fit_a = [a for a in fit_a if not any(_dominates(d, a) and d != a for d in fit_a)]
    check = _Checker(s, ans, with_even)
    for k in range(1, most + 1):
        for a in fit_a:
            for rest in itertools.combinations(kept, k - 1):
                if check((a, *rest)):
                    return k
    return None


# ---- the run -------------------------------------------------------------------------------

@dataclass
class Row:
    family: str
    name: str
    n: int
    best: int
    even: int
    probes: int               # dptune's
    even_probes: int          # dptune's probes asked for the even baseline ("even-max...")
    own_min: Optional[int]    # the fewest of dptune's own probes that prove its answer
    minimum: Optional[int]    # the certificate's minimum (any candidate probes)
    minimum_max: Optional[int]  # the same for the largest batch alone
    ok: bool                  # dptune's answer exact and certified
    purposes: tuple[str, ...]

    def phase(self, name: str) -> int:
        """dptune's probes of one phase: ``start`` (the first split, even or spread, and the
        probe that measures card 0's cost per sample of the batch: learning, no part of a
        certificate as a rule), ``max`` (the largest batch's), ``even-max`` (the even baseline's)."""
        if name == "start":
            return sum(p in ("even", "spread", "fit", "start") for p in self.purposes)
        return sum(p.split("+")[0] == name for p in self.purposes)

    @property
    def ratio(self) -> float:
        return self.probes / self.minimum if self.minimum else float("nan")


def own_minimum(s: Surface, ans: Answer, splits: Sequence[Sequence[int]]) -> Optional[int]:
    """The fewest of the probes run that prove the answer (the others play no part)."""
    cands = [_cand(s, sp) for sp in splits]
    check = _Checker(s, ans, True)
    fit_a = [c for c in cands if c[0][1] == ans.best and not any(p[-1] for p in c if p)]
    for k in range(1, len(cands) + 1):
        for a in fit_a:
            for rest in itertools.combinations([c for c in cands if c != a], k - 1):
                if check((a, *rest)):
                    return k
    return None


def measure(s: Surface, max_probes: int = 12) -> Row:
    """dptune's largest batch on ``s``, told what the tuner tells it on those cards (on
    simulated cards at the reserved level, the look and the even line on the allocator model:
    :func:`benchmarks.certificate_levels.known_of`), against the answer; exact also where its
    split, measured within budget, lies above the bisection's ``B*`` (which it disproves)."""
    from benchmarks.certificate_levels import beyond, known_of

    ans = answer(s)
    out = dsearch.run(s.probe, s.budgets, "max_batch", s.hint or 64 * s.n, min_chunk=s.m,
                      max_probes=max_probes, exact_on_oom=True, known=known_of(s))
    even = out.even.batch_size if out.even is not None else 0
    split = out.best.chunk_sizes
    ok = (out.best.batch_size == ans.best or beyond(s, ans.best, split)) and even == ans.even \
        and out.certified and not out.even_open and not any(s.over(split))
    splits = [p.chunk_sizes for p in out.probes]
    purposes = tuple(p.purpose for p in out.probes)
    return Row(s.family, s.name, s.n, ans.best, ans.even, len(splits),
               sum(p.startswith("even-max") for p in purposes), own_minimum(s, ans, splits),
               minimum(s, ans), minimum(s, ans, with_even=False), ok, purposes)


def auto_probes(level: str = "allocated") -> list[str]:
    """``output_device="auto"``: the probes of each of its two searches (TinyGPT, 3x1GB and
    4x1GB, as in ``tests/search/test_search_models.py``; 2 GB cards at the reserved level,
    whose NCCL buffers alone fill a 1 GB card)."""
    import warnings

    import torch

    from benchmarks.certificate_cases import HEADROOM
    from dptune.backends.simulated import SimulatedBackend, parse_cluster
    from dptune.examples.models import TinyGPT
    from dptune.tuner import Tuner
    from dptune.step.workload import Workload

    lines = []
    for spec in (("3x1GB", "4x1GB") if level == "allocated" else ("3x2GB", "4x2GB")):
        model = TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)

        def opt(p):  # type: ignore[no-untyped-def]
            return torch.optim.AdamW(p, lr=1e-4)
        backend = SimulatedBackend(Workload(model, model.sample, None, opt), parse_cluster(spec))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = Tuner(model, model.sample, batch_size=32, optimizer=opt, objective="max_batch",
                      headroom=HEADROOM, verbose=False, backend=backend,
                      output_device="auto", budget_level=level).fit()
        second = sum(p.purpose.startswith("output ") for p in r.probes)
        lines.append(f"| TinyGPT {spec} | {len(r.probes) - second} | {second} | "
                     f"{r.batch_size} on card {r.output_device} | "
                     f"{r.card0_output_batch_size if r.card0_output_batch_size else r.batch_size} "
                     f"on card 0 |")
    return lines


def table(rows: Sequence[Row]) -> str:
    head = ("| family | case | cards | B* | E | dptune | even-max | own min | min | min (max only) "
            "| ratio | exact |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r.family} | {r.name} | {r.n} | {r.best} | {r.even} | {r.probes} | "
            f"{r.even_probes} | {r.own_min} | {r.minimum} | {r.minimum_max} | {r.ratio:.2f} | "
            f"{'yes' if r.ok else 'WRONG'} |" for r in rows]
    return "\n".join([head] + body)


def summary(rows: Sequence[Row]) -> str:
    good = [r for r in rows if r.minimum]
    lines = ["| family | cases | dptune probes | minimum | mean ratio | worst ratio | start | max "
             "| even-max |", "|---|---|---|---|---|---|---|---|---|"]
    groups = {fam: [r for r in good if r.family == fam] for fam in sorted({r.family for r in good})}
    # two cards: a search that starts knowing nothing needs two probes before it can place
    # card 1 at its cap (one point per probe, a line has two unknowns), so 5 probes where the
    # certificate needs 3 is the floor there; three cards or more give a slope across the
    # cards from the first probe
    groups["2 cards"] = [r for r in good if r.n == 2]
    groups["3+ cards"] = [r for r in good if r.n >= 3]
    groups["all"] = list(good)
    for fam, sub in groups.items():
        if not sub:
            continue
        worst = max(sub, key=lambda r: r.ratio)
        lines.append(f"| {fam} | {len(sub)} | {sum(r.probes for r in sub)} | "
                     f"{sum(r.minimum or 0 for r in sub)} | "
                     f"{statistics.mean(r.ratio for r in sub):.2f} | "
                     f"{worst.ratio:.2f} ({worst.name}) | "
                     f"{statistics.mean(r.phase('start') for r in sub):.2f} | "
                     f"{statistics.mean(r.phase('max') for r in sub):.2f} | "
                     f"{statistics.mean(r.even_probes for r in sub):.2f} |")
    return "\n".join(lines)


def cases(quick: bool, models: bool, level: str = "allocated") -> list[Surface]:
    from benchmarks.certificate_cases import (MODELS, model_surface, random_affine, staircase,
                                              synthetic)
    from benchmarks.certificate_levels import LEVEL_MODELS, level_surface

    out = synthetic() + [staircase(k) for k in range(4 if quick else 8)] + \
        [random_affine(k) for k in range(8 if quick else 24)]
    if models and level == "allocated":
        out += [model_surface(name) for name in (["causal-lm", "bn-cnn"] if quick else MODELS)]
    elif models:
        out += [level_surface(name, level)
                for name in (["causal-lm", "bn-cnn"] if quick else LEVEL_MODELS)]
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.certificate", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--no-models", action="store_true", help="synthetic surfaces only")
    ap.add_argument("--no-auto", action="store_true", help="skip output_device='auto'")
    ap.add_argument("-v", "--verbose", action="store_true", help="each case's probe purposes")
    ap.add_argument("--level", choices=("reserved", "allocated"), default="reserved",
                    help="the model cases' budget level (default: %(default)s, dptune's)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for s in cases(args.quick, not args.no_models, args.level):
        rows.append(measure(s))
        if args.verbose:
            print(s.name, rows[-1].purposes, file=sys.stderr)
    print(table(rows))
    print()
    print(summary(rows))
    if not args.no_auto and not args.no_models:
        print("\n| output_device=\"auto\" | first search | second search | answer | card 0 |\n"
              "|---|---|---|---|---|")
        print("\n".join(auto_probes(args.level)))
    print(f"\n{len(rows)} cases in {time.perf_counter() - t0:.0f} s")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
