"""Model surfaces at a budget level, for the certificate benchmark and the reserved-level oracle.

At the default level (``reserved``) a card's figure is the caching allocator's reserved peak
plus the fixed costs (NCCL's buffers): a staircase of the allocated trace, replayed at the
card's own capacity. The figures come straight from the simulated backend on the cluster of
the case (``SimulatedBackend(..., reserved=ReservedModel())`` and
:func:`dptune.backends.simulated.reserved.at_level`), never from the search:

- card ``i >= 1`` at chunk ``c``: one probe with every card ``i >= 1`` at ``c`` (card ``i``'s
  figure depends on its own chunk only, as at the allocated level: its trace is its replica's
  step on its chunk; the replay runs at its own capacity);
- card 0 at chunk ``c0`` of a batch ``B``: one probe with the rest spread evenly.

Each figure is cached, so the exhaustive answers (:func:`benchmarks.certificate_answer.answer`: caps by
bisection on the monotone surface, checked by a scan of the samples around each cap, see
:func:`check_monotone_near`) and dptune's search share the probes. The allocated peaks ride
along in each probe (``allocated_peak_bytes``), as they do in dptune's probes at the level.
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Sequence

from dptune.backends.base import ProbeResult
from dptune.split import even_split

from benchmarks.certificate_surface import MiB, Surface, _valid

__all__ = ["LevelCurves", "level_surface", "LEVEL_MODELS", "check_monotone_near"]


class LevelCurves:
    """Per-card figures at ``level`` on one simulated cluster, measured on demand and cached."""

    def __init__(self, workload: Any, spec: str, headroom: int, level: str, m: int):
        from dptune.backends.simulated.reserved import ReservedModel
        from dptune.budget import BudgetLevel
        from dptune.backends.simulated import SimulatedBackend, parse_cluster

        self.level = BudgetLevel(level)
        reserved = ReservedModel() if self.level is BudgetLevel.RESERVED else None
        self.backend = SimulatedBackend(workload, parse_cluster(spec), reserved=reserved)
        self.devices = self.backend.devices
        self.n = len(self.devices)
        self.m = m
        self.budgets = [d.budget_bytes(headroom) for d in self.devices]
        self.probes = 0
        self._f: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._g: dict[tuple[int, int], tuple[int, int]] = {}

    def _probe(self, split: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(figures at the level, allocated peaks) of one simulated step."""
        from dptune.budget import at_level

        r = at_level(self.backend.probe(list(split)), self.devices, self.level)
        self.probes += 1
        alloc = r.allocated_peak_bytes or r.peak_bytes
        return tuple(r.peak_bytes), tuple(alloc)

    def _card(self, c: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if c not in self._f:
            self._f[c] = self._probe([self.m] + [c] * (self.n - 1))
        return self._f[c]

    def f(self, i: int, c: int) -> int:
        return self._card(c)[0][i] if c else 0

    def fa(self, i: int, c: int) -> int:
        return self._card(c)[1][i] if c else 0

    def _card0(self, c0: int, b: int) -> tuple[int, int]:
        key = (c0, b)
        if key not in self._g:
            run = b
            while True:
                rest = list(even_split(run - c0, self.n - 1))
                split = [c0] + rest
                if not _valid(split, self.m):       # BatchNorm: a rest of 1 goes to one card
                    rest = [run - c0] + [0] * (self.n - 2)
                    split = [c0] + rest
                if _valid(split, self.m):
                    break
                # no batch at all, or a rest below BatchNorm's minimum: taken at the next
                # batch, as benchmarks.certificate_cases does (the certificate's minimum asks
                # for such points; the search never probes them)
                run += 1
            peaks, alloc = self._probe(split)
            self._g[key] = (peaks[0], alloc[0])
        return self._g[key]

    def g(self, c0: int, b: int) -> int:
        return self._card0(c0, b)[0]

    def ga(self, c0: int, b: int) -> int:
        return self._card0(c0, b)[1]


class LevelSurface(Surface):
    """A :class:`Surface` whose probes also carry the allocated peaks."""

    curves: Optional[LevelCurves] = None

    def probe(self, split: Sequence[int]) -> ProbeResult:
        s = tuple(int(c) for c in split)
        cv = self.curves
        assert cv is not None
        b = sum(s)
        alloc = (cv.ga(s[0], b), *(cv.fa(i, c) for i, c in enumerate(s) if i))
        return ProbeResult(s, tuple(self.peaks(s)), allocated_peak_bytes=alloc)


#: The audited cases of issue 35 and small models, at the default level: (model class,
#: keyword arguments, optimizer, cluster, start batch per card).
LEVEL_MODELS = {
    "causal-lm": ("TinyGPT", dict(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32),
                  "adamw", "2x2GB", 8),
    "causal-lm/3": ("TinyGPT", dict(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32),
                    "adamw", "3x2GB", 8),
    "bn-cnn": ("SmallResNet", dict(widths=(8, 16), blocks=1, num_classes=10, image_size=32),
               "adamw", "2x2GB", 8),
    "mlp-tiny-output": ("MLP", dict(in_features=512, hidden=2048, depth=2, num_classes=2), "adamw",
                        "2x2GB", 8),
    # long sequences, a large vocabulary: tens of samples per card, small enough for the
    # exhaustive oracle (every chunk of every card, every split: ``--oracle``)
    "causal-lm/long": ("TinyGPT", dict(vocab_size=16000, d_model=128, n_layers=1, n_heads=2,
                                       seq_len=512), "adamw", "2x2GB", 4),
    "mlp-wide/sgd": ("MLP", dict(in_features=4096, hidden=8192, depth=6), "sgd", "4x24GB", 4096),
    "mlp-wide/sgd/used": ("MLP", dict(in_features=4096, hidden=8192, depth=6), "sgd",
                          "4x24GB,used=0:6GB", 4096),
}
HEADROOM = 64 * MiB


def level_surface(name: str, level: str = "reserved") -> LevelSurface:
    import torch

    from dptune.examples import models
    from dptune.step.workload import Workload, has_batchnorm

    cls, kw, opt, spec, per_card = LEVEL_MODELS[name]
    model = getattr(models, cls)(**kw)

    def optimizer(p: Any) -> Any:
        if opt == "sgd":
            return torch.optim.SGD(p, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(p, lr=1e-4)
    wl = Workload(model, model.sample, None, optimizer)
    m = 2 if has_batchnorm(model) else 1
    cv = LevelCurves(wl, spec, HEADROOM, level, m)

    def g(c0: int, b: int) -> int:
        return cv.g(c0, b)
    s = LevelSurface(f"{name} {spec} @{level}", f"models@{level}", cv.budgets,
                     f=cv.f, g=g, m=m, hint=per_card * cv.n)
    s.curves = cv
    return s


def check_monotone_near(s: Surface, i: int, cap: int, width: int = 8) -> bool:
    """The exhaustive answers bisect on a monotone surface: the samples around card ``i``'s cap
    (``cap - width`` to ``cap + width``) are scanned, every one up to the cap within budget and
    every one above it over (no fit again above a failure near the cap)."""
    lo = max(s.m, cap - width)
    return all((s.f(i, c) <= s.budgets[i]) == (c <= cap) for c in range(lo, cap + width + 1))


def line_monotone_near(s: Surface, caps_: Sequence[int], best: int, width: int = 8) -> bool:
    """Card 0 along the line (the others at their caps, card 0 at the fewest samples left):
    every batch from ``best - width`` to ``best`` within budget, every one above over."""
    from benchmarks.certificate_answer import card0_chunk, reachable

    reach = reachable(caps_, s.m)
    for b in range(max(1, best - width), best + width + 1):
        c0 = card0_chunk(b, caps_, s.m, reach)
        fits = c0 is not None and s.g(c0, b) <= s.budgets[0]
        if fits != (b <= best):
            return False
    return True


#: Cases small enough for the exhaustive oracle (``--oracle``): tens of samples.
ORACLE_CASES = ("causal-lm/long",)


def oracle_answer(s: Surface, upto: int) -> int:
    """The largest batch up to ``upto`` that some split fits, every chunk of every card and
    every split tried (``tests/support/level_oracle.py``: no monotone surface assumed;
    imported from the tests, where it is the reserved-level search's oracle)."""
    from tests.support.level_oracle import largest_batch

    return largest_batch(s.f, s.g, s.budgets, upto, s.m)


def known_of(s: Surface) -> Any:
    """What :class:`dptune.tuner.Tuner` tells the search of these cards
    (``dptune.search.Known``): the identical cards (:func:`dptune.search.alike.device_keys`)
    and, on simulated cards at the reserved level, the look past the over points and the even
    line on the allocator model; nothing of a synthetic surface."""
    from dptune import search as dsearch
    from dptune.backends.simulated.look import even_line_of, look_past_of
    from dptune.search.alike import device_keys

    if not (isinstance(s, LevelSurface) and s.curves):
        return dsearch.Known()
    cv = s.curves
    return dsearch.Known(alike=device_keys(cv.devices),
                         look_past=look_past_of(cv.backend, s.budgets, cv.level),
                         even_line=even_line_of(cv.backend, s.budgets, cv.level))


def beyond(s: Surface, best: int, split: Sequence[int]) -> bool:
    """dptune's split measured within budget at a batch above the bisection's ``best``: the
    reference is wrong there (the surface is not monotone), not the answer."""
    return sum(split) > best and not any(s.over(split))


def measure_level(name: str, level: str, max_probes: int = 12, oracle: int = 0) -> dict[str, Any]:
    """dptune's largest batch on one model case at ``level`` against the exhaustive answer;
    ``monotone``: the scans around every cap and along card 0's line agree with the
    bisection (where they do not, the surface is not monotone there and no probe-local
    certificate proves a largest batch). ``oracle`` > 0: also the exhaustive oracle's largest
    batch up to ``B* + oracle`` (every split of every batch in that range tried)."""
    import time

    from benchmarks.certificate_answer import answer
    from dptune import search as dsearch

    t0 = time.perf_counter()
    s = level_surface(name, level)
    ans = answer(s)
    out = dsearch.run(s.probe, s.budgets, "max_batch", s.hint, min_chunk=s.m,
                      max_probes=max_probes, exact_on_oom=True, known=known_of(s))
    even = out.even.batch_size if out.even is not None else 0
    monotone = all(check_monotone_near(s, i, c) for i, c in enumerate(ans.caps, start=1)) \
        and line_monotone_near(s, ans.caps, ans.best)
    upto = ans.best + oracle if oracle else 0
    split = tuple(out.best.chunk_sizes)
    return dict(case=s.name, level=level, best=ans.best, even=ans.even,
                oracle=oracle_answer(s, upto) if oracle else None, oracle_upto=upto,
                dptune=out.best.batch_size, dptune_even=even, certified=out.certified,
                split=list(split), split_fits=not any(s.over(split)),
                even_open=out.even_open, probes=len(out.probes),
                best_exact=out.best.batch_size == ans.best, even_exact=even == ans.even,
                # a larger batch measured within budget disproves the bisection's B* (the
                # surface is not monotone there): the reference is wrong, not the answer
                beyond=beyond(s, ans.best, split),
                exact=out.best.batch_size == ans.best and even == ans.even,
                monotone=monotone, notes=list(out.notes),
                looked=None if out.window is None else out.window.describe(),
                looked_closed=out.window is not None and out.window.closed,
                sim_probes=s.curves.probes if isinstance(s, LevelSurface) and s.curves else 0,
                seconds=time.perf_counter() - t0)


def level_table(rows: Sequence[dict[str, Any]]) -> str:
    head = ("| case | level | B* | E | dptune (its split within budget) | even | probes | certified "
            "| largest exact | even exact | monotone near B* | looked past the over points | exhaustive oracle |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['case']} | {r['level']} | {r['best']} | {r['even']} | {r['dptune']} "
            f"({'yes' if r['split_fits'] else 'NO'}) | "
            f"{r['dptune_even']}{' (open)' if r['even_open'] else ''} | {r['probes']} | "
            f"{'yes' if r['certified'] else 'no'} | "
            f"{'yes' if r['best_exact'] else 'above B*, which its split disproves' if r.get('beyond') else 'WRONG'} | "
            f"{'yes' if r['even_exact'] else 'WRONG'} | "
            f"{'yes' if r['monotone'] else 'NO'} | "
            f"{'-' if r.get('looked') is None else 'over throughout' if r.get('looked_closed') else r['looked']} | "
            f"{'-' if r.get('oracle') is None else str(r['oracle']) + ' (batches to ' + str(r['oracle_upto']) + ')'} |"
            for r in rows]
    return "\n".join([head] + body)


def main(argv: Optional[Sequence[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m benchmarks.certificate_levels", description=__doc__)
    ap.add_argument("--levels", default="reserved,allocated", help="comma-separated levels")
    ap.add_argument("--oracle", type=int, default=0, metavar="N",
                    help=f"on {', '.join(ORACLE_CASES)}: the exhaustive oracle up to B* + N "
                         "(every split of every batch; a simulated step per chunk and split)")
    ap.add_argument("cases", nargs="*", help=f"cases (default: all of {', '.join(LEVEL_MODELS)})")
    args = ap.parse_args(argv)
    rows = []
    for c in args.cases or list(LEVEL_MODELS):
        for lv in args.levels.split(","):
            rows.append(measure_level(c, lv, oracle=args.oracle if c in ORACLE_CASES else 0))
            r = rows[-1]
            print(f"{r['case']}: {r['seconds']:.0f} s, {r['sim_probes']} simulated steps",
                  file=sys.stderr)
    print(level_table(rows))
    for r in rows:
        if not (r["certified"] and r["exact"]):
            print(f"\n{r['case']}: dptune's split {r['split']}")
            print("\n".join(f"  note: {n}" for n in r["notes"]))
    return 0 if all((r["exact"] or r.get("beyond") and r["even_exact"]) and r["certified"]
                    and r.get("oracle") in (None, r["best"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
