"""The benchmark driver: ``python -m benchmarks [--quick] [--models ...] [--scenarios ...]``.

For each model x scenario (see :mod:`benchmarks.config`), on the simulated cluster with the
headroom :data:`benchmarks.config.HEADROOM`:

1. Lightning-style power-then-binary search for the largest even batch ``E``, from 2 samples
   per card (real probes of the scenario's backend; its result is the even split's largest
   batch, since a larger even batch never takes less memory on any card);
2. dptune ``balance`` at batch ``E`` and dptune ``max_batch`` (from a batch a user would
   start from), each ``--repeats`` times for a median wall time;
3. the ``gpu0_bsz`` grid at batch ``E`` (probes it needs, and its best point);
4. the exact optimum (largest batch; balanced split of ``E``) from :mod:`benchmarks.search`,
   and dptune's distance to it; the optimal largest-batch split is checked with a real probe.

Then the scale figures (:mod:`benchmarks.scale`) and the per-step overhead of
``BalancedDataParallel`` (:mod:`benchmarks.overhead`). Writes ``results.csv``, ``results.md``,
``scale.csv``, ``scale.md`` and ``summary.png`` under ``--out`` (default
``reports/benchmarks``) and prints the headline table in Markdown. Probe counts and memory
figures are machine-independent; wall times are medians, compared only within one run.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dptune.backends.simulated import SimulatedBackend, parse_cluster
from dptune.split import even_split
from dptune.units import GiB, parse_bytes
from dptune.step.workload import Workload, has_batchnorm

from benchmarks import config, search
from benchmarks.output import write_csv

__all__ = ["Row", "run_case", "main", "headline_table", "results_table", "write_outputs"]


@dataclass
class Row:
    """The figures of one model x scenario (bytes as int, shares as fractions of budget)."""

    model: str
    scenario: str
    cards: int
    batchnorm: bool
    headroom_bytes: int
    budgets: list[int]
    # the even split (plain DataParallel)
    even_max_batch: int = 0
    even_split: list[int] = field(default_factory=list)
    even_peaks: list[int] = field(default_factory=list)
    even_imbalance: float = math.nan
    even_max_share: float = math.nan
    # dptune balance at even_max_batch
    bal_split: list[int] = field(default_factory=list)
    bal_peaks: list[int] = field(default_factory=list)
    bal_imbalance: float = math.nan
    bal_max_share: float = math.nan
    bal_probes: int = 0
    bal_seconds: float = math.nan
    bal_error: str = ""
    # dptune max_batch
    max_hint: int = 0
    max_batch: int = 0
    max_split: list[int] = field(default_factory=list)
    max_peaks: list[int] = field(default_factory=list)
    max_imbalance: float = math.nan
    max_probes: int = 0
    max_seconds: float = math.nan
    max_even_batch: int = 0            # the even split's largest batch as dptune reports it
    max_error: str = ""
    max_certified: bool = False
    bal_certified: bool = False
    # dptune max_batch with output_device="auto" (models with large gathered outputs only)
    auto_run: bool = False
    auto_output_device: int = 0
    auto_max_batch: int = 0
    auto_card0_batch: int = 0          # the same search's answer gathering on card 0
    auto_probes: int = 0               # both searches (card 0, then the candidate card)
    auto_certified: bool = False
    auto_error: str = ""
    amp: str = ""
    # baselines
    grid_points: int = 0
    grid_gpu0_bsz: Optional[int] = None
    grid_split: Optional[list[int]] = None
    grid_max_share: float = math.nan
    lightning_batch: int = 0
    lightning_probes: int = 0
    lightning_seconds: float = math.nan
    # exact optimum
    opt_max_batch: int = 0
    opt_max_split: list[int] = field(default_factory=list)
    opt_max_verified: bool = False
    opt_bal_split: list[int] = field(default_factory=list)
    opt_bal_max_share: float = math.nan
    bal_distance: Optional[int] = None   # samples per card from dptune's split to an optimal one
    even_max_exact: int = 0              # the even split's largest batch from the curves
    curve_probes: int = 0                # probes the exhaustive search added (2-card)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    # ---- derived ---------------------------------------------------------------------
    @property
    def gain(self) -> float:
        """dptune's largest batch over the even split's, minus 1."""
        return self.max_batch / self.even_max_batch - 1 if self.even_max_batch else math.nan

    @property
    def opt_gain(self) -> float:
        return self.opt_max_batch / self.even_max_batch - 1 if self.even_max_batch else math.nan

    @property
    def max_gap(self) -> int:
        """Samples between the optimum's largest batch and dptune's."""
        return self.opt_max_batch - self.max_batch

    @property
    def bal_share_gap(self) -> float:
        """dptune's largest share minus the optimum's (fraction of budget)."""
        return self.bal_max_share - self.opt_bal_max_share

    @property
    def time_ratio(self) -> float:
        """dptune max_batch's wall time over the Lightning search's (same run)."""
        return self.max_seconds / self.lightning_seconds if self.lightning_seconds else math.nan

    def to_csv(self) -> dict[str, Any]:
        def gib(xs: Optional[Sequence[int]]) -> str:
            return "" if not xs else " ".join(f"{x / GiB:.3f}" for x in xs)

        def ints(xs: Optional[Sequence[int]]) -> str:
            return "" if not xs else " ".join(str(x) for x in xs)

        return {
            "model": self.model, "scenario": self.scenario, "cards": self.cards,
            "batchnorm": self.batchnorm, "headroom_gib": self.headroom_bytes / GiB,
            "budget_gib": gib(self.budgets),
            "even_max_batch": self.even_max_batch, "even_split": ints(self.even_split),
            "even_peak_gib": gib(self.even_peaks), "even_imbalance": _r(self.even_imbalance),
            "even_max_share": _r(self.even_max_share),
            "balance_batch": self.even_max_batch, "balance_split": ints(self.bal_split),
            "balance_peak_gib": gib(self.bal_peaks), "balance_imbalance": _r(self.bal_imbalance),
            "balance_max_share": _r(self.bal_max_share), "balance_probes": self.bal_probes,
            "balance_seconds": _r(self.bal_seconds), "balance_error": self.bal_error,
            "opt_balance_split": ints(self.opt_bal_split),
            "opt_balance_max_share": _r(self.opt_bal_max_share),
            "balance_distance_samples": self.bal_distance,
            "balance_share_gap_pp": _r(100 * self.bal_share_gap),
            "max_batch_hint": self.max_hint, "max_batch": self.max_batch,
            "max_batch_split": ints(self.max_split), "max_batch_peak_gib": gib(self.max_peaks),
            "max_batch_imbalance": _r(self.max_imbalance), "max_batch_probes": self.max_probes,
            "max_batch_seconds": _r(self.max_seconds), "max_batch_error": self.max_error,
            "dptune_even_max_batch": self.max_even_batch, "gain_pct": _r(100 * self.gain),
            "opt_max_batch": self.opt_max_batch, "opt_max_split": ints(self.opt_max_split),
            "opt_max_verified": self.opt_max_verified, "opt_gain_pct": _r(100 * self.opt_gain),
            "max_batch_gap_samples": self.max_gap,
            "grid_points": self.grid_points, "grid_gpu0_bsz": self.grid_gpu0_bsz,
            "grid_split": ints(self.grid_split), "grid_max_share": _r(self.grid_max_share),
            "lightning_batch": self.lightning_batch, "lightning_probes": self.lightning_probes,
            "lightning_seconds": _r(self.lightning_seconds),
            "time_ratio_max_batch_vs_lightning": _r(self.time_ratio),
            "even_max_exact": self.even_max_exact, "curve_probes": self.curve_probes,
            "seconds": _r(self.seconds), "notes": " | ".join(self.notes),
            "max_batch_certified": self.max_certified, "balance_certified": self.bal_certified,
            "amp": self.amp,
            "auto_run": self.auto_run, "auto_output_device": self.auto_output_device,
            "auto_max_batch": self.auto_max_batch, "auto_card0_batch": self.auto_card0_batch,
            "auto_probes": self.auto_probes, "auto_certified": self.auto_certified,
            "auto_error": self.auto_error,
        }


def _r(x: Optional[float], nd: int = 4) -> Any:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else round(x, nd)


def _tune(model: Any, sample: Any, backend: SimulatedBackend, batch_size: int, objective: str,
          repeats: int, headroom: str, amp: Optional[str] = None,
          output_device: Any = 0) -> tuple[Any, float]:
    """Run dptune's Tuner ``repeats`` times on a prebuilt backend; the result and the median time."""
    from dptune.tuner import Tuner

    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "no CUDA device: the split is not used" on a laptop
            result = Tuner(model, sample, batch_size=batch_size, optimizer=config.optimizer,
                           objective=objective, headroom=headroom, verbose=False,
                           backend=backend, amp=amp, output_device=output_device,
                           budget_level="allocated").fit()   # the oracle's peaks are allocated
        times.append(time.perf_counter() - t0)
    return result, statistics.median(times)


def run_case(spec: config.ModelSpec, scenario: str, curves: search.Curves, model: Any,
             sample: Any, repeats: int = 3, log: Any = None, headroom: str = config.HEADROOM
             ) -> Row:
    """All the figures of one model on one simulated cluster (``headroom`` per card)."""
    t_start = time.perf_counter()
    probes_before = curves.probes
    cluster = parse_cluster(scenario)
    curves.check_cluster(cluster)
    n, m = len(cluster), curves.min_chunk
    budgets = [d.budget_bytes(parse_bytes(headroom)) for d in cluster.devices]
    row = Row(model=spec.name, scenario=scenario, cards=n, batchnorm=m > 1,
              headroom_bytes=parse_bytes(headroom), budgets=budgets, amp=spec.amp or "")
    backend = SimulatedBackend(Workload(model, sample, None, config.optimizer, amp=spec.amp), cluster)

    def say(msg: str) -> None:
        if log is not None:
            print(f"  [{spec.name} @ {scenario}] {msg}", file=log, flush=True)

    # 1. Lightning-style search on the real (simulated) cards: the even split's largest batch
    last_ok: dict[int, Any] = {}

    def even_fits(b: int) -> bool:
        split = even_split(b, n)
        if not search.split_valid(split, m):
            return False          # DataParallel would raise (BatchNorm with 1 sample), not fit
        r = backend.probe(split)
        ok = r.feasible and all(p <= bud for p, bud in zip(r.peak_bytes, budgets))
        if ok:
            last_ok[b] = r
        return ok

    t0 = time.perf_counter()
    E, trials = search.power_then_binary(even_fits, init=2 * n)
    row.lightning_seconds = time.perf_counter() - t0
    row.lightning_batch, row.lightning_probes = E, len(trials)
    row.even_max_batch = E
    say(f"even split: largest batch {E} ({len(trials)} probes, Lightning-style)")
    if E == 0:
        row.notes.append("not even the smallest even batch fits")
        return row
    ev = last_ok[E]
    row.even_split, row.even_peaks = list(ev.chunk_sizes), list(ev.peak_bytes)
    row.even_imbalance = search.imbalance_of(ev.peak_bytes, budgets, ev.chunk_sizes)
    row.even_max_share = search.max_share(ev.peak_bytes, budgets)

    # 2. dptune
    try:
        res, row.bal_seconds = _tune(model, sample, backend, E, "balance", repeats, headroom, spec.amp)
        row.bal_certified = res.certified
        row.bal_split, row.bal_peaks = list(res.chunk_sizes), list(res.peak_bytes)
        row.bal_imbalance = res.imbalance
        row.bal_max_share = search.max_share(res.peak_bytes, budgets)
        row.bal_probes = res.num_probes
        say(f"dptune balance at {E}: {row.bal_split} ({row.bal_probes} probes)")
    except Exception as e:  # report, don't stop the benchmark
        row.bal_error = f"{type(e).__name__}: {e}"
        say(f"dptune balance failed: {row.bal_error}")
    row.max_hint = spec.hint_per_card * n
    try:
        res, row.max_seconds = _tune(model, sample, backend, row.max_hint, "max_batch", repeats,
                                     headroom, spec.amp)
        row.max_certified = res.certified
        row.max_batch, row.max_split = res.batch_size, list(res.chunk_sizes)
        row.max_peaks, row.max_imbalance = list(res.peak_bytes), res.imbalance
        row.max_probes, row.max_even_batch = res.num_probes, res.even.batch_size
        say(f"dptune max_batch: {row.max_batch} as {row.max_split} ({row.max_probes} probes)")
    except Exception as e:
        row.max_error = f"{type(e).__name__}: {e}"
        say(f"dptune max_batch failed: {row.max_error}")

    if spec.output_auto:
        row.auto_run = True
        try:
            res, _ = _tune(model, sample, backend, row.max_hint, "max_batch", 1, headroom,
                           spec.amp, output_device="auto")
            row.auto_output_device, row.auto_max_batch = res.output_device, res.batch_size
            row.auto_card0_batch = (res.card0_output_batch_size
                                    if res.card0_output_batch_size is not None else res.batch_size)
            row.auto_probes, row.auto_certified = res.num_probes, res.certified
            say(f"dptune max_batch, output_device auto: card {row.auto_output_device}, "
                f"{row.auto_max_batch} against {row.auto_card0_batch} on card 0 "
                f"({row.auto_probes} probes)")
        except Exception as e:
            row.auto_error = f"{type(e).__name__}: {e}"
            say(f"dptune max_batch with output_device auto failed: {row.auto_error}")

    # 3. the gpu0_bsz grid at E (its answer from the curves; the probes a user would run)
    grid = search.grid_gpu0_bsz(curves.peaks, budgets, E, m, full=False)
    row.grid_points, row.grid_gpu0_bsz = grid.points, grid.gpu0_bsz
    row.grid_split, row.grid_max_share = grid.chunk_sizes, grid.max_share

    # 4. the exact optimum
    B_opt, split_opt = search.max_batch_optimum(
        curves, budgets, guess=row.max_batch or E, guess_split=row.max_split or None)
    row.opt_max_batch, row.opt_max_split = B_opt, split_opt
    r = backend.probe(split_opt)   # the optimum, checked on the n-card backend
    row.opt_max_verified = r.feasible and all(p <= b for p, b in zip(r.peak_bytes, budgets))
    seed = row.bal_split if row.bal_split and sum(row.bal_split) == E else row.even_split
    opt = search.balance_optimum(curves, budgets, E, seed)
    row.opt_bal_split, row.opt_bal_max_share = opt.chunk_sizes, opt.max_share
    if row.bal_split:
        row.bal_distance = search.linf_distance(row.bal_split, opt.caps, E)
    # the Lightning-style search against the curves: E fits, E + 1 does not
    row.even_max_exact = E if (curves.fits(even_split(E, n), budgets)
                               and not curves.fits(even_split(E + 1, n), budgets)) else \
        search.largest_true(lambda b: curves.fits(even_split(b, n), budgets), 0, E)
    if row.even_max_exact != E:
        row.notes.append(f"the Lightning-style search found {E}, the curves say {row.even_max_exact}")
    row.curve_probes = curves.probes - probes_before
    row.seconds = time.perf_counter() - t_start
    say(f"optimum: largest batch {B_opt} as {split_opt}; balanced split of {E}: "
        f"{opt.chunk_sizes} (dptune {row.bal_distance} sample(s) per card away) [{row.seconds:.0f} s]")
    return row


# ---- rendering -----------------------------------------------------------------------------

def _md(rows: list[list[str]], header: list[str]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.0f}%"


def _f(x: Optional[float], fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))) else fmt.format(x)


def headline_table(rows: list[Row]) -> str:
    """The README table: largest batch, imbalance, probes, certified, distance to the optimum."""
    return headline_from_csv([r.to_csv() for r in rows])


def headline_from_csv(rows: list[dict[str, Any]]) -> str:
    """The headline table from ``results.csv`` rows (so the README is generated from the output)."""
    def num(r: dict[str, Any], k: str) -> float:
        v = r.get(k, "")
        return math.nan if v in ("", None) else float(v)

    def yes(r: dict[str, Any], k: str) -> str:
        return "yes" if str(r.get(k, "")).lower() == "true" else "no"

    header = ["model", "cluster", "largest batch: even / dptune / optimum", "gain",
              "imbalance at even max: even → dptune",
              "probes: dptune balance, max_batch / Lightning / gpu0_bsz grid",
              "certified: balance, max_batch",
              "dptune off optimum: balanced split (samples/card; \"even kept\": the even "
              "split within the tolerance of the balanced one, kept), largest batch (samples)",
              "output_device auto: card, largest batch (gain vs gathering on card 0), probes"]
    out = []
    for r in rows:
        even, best, opt = int(num(r, "even_max_batch")), num(r, "max_batch"), int(num(r, "opt_max_batch"))
        gain = best / even - 1 if even and not math.isnan(best) else math.nan
        dist = r.get("balance_distance_samples", "")
        if dist not in ("", None, "0") and r.get("balance_split") == r.get("even_split"):
            dist = f"{dist} (even kept)"    # within the tolerance of the balanced split
        out.append([
            str(r["model"]), str(r["scenario"]).replace(",", ", "),
            f"{even} / {int(best) if best else 'n/a'} / {opt}", _pct(gain),
            f"{_f(num(r, 'even_imbalance'))} → {_f(num(r, 'balance_imbalance'))}",
            f"{r['balance_probes']}, {r['max_batch_probes']} / {r['lightning_probes']} / "
            f"{r['grid_points']}",
            f"{yes(r, 'balance_certified')}, {yes(r, 'max_batch_certified')}",
            f"{dist if dist not in ('', None) else 'n/a'}, {r['max_batch_gap_samples']}",
            _auto_cell(r)])
    return _md(out, header)


def _auto_cell(r: dict[str, Any]) -> str:
    """The output_device="auto" figures of a results.csv row ("not run" for most models)."""
    if str(r.get("auto_run", "")).lower() != "true":
        return "not run"
    if r.get("auto_error"):
        return f"failed: {r['auto_error']}"
    batch, card0 = int(r["auto_max_batch"]), int(r["auto_card0_batch"])
    cert = "" if str(r.get("auto_certified", "")).lower() == "true" else ", not certified"
    return (f"card {r['auto_output_device']}, {batch} ({batch - card0:+d}, "
            f"{(batch / card0 - 1) if card0 else math.nan:+.0%}), {r['auto_probes']}{cert}")


def results_table(rows: list[Row]) -> str:
    """The full table of results.md."""
    header = ["model", "cluster", "even: largest batch, max share, imbalance",
              "dptune balance at that batch: split, max share, imbalance, probes, time",
              "optimal balanced split, max share (dptune's distance)",
              "dptune max_batch: batch, split, probes, time", "optimum: batch, split",
              "gpu0_bsz grid: points, best, max share", "Lightning: batch, probes, time",
              "time dptune max_batch / Lightning"]
    out = []
    for r in rows:
        out.append([
            r.model, r.scenario.replace(",", ", "),
            f"{r.even_max_batch}, {_f(r.even_max_share, '{:.1%}')}, {_f(r.even_imbalance)}",
            (f"{r.bal_split}, {_f(r.bal_max_share, '{:.1%}')}, {_f(r.bal_imbalance)}, "
             f"{r.bal_probes}, {_f(r.bal_seconds, '{:.1f} s')}") if not r.bal_error else r.bal_error,
            f"{r.opt_bal_split}, {_f(r.opt_bal_max_share, '{:.1%}')} ({_f(r.bal_distance, '{}')})",
            (f"{r.max_batch}, {r.max_split}, {r.max_probes}, {_f(r.max_seconds, '{:.1f} s')}")
            if not r.max_error else r.max_error,
            f"{r.opt_max_batch}, {r.opt_max_split}" + ("" if r.opt_max_verified else " (NOT verified)"),
            f"{r.grid_points}, {r.grid_gpu0_bsz if r.grid_gpu0_bsz is not None else 'none fits'}, "
            f"{_f(r.grid_max_share, '{:.1%}')}",
            f"{r.lightning_batch}, {r.lightning_probes}, {_f(r.lightning_seconds, '{:.1f} s')}",
            _f(r.time_ratio)])
    return _md(out, header)


def quality_summary(rows: list[Row]) -> str:
    """One paragraph: how far dptune is from the exact optimum over all rows."""
    ok = [r for r in rows if r.max_batch and r.bal_split]
    if not ok:
        return "No row with both dptune results."
    per_card = [r.max_gap / r.cards for r in ok]
    dists = [r.bal_distance for r in ok if r.bal_distance is not None]
    worse = [f"{r.model} @ {r.scenario} (largest batch {r.max_gap} short, "
             f"balanced split {r.bal_distance} per card)"
             for r in ok if r.max_gap > r.cards or (r.bal_distance or 0) > 1]
    text = (f"Over {len(ok)} model x cluster cases, dptune's largest batch is "
            f"{min(r.max_gap for r in ok)}..{max(r.max_gap for r in ok)} samples short of the "
            f"exact optimum (at most {max(per_card):.2f} per card), and its balanced split is "
            f"{min(dists)}..{max(dists)} sample(s) per card from an optimal split; its largest "
            f"share of budget is at most {max(100 * r.bal_share_gap for r in ok):.3f} points above "
            "the optimum's.")
    if worse:
        text += " More than one sample per card off: " + "; ".join(worse) + "."
    return text


def summary_figure(rows: list[Row]) -> Any:
    """Largest batch per cluster (even / dptune / optimum) per model, and probes per method.

    Drawn on a bare Figure at the size and resolution ``plot_summary`` writes
    (``SUMMARY_DPI``); tests/benchmarks/test_benchmarks_plot.py checks it has no overlapping text."""
    import textwrap

    from matplotlib.figure import Figure

    models = list(dict.fromkeys(r.model for r in rows))
    panels = len(models) + 1
    cols = min(3, panels)
    nrows = -(-panels // cols)
    fig = Figure(figsize=(5.2 * cols, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, cols, squeeze=False)
    colors = {"even split (DataParallel)": "#9e9e9e", "dptune max_batch": "#1f77b4",
              "exact optimum": "#2ca02c"}
    for ax, model in zip(axes.flat, models):
        rs = [r for r in rows if r.model == model]
        x = range(len(rs))
        w = 0.27
        vals = [[r.even_max_batch for r in rs], [r.max_batch for r in rs], [r.opt_max_batch for r in rs]]
        for k, (label, v) in enumerate(zip(colors, vals)):
            ax.bar([i + (k - 1) * w for i in x], v, w, label=label, color=colors[label])
        for i, r in enumerate(rs):
            top = max(r.even_max_batch, r.max_batch, r.opt_max_batch)
            ax.annotate(_pct(r.gain), (i, top), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(list(x))
        ax.set_xticklabels([r.scenario.replace(",", "\n") for r in rs], fontsize=8)
        ax.set_title(f"{model}: largest batch that fits", fontsize=10)
        ax.set_ylabel("samples")
        ax.set_ylim(0, max(max(v) for v in vals) * 1.15)
    axes.flat[0].legend(fontsize=8, loc="upper left")
    ax = axes.flat[len(models)]
    methods = [("dptune balance", lambda r: r.bal_probes), ("dptune max_batch", lambda r: r.max_probes),
               ("Lightning binsearch", lambda r: r.lightning_probes),
               ("gpu0_bsz grid", lambda r: r.grid_points)]
    w = 0.8 / len(methods)
    for k, (label, fn) in enumerate(methods):
        ys = [statistics.median(fn(r) for r in rows if r.model == mdl) for mdl in models]
        ax.bar([i + (k - 1.5) * w for i in range(len(models))], ys, w, label=label)
    ax.set_yscale("log")
    ax.set_xticks(range(len(models)))
    # one model per tick, wrapped to the width a tick has (names such as "GPT-2 small (seq
    # 1024, HF)" ran into their neighbours), every other one lower where they are many
    ax.set_xticklabels([textwrap.fill(m, 10) for m in models], fontsize=7)
    for k, label in enumerate(ax.get_xticklabels()):
        if len(models) > 4 and k % 2:
            label.set_y(label.get_position()[1] - 0.12)
    ax.set_title("probes (training steps) per search,\nmedian over clusters", fontsize=10)
    ax.legend(fontsize=8)
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    fig.suptitle(f"dptune on the simulated cluster (headroom {config.HEADROOM} per card)", fontsize=12)
    return fig


#: resolution of summary.png
SUMMARY_DPI = 110


def plot_summary(rows: list[Row], path: pathlib.Path) -> None:
    """Write :func:`summary_figure` to ``path`` (PNG)."""
    summary_figure(rows).savefig(path, dpi=SUMMARY_DPI)


def write_outputs(out: pathlib.Path, rows: list[Row], scale_rows: list[dict[str, Any]],
                  overhead: dict[str, Any], argv: Sequence[str], seconds: float) -> str:
    """Write results.csv/md, scale.csv/md and summary.png; return the headline Markdown."""
    from benchmarks import scale as scale_mod

    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "results.csv", [r.to_csv() for r in rows])
    headline = headline_table(rows)
    parts = [
        "# dptune benchmarks (simulated cluster)", "",
        f"Command: `{' '.join(['python -m benchmarks', *argv])}` "
        f"({seconds / 60:.1f} min on this machine). Headroom {config.HEADROOM} per card; "
        "optimizer AdamW; default loss (the sum of the outputs, or the model's own loss). "
        "'even' is plain DataParallel's split; its largest batch is found by a Lightning-style "
        "power-then-binary search with the same budgets; dptune's `balance` runs at that batch. "
        "Imbalance is max/min share of budget over the cards in use. Probe counts and memory "
        "are machine-independent; times are medians of the runs of this one command.", "",
        "## Headline", "", headline, "",
        "## Quality: distance to the exact optimum", "", quality_summary(rows), "",
        "The optimum is computed exactly from per-card curves measured on the simulator "
        "(card i>=1 depends only on its own chunk, card 0 on its chunk and the batch; see "
        "`benchmarks/search.py`); each optimal largest-batch split was also checked with a "
        "probe on the full cluster.", "",
        "## All figures", "", results_table(rows), "",
        "## Per-step overhead of BalancedDataParallel", "", overhead.get("text", ""), "",
        "## Scale", "", scale_mod.scale_table(scale_rows), "",
    ]
    (out / "results.md").write_text("\n".join(parts) + "\n", encoding="utf-8")
    if scale_rows:
        write_csv(out / "scale.csv", scale_rows)
        (out / "scale.md").write_text("# Scale figures\n\n" + scale_mod.scale_table(scale_rows) + "\n",
                                      encoding="utf-8")
    if rows:
        plot_summary(rows, out / "summary.png")
    return headline


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks",
                                description="dptune against the even split, the usual baselines and the exact "
                                            "optimum, on the simulated cluster; writes reports/benchmarks/")
    p.add_argument("--quick", action="store_true",
                   help=f"a subset: models {', '.join(config.QUICK_MODELS)} on "
                        f"{', '.join(config.QUICK_SCENARIOS)}; 1 timing run; no scale figures")
    p.add_argument("--models", nargs="+", choices=list(config.MODELS), help="models to run")
    p.add_argument("--scenarios", nargs="+", help="cluster specs, e.g. 4x24GB '2x80GB,2x40GB'")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of each dptune search (default 3, 1 with --quick)")
    p.add_argument("--no-scale", action="store_true", help="skip the full-size estimates")
    p.add_argument("--no-realistic", action="store_true",
                   help="skip the realistic configurations (GPT-2 small bf16, ViT-B)")
    p.add_argument("--out", default="reports/benchmarks", help="output folder")
    p.add_argument("--level", choices=["allocated", "reserved"], default="allocated",
                   help="budget level: allocated (default; the exhaustive optimum's level, "
                        "results.csv) or reserved (dptune's default level, with its default "
                        "headroom; no exhaustive optimum, a local check of each answer instead: "
                        "results-reserved.csv, see benchmarks/levels.py)")
    p.add_argument("--near", type=int, default=None,
                   help="with --level reserved: samples either side of each card's chunk the "
                        "local check probes (default 2)")
    return p.parse_args(argv)


def _main_level(args: argparse.Namespace, models: Sequence[str], scenarios: Sequence[str],
                t0: float) -> int:
    """``--level reserved``: :mod:`benchmarks.levels` (one run of each search, no scale figures)."""
    from benchmarks import levels

    realistic = not (args.quick or args.no_realistic or args.models)
    print(f"benchmarks at the {args.level} level: {len(models)} model(s) x {len(scenarios)} "
          f"cluster(s){' + the realistic configurations' if realistic else ''}", file=sys.stderr)
    rows = levels.run_grid(models, scenarios, realistic, args.level, pathlib.Path(args.out),
                           levels.NEAR if args.near is None else args.near)
    dicts = [r.to_csv() for r in rows]
    print(f"wrote {args.out}/results-{args.level}.md, results-{args.level}.csv "
          f"({(time.perf_counter() - t0) / 60:.1f} min)", file=sys.stderr)
    print(levels.level_table(dicts))
    print()
    print(levels.summary(dicts, levels.all_cases()))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    from benchmarks import overhead as overhead_mod
    from benchmarks import scale as scale_mod

    t0 = time.perf_counter()
    models = args.models or (list(config.QUICK_MODELS) if args.quick else list(config.MODELS))
    scenarios = args.scenarios or (list(config.QUICK_SCENARIOS) if args.quick else list(config.SCENARIOS))
    repeats = args.repeats or (1 if args.quick else 3)
    if args.level != "allocated":
        return _main_level(args, models, scenarios, t0)
    print(f"benchmarks: {len(models)} model(s) x {len(scenarios)} cluster(s), headroom "
          f"{config.HEADROOM}, {repeats} timed run(s) of each dptune search", file=sys.stderr)
    # first, while this process is small: the children's ru_maxrss starts from ours
    scale_rows = [] if (args.quick or args.no_scale) else scale_mod.measure_all(log=sys.stderr)
    rows: list[Row] = []
    for name in models:
        spec = config.MODELS[name]
        model, sample = spec.workload_args()
        curves = search.Curves(Workload(model, sample, None, config.optimizer),
                               2 if has_batchnorm(model) else 1)
        for sc in scenarios:
            rows.append(run_case(spec, sc, curves, model, sample, repeats, log=sys.stderr))
    if not (args.quick or args.no_realistic or args.models):
        for spec, sc in config.REALISTIC:   # one timed run each: a probe takes seconds
            model, sample = spec.workload_args()
            curves = search.Curves(Workload(model, sample, None, config.optimizer, amp=spec.amp),
                                   2 if has_batchnorm(model) else 1)
            rows.append(run_case(spec, sc, curves, model, sample, 1, log=sys.stderr))
    overhead = overhead_mod.measure()
    print(overhead["text"], file=sys.stderr)
    headline = write_outputs(pathlib.Path(args.out), rows, scale_rows, overhead, argv,
                             time.perf_counter() - t0)
    print(f"wrote {args.out}/results.md, results.csv, summary.png"
          + (", scale.md, scale.csv" if scale_rows else ""), file=sys.stderr)
    print(headline)
    print()
    print(quality_summary(rows))
    if scale_rows:
        print()
        print(scale_mod.scale_table(scale_rows))
    return 0
