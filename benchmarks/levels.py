"""The benchmark grid at a budget level with no exhaustive optimum: ``python -m benchmarks --level reserved``.

At the default level (``reserved``: the caching allocator's reserved peak replayed by the
simulator's allocator model, plus NCCL's fixed cost) every figure is an allocator replay, so
the grid's sizes have no exhaustive optimum. For each model x cluster of
:mod:`benchmarks.config` this runs dptune's ``max_batch`` (from the batch a user would start
from) and ``balance`` (at the even split's largest batch as dptune reports it) with the level's
default headroom, on ``SimulatedBackend(..., reserved=Budget.at(level).reserved)`` as
:class:`dptune.Tuner` builds it, and checks the largest batch's answer locally with direct
simulated probes at the level (:func:`local_check`, not dptune's search): the answer's split
fits; one more sample on each card whose bracket the search closed is over that card's budget
(the certificate's claim); and the samples near each card's chunk (``near`` either side) read
monotone (no fit above a measured over).

Writes ``results-<level>.csv`` and ``results-<level>.md`` under ``--out``;
``python -m benchmarks.readme --level reserved`` writes the table into docs/benchmarks.md.
"""

from __future__ import annotations

import pathlib
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from dptune.types import ProbeResult

from benchmarks import config

__all__ = ["LocalCheck", "local_check", "LevelRow", "run_level_case", "level_table",
           "all_cases", "run_grid", "NEAR"]

#: Samples either side of each card's chunk that the local check probes.
NEAR = 2

Probe = Callable[[Sequence[int]], ProbeResult]


def _over(r: ProbeResult, budgets: Sequence[int], i: int) -> Optional[bool]:
    """Card ``i`` over its budget in ``r``; ``None`` where another card ran out (card i's
    figure is then only a lower bound)."""
    if r.oom_device is not None:
        return True if r.oom_device == i else None
    return r.peak_bytes[i] > budgets[i]


def _fits(r: ProbeResult, budgets: Sequence[int]) -> bool:
    """Every card in use (card 0 always, the others with samples) within its budget."""
    return r.oom_device is None and all(
        p <= b for i, (p, b, c) in enumerate(zip(r.peak_bytes, budgets, r.chunk_sizes)) if i == 0 or c)


def _one_more(c: int, m: int) -> int:
    return m if c == 0 else c + 1


@dataclass(frozen=True)
class LocalCheck:
    """What direct probes at the level showed around an answer's split.

    ``fits``: the split within every budget; ``proven``: the cards whose bracket the search
    closed; ``over``: those of them measured over at one more sample; ``not_monotone``: one
    line per card where a chunk near the answer fits above a chunk measured over;
    ``larger``: the cards given one more sample where the whole split still fits (a batch
    one larger fits: the answer is not the largest)."""

    fits: bool
    proven: tuple[int, ...]
    over: tuple[int, ...]
    not_monotone: tuple[str, ...]
    probes: int
    larger: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return (self.fits and set(self.over) == set(self.proven) and not self.not_monotone
                and not self.larger)


def local_check(probe: Probe, budgets: Sequence[int], split: Sequence[int],
                proven: Sequence[int], m: int = 1, near: int = NEAR,
                claim_at: Optional[dict[int, int]] = None) -> LocalCheck:
    """Probe ``split``; ``split`` with one more sample on each card (one probe per card: the
    cards of ``proven`` must be over, card 0 included where its bracket is on the whole batch:
    along the line the others sit at their chunks and card 0 takes the sample; and no card's
    may fit as a whole; ``claim_at``: the chunk a proven card is claimed over at where that is
    not one more than the split's, its bracket's ``hi``); then the cards 1.. shifted together by ``-near..near`` samples (card
    i's figure depends on its own chunk only) and card 0 alone by the same; each card's fits
    in order of its chunk must not fit again above an over."""
    s = [int(c) for c in split]
    n = len(s)
    seen: dict[int, dict[int, Optional[bool]]] = {i: {} for i in range(n)}   # card -> d -> over
    count = 0

    def run(t: Sequence[int]) -> ProbeResult:
        nonlocal count
        count += 1
        return probe(list(t))

    base = run(s)
    fits = _fits(base, budgets)
    for i in range(n):
        seen[i][0] = _over(base, budgets, i) if (i == 0 or s[i]) else None
    over: list[int] = []
    larger: set[int] = set()
    for i in range(n):
        t = list(s)
        t[i] = _one_more(s[i], m)
        r = run(t)
        o = _over(r, budgets, i)
        seen[i][t[i] - s[i]] = o
        if _fits(r, budgets):
            larger.add(i)
        if i in proven and claim_at and claim_at.get(i, t[i]) != t[i]:
            # the bracket's ``hi`` lies above one more sample (the answer short of its cap)
            t[i] = claim_at[i]
            o = _over(run(t), budgets, i)
        if o and i in proven:
            over.append(i)
    for d in [d for d in range(-near, near + 1) if d]:
        # cards 1..: shifted together (those in use whose shifted chunk is valid)
        t = [c if (i == 0 or not c or c + d < m or d in seen[i]) else c + d
             for i, c in enumerate(s)]
        moved = [i for i in range(1, n) if t[i] != s[i]]
        if moved:
            r = run(t)
            for i in moved:
                seen[i][d] = _over(r, budgets, i)
        if d not in seen[0] and (s[0] + d == 0 or s[0] + d >= m):
            t = list(s)
            t[0] = s[0] + d
            seen[0][d] = _over(run(t), budgets, 0)
    flags = []
    for i in range(n):
        pts = sorted((d, o) for d, o in seen[i].items() if o is not None)
        first_over = next((d for d, o in pts if o), None)
        refit = next((d for d, o in pts if not o and first_over is not None and d > first_over), None)
        if refit is not None:
            flags.append(f"card {i}: over at {s[i] + first_over}, fits at {s[i] + refit}")
    return LocalCheck(fits, tuple(proven), tuple(over), tuple(flags), count, tuple(sorted(larger)))


@dataclass
class LevelRow:
    """The figures of one model x cluster at a budget level (bytes as int)."""

    model: str
    scenario: str
    level: str
    headroom_bytes: int
    cards: int = 0
    max_hint: int = 0
    max_batch: int = 0
    max_split: list[int] = field(default_factory=list)
    max_certified: bool = False
    max_probes: int = 0
    max_notes: str = ""              # the search's notes on certification, when not certified
    max_error: str = ""
    even_batch: int = 0              # the even split's largest batch as dptune reports it
    even_open: bool = False
    even_at_most: Optional[int] = None
    #: the largest batch with expandable_segments:True (the tuner's allocator_answer, where
    #: fragmentation showed), its certificate and probes; 0 where it did not run
    exp_batch: int = 0
    exp_certified: bool = False
    exp_probes: int = 0
    #: the look past a certified answer's over points on the allocator model
    #: (``TuneResult.looked_past``), in a few words (:func:`looked_words`); "" where none ran
    looked_past: str = ""
    bal_split: list[int] = field(default_factory=list)
    bal_certified: bool = False
    bal_probes: int = 0
    bal_notes: str = ""
    bal_error: str = ""
    check_run: bool = False
    check_fits: bool = False
    check_proven: list[int] = field(default_factory=list)
    check_over: list[int] = field(default_factory=list)
    check_not_monotone: str = ""
    check_larger: list[int] = field(default_factory=list)
    check_probes: int = 0
    seconds: float = 0.0

    def to_csv(self) -> dict[str, Any]:
        def ints(xs: Sequence[int]) -> str:
            return " ".join(str(x) for x in xs)

        return {"model": self.model, "scenario": self.scenario, "level": self.level,
                "headroom_bytes": self.headroom_bytes, "cards": self.cards,
                "max_batch_hint": self.max_hint, "max_batch": self.max_batch,
                "max_batch_split": ints(self.max_split), "max_batch_certified": self.max_certified,
                "max_batch_probes": self.max_probes, "max_batch_notes": self.max_notes,
                "max_batch_error": self.max_error, "dptune_even_max_batch": self.even_batch,
                "even_open": self.even_open,
                "even_at_most": "" if self.even_at_most is None else self.even_at_most,
                "expandable_max_batch": self.exp_batch or "",
                "expandable_certified": self.exp_certified if self.exp_batch else "",
                "expandable_probes": self.exp_probes or "",
                "looked_past": self.looked_past,
                "balance_split": ints(self.bal_split), "balance_certified": self.bal_certified,
                "balance_probes": self.bal_probes, "balance_notes": self.bal_notes,
                "balance_error": self.bal_error, "check_run": self.check_run,
                "check_fits": self.check_fits, "check_proven_cards": ints(self.check_proven),
                "check_over_cards": ints(self.check_over),
                "check_not_monotone": self.check_not_monotone,
                "check_larger_cards": ints(self.check_larger), "check_probes": self.check_probes,
                "seconds": round(self.seconds, 1)}


def looked_words(w: Any) -> str:
    """A :class:`~dptune.types.WindowCheck` in a few words: "over throughout (N chunks)", or
    the cards that fit again / were not looked at / looked at only so far."""
    if w is None:
        return ""
    if w.closed:
        return f"over throughout ({sum(c.end - c.start for c in w.cards)} chunks)"
    parts = [f"card {c.card} fits again at {c.fits}" for c in w.cards if c.fits is not None]
    parts += [f"card {c.card} not looked at" for c in w.cards if not c.scaled]
    parts += [f"card {c.card} looked at only so far" for c in w.cards
              if c.scaled and c.fits is None and c.end is None]
    return "; ".join(parts)


def _certificate_notes(notes: Sequence[str]) -> str:
    return " | ".join(n for n in notes if "certif" in n)


def run_level_case(spec: config.ModelSpec, scenario: str, level: str = "reserved",
                   near: int = NEAR, log: Any = None) -> LevelRow:
    """dptune's max_batch and balance on one case at ``level`` (its default headroom), and the
    local check of the largest batch's answer."""
    from dptune.backends.simulated import SimulatedBackend, parse_cluster
    from dptune.budget import at_level
    from dptune.settings import Budget
    from dptune.step.workload import Workload, has_batchnorm
    from dptune.tuner import Tuner

    t0 = time.perf_counter()
    budget = Budget.at(level)
    row = LevelRow(spec.name, scenario, budget.level.value, budget.headroom_bytes)
    model, sample = spec.workload_args()
    cluster = parse_cluster(scenario)
    backend = SimulatedBackend(Workload(model, sample, None, config.optimizer, amp=spec.amp),
                               cluster, reserved=budget.reserved)
    devices = list(backend.devices)
    budgets = [d.budget_bytes(budget.headroom_bytes) for d in devices]
    m = 2 if has_batchnorm(model) else 1
    row.cards = len(devices)

    def say(msg: str) -> None:
        if log is not None:
            print(f"  [{spec.name} @ {scenario}, {row.level}] {msg}", file=log, flush=True)

    def tune(batch: int, objective: str) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "no CUDA device: the split is not used" on a laptop
            return Tuner(model, sample, batch_size=batch, optimizer=config.optimizer,
                         objective=objective, budget=budget, verbose=False, backend=backend,
                         amp=spec.amp).fit()

    row.max_hint = spec.hint_per_card * row.cards
    try:
        res = tune(row.max_hint, "max_batch")
        row.max_batch, row.max_split = res.batch_size, list(res.chunk_sizes)
        row.max_certified, row.max_probes = res.certified, res.num_probes
        row.max_notes = "" if res.certified else _certificate_notes(res.notes)
        row.even_batch = res.even.batch_size
        row.even_open, row.even_at_most = res.even.open_bracket, res.even.at_most
        alt = res.allocator_answer
        if alt is not None:
            row.exp_batch, row.exp_certified, row.exp_probes = alt.batch_size, alt.certified, alt.probes
        row.looked_past = looked_words(res.looked_past)
        say(f"max_batch: {row.max_batch} as {row.max_split}, {row.max_probes} probes, "
            f"certified {row.max_certified}; even {row.even_batch}")
        closed = [b for b in res.brackets if b.closed]
        # where the claim is: a card's bracket's hi; card 0's whole-batch bracket, its chunk
        # with the batch one over the bracket's lo (the others at their chunks)
        claim_at = {b.card: b.hi if b.what == "chunk" else row.max_split[0] + b.hi - row.max_batch
                    for b in closed}
        chk = local_check(lambda s: at_level(backend.probe(s), devices, budget.level), budgets,
                          row.max_split, sorted(claim_at), m, near, claim_at)
        row.check_run, row.check_fits = True, chk.fits
        row.check_proven, row.check_over = list(chk.proven), list(chk.over)
        row.check_not_monotone, row.check_probes = "; ".join(chk.not_monotone), chk.probes
        row.check_larger = list(chk.larger)
        say(f"local check: fits {chk.fits}, over at +1 on {list(chk.over)} of proven "
            f"{list(chk.proven)}, batch {row.max_batch + 1} fits with one more on cards "
            f"{list(chk.larger)}, not monotone: {list(chk.not_monotone) or 'none'} ({chk.probes} probes)")
    except Exception as e:  # report, don't stop the benchmark
        row.max_error = f"{type(e).__name__}: {e}"
        say(f"max_batch failed: {row.max_error}")
    if row.even_batch:
        try:
            res = tune(row.even_batch, "balance")
            row.bal_split, row.bal_certified = list(res.chunk_sizes), res.certified
            row.bal_probes = res.num_probes
            row.bal_notes = "" if res.certified else _certificate_notes(res.notes)
            say(f"balance at {row.even_batch}: {row.bal_split}, {row.bal_probes} probes, "
                f"certified {row.bal_certified}")
        except Exception as e:
            row.bal_error = f"{type(e).__name__}: {e}"
            say(f"balance failed: {row.bal_error}")
    row.seconds = time.perf_counter() - t0
    say(f"[{row.seconds:.0f} s]")
    return row


def all_cases() -> list[tuple[str, str]]:
    """(model, cluster) of the whole grid, the realistic configurations last."""
    return ([(m, s) for m in config.MODELS for s in config.SCENARIOS]
            + [(spec.name, s) for spec, s in config.REALISTIC])


def level_table(rows: Sequence[dict[str, Any]], cases: Optional[Sequence[tuple[str, str]]] = None) -> str:
    """The Markdown table of ``results-<level>.csv`` rows; each case of ``cases`` with no row
    reads "not run"."""
    def yes(r: dict[str, Any], k: str) -> bool:
        return str(r.get(k, "")).lower() == "true"

    header = ["model", "cluster", "largest batch: even / dptune (gain)", "max_batch: certified, probes",
              "looked past the over points (allocator model)",
              "with expandable_segments:True (advised where fragmentation shows): batch, certified, probes",
              "balance at even max: certified, probes",
              "local check: split fits, +1 over on cards proven, one more fits on, monotone near"]
    out = []
    by_case = {(str(r["model"]), str(r["scenario"])): r for r in rows}
    order = list(cases or []) + [k for k in by_case if k not in set(cases or [])]
    for key in order:
        r = by_case.get(key)
        cells = [key[0], key[1].replace(",", ", ")]
        if r is None:
            out.append(cells + ["not run"] * (len(header) - 2))
            continue
        if r.get("max_batch_error"):
            out.append(cells + [f"failed: {r['max_batch_error']}"] + [""] * (len(header) - 3))
            continue
        even, best = int(r["dptune_even_max_batch"]), int(r["max_batch"])
        open_ = (f" (open, at most {r['even_at_most'] or '?'})" if yes(r, "even_open") else "")
        # the gain as the probes prove it: a range while the even bracket is open
        at_most = int(r.get("even_at_most") or 0) if yes(r, "even_open") else even
        low, high = (f"{best / at_most - 1:+.0%}" if at_most else None), f"{best / even - 1:+.0%}"
        gain = ("n/a" if not even else high if low == high else
                f"{low} to {high}" if low else f"at most {high}")
        cert = "yes" if yes(r, "max_batch_certified") else f"**no**: {r.get('max_batch_notes') or 'no note'}"
        bal = (f"failed: {r['balance_error']}" if r.get("balance_error") else
               f"{'yes' if yes(r, 'balance_certified') else '**no**: ' + (r.get('balance_notes') or 'no note')}"
               f", {r['balance_probes']}")
        proven, over = str(r["check_proven_cards"]).split(), str(r["check_over_cards"]).split()
        missing = [c for c in proven if c not in over]
        larger = str(r.get("check_larger_cards", "")).split()
        check = (f"{'yes' if yes(r, 'check_fits') else '**NO**'}, {len(over)}/{len(proven)}"
                 + (f" (card {', '.join(missing)} **not over**)" if missing else "")
                 + (f", **cards {', '.join(larger)}** ({best + 1} fits)" if larger else ", none")
                 + f", {'yes' if not r.get('check_not_monotone') else '**no**: ' + r['check_not_monotone']}"
                 if yes(r, "check_run") else "not run")
        exp = (f"{r['expandable_max_batch']}, {'yes' if yes(r, 'expandable_certified') else '**no**'}, "
               f"{r['expandable_probes']}" if str(r.get("expandable_max_batch") or "") else "-")
        out.append(cells + [f"{even}{open_} / {best} ({gain})", f"{cert}, {r['max_batch_probes']}",
                            str(r.get("looked_past") or "-"), exp, bal, check])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in out])


def summary(rows: Sequence[dict[str, Any]], cases: Sequence[tuple[str, str]]) -> str:
    """One line: cases run, certified, checked."""
    def yes(r: dict[str, Any], k: str) -> bool:
        return str(r.get(k, "")).lower() == "true"
    ok = [r for r in rows if not r.get("max_batch_error")]
    checked = [r for r in ok if yes(r, "check_run") and yes(r, "check_fits")
               and set(str(r["check_proven_cards"]).split()) == set(str(r["check_over_cards"]).split())
               and not r.get("check_not_monotone") and not str(r.get("check_larger_cards", "")).split()]
    run = {(str(r["model"]), str(r["scenario"])) for r in rows}
    exp = [r for r in ok if str(r.get("expandable_max_batch") or "")]
    looked = [r for r in ok if str(r.get("looked_past") or "")]
    return (f"{len(rows)} of {len(cases)} cases run; largest batch certified in "
            f"{sum(yes(r, 'max_batch_certified') for r in ok)} of {len(ok)}, balance certified in "
            f"{sum(yes(r, 'balance_certified') for r in ok if not r.get('balance_error'))}; the local "
            f"check passed (fits, every proven card over at +1, no batch one larger fits, monotone near "
            f"the answer) in "
            f"{len(checked)} of {len(ok)}; with expandable_segments:True advised in "
            f"{len(exp)} (certified in {sum(yes(r, 'expandable_certified') for r in exp)}); "
            f"looked past the over points in {len(looked)} (over throughout in "
            f"{sum(str(r['looked_past']).startswith('over throughout') for r in looked)}); "
            f"not run: {len([c for c in cases if c not in run])}.")


def run_grid(models: Sequence[str], scenarios: Sequence[str], realistic: bool, level: str,
             out: pathlib.Path, near: int = NEAR) -> list[LevelRow]:
    """Run the cases, writing ``results-<level>.csv`` and ``.md`` after each (so a partial run
    leaves its rows)."""
    from benchmarks.output import write_csv

    specs = [(config.MODELS[m], s) for s in scenarios for m in models]   # every model early
    if realistic:
        specs += list(config.REALISTIC)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[LevelRow] = []
    t0 = time.perf_counter()
    for spec, sc in specs:
        rows.append(run_level_case(spec, sc, level, near, log=sys.stderr))
        dicts = [r.to_csv() for r in rows]
        write_csv(out / f"results-{level}.csv", dicts)
        (out / f"results-{level}.md").write_text(
            f"# dptune at the {level} level (simulated cluster)\n\n"
            f"{summary(dicts, all_cases())}\n\n{level_table(dicts, all_cases())}\n\n"
            f"{time.perf_counter() - t0:.0f} s so far.\n", encoding="utf-8")
    return rows
