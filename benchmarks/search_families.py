"""The largest-batch search on the tests' synthetic families: how often it is certified and
exact, how often the even baseline is left open, and the probes it takes.

``python -m benchmarks.search_families [--n 40] [--without-flat-step]`` (a few minutes on 2
cores). Families (analytic curves from ``tests/search``, answers by brute force there):

- alike staircases: identical cards 1..n-1 on a segment staircase (``_alike_surface``), the
  default probe cap (12), the cards named alike;
- fine staircases: four identical 24 GB cards on 20 MiB steps of a few samples each (what
  ``expandable_segments:True`` maps), thousands of samples per card (``_fine_surface``);
- mixed clusters: staircases on 3-5 cards, some alike, NCCL or not (``random_cluster``);
- staircases: monotone staircases (``staircase``), on the simulator and with real-card
  out-of-memory semantics, 16 probes.

``--without-flat-step`` switches off the even baseline's flat-step rule
(:meth:`dptune.search.even_baseline.EvenBaseline._crept`) for a before/after pair in one
run. Estimated on curves, not measured on a card. Measured 2026-11-30 (``--n 40``): alike
staircases 24 of 40 even brackets open, 443 probes (26 and 447 without the rule); mixed
clusters 40 certified, 231 probes (230 without); staircases 61 certified, 1,036 probes (the
same without). After the flat-step condition of the largest-batch search (a step asked where
it ends only when the bracket's upper end reads about a segment above it, commit ``52017f8``):
alike 34 certified (29 before), 22 even brackets open, 442 probes; fine 31 certified (18
before), 473 probes; mixed clusters the same; staircases 61, 1,037 probes.
After the real-card bound step (``MaxBatch._bound_step``): staircases 64 certified, 65 exact,
1,032 probes; the other families the same.
With the real-card growth cap (``REAL_GROWTH``) and card 0's bound step: staircases 74
certified and exact, 1,007 probes; the other families the same.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def alike_staircases(n: int) -> dict[str, int]:
    from tests.search import test_search_levels as L
    from tests.support.level_oracle import largest_batch

    def exact(k: int, f: Any, g: Any, budgets: list[int], r: Any) -> bool:
        cap = max(c for c in range(4096) if f(1, c) <= budgets[1])
        c0 = max(c for c in range(4096) if g(c, c) <= budgets[0])
        return bool(r.best.batch_size == largest_batch(f, g, budgets, cap * (k - 1) + c0))
    return _identical_cards(n, L._alike_surface, exact)


def fine_staircases(n: int) -> dict[str, int]:
    from tests.search import test_search_levels as L
    from tests.support.level_oracle import fits_some_split

    def exact(k: int, f: Any, g: Any, budgets: list[int], r: Any) -> bool:
        # a batch that fits there leaves every smaller one fitting: the answer (measured
        # within budget) is exact when no split of one more sample fits (every split tried)
        return not fits_some_split(f, g, budgets, r.best.batch_size + 1)
    return _identical_cards(n, L._fine_surface, exact)


def _identical_cards(n: int, surface: Any, exact: Any) -> dict[str, int]:
    """The search on ``surface(seed)`` for ``n`` seeds, cards 1..k-1 named alike, 12 probes."""
    from dptune import search

    out = dict(cases=0, certified=0, exact=0, even_open=0, probes=0)
    for seed in range(n):
        k, f, g, probe, budgets = surface(seed)
        r = search.run(probe, budgets, "max_batch", 16 * k, max_probes=12,
                       known=search.Known(alike=[0] + [1] * (k - 1)))
        _count(out, r, exact(k, f, g, budgets, r))
    return out


def mixed_clusters(n: int) -> dict[str, int]:
    from dptune import search
    from dptune.errors import NoFeasibleSplitError
    from tests.search import test_search_ties as T
    from tests.search.test_search import CurveBackend, best_batch, budgets

    out = dict(cases=0, certified=0, exact=0, even_open=0, probes=0)
    for seed in range(n):
        shape, batch = T.random_cluster(seed)
        be = CurveBackend(shape)
        try:
            r = search.run(be.probe, budgets(shape), "max_batch", batch,
                           min_chunk=2 if shape.bn else 1, max_probes=12,
                           known=search.Known(alike=list(shape.totals)))
        except NoFeasibleSplitError:
            continue
        _count(out, r, r.best.batch_size == best_batch(shape))
    return out


def staircases(n: int) -> dict[str, int]:
    from dptune.errors import NoFeasibleSplitError
    from tests.search import test_search as S

    out = dict(cases=0, certified=0, exact=0, even_open=0, probes=0)
    for seed in range(n):
        for real in (False, True):
            shape = S.staircase(seed)
            try:
                r, _ = S.run(shape, "max_batch", 64, real=real, max_probes=16)
            except NoFeasibleSplitError:
                continue
            _count(out, r, r.best.batch_size == S.best_batch(shape))
    return out


def _count(out: dict[str, int], r: Any, exact: bool) -> None:
    out["cases"] += 1
    out["certified"] += int(r.certified)
    out["exact"] += int(exact)
    out["even_open"] += int(r.even_open)
    out["probes"] += len(r.probes)


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--n", type=int, default=40, help="seeds per family")
    p.add_argument("--without-flat-step", action="store_true",
                   help="switch off the even baseline's flat-step rule (the 'before' of a pair)")
    args = p.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    if args.without_flat_step:
        from dptune.search.even_baseline import EvenBaseline
        EvenBaseline._crept = lambda self, lo: False      # type: ignore[method-assign]
    for name, family in (("alike staircases", alike_staircases),
                         ("fine staircases (4 x 24 GB, 20 MiB steps)", fine_staircases),
                         ("mixed clusters", mixed_clusters),
                         ("staircases (simulator, real)", staircases)):
        c = family(args.n)
        print(f"{name}: {c['cases']} cases, certified {c['certified']}, exact {c['exact']}, "
              f"even open {c['even_open']}, probes {c['probes']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
