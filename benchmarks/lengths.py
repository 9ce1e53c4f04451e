"""Variable lengths: tokens per step over one epoch, three ways, and the probes it costs.

``python -m benchmarks.lengths [--level reserved|allocated] [--quick] [--models GPT,BERT]``
(tens of minutes on 2 shared cores; ``--quick``: one model, one distribution, one cluster), at
dptune's default budget level (``reserved``: the allocator model's reserved peak plus NCCL's
buffers, headroom 256 MiB; writes ``benchmarks/lengths_reserved.json``) or ``--level
allocated`` (the allocated peak, headroom 1 GiB; ``benchmarks/lengths.json``): the plan, the
even-split bisection and the replay all check the cards at that level. For a GPT-style decoder (20,000
samples) and a BERT-style encoder (400,000: its short buckets plan batches of tens of
thousands), a long-tailed (log-normal, like SFT data) and a bimodal length distribution, on
4x24GB and on mixed cards, with the training step of the other benchmarks (AdamW, bf16
autocast):

- (a) **longest**: the largest batch that fits the longest length (dptune's plan for the last
  bucket, split as planned), drawn at random: what users do today;
- (b) **token budget, even split**: one global budget ``count x longest <= T``, with ``T`` the
  largest even-split batch at the longest length times that length (found by bisection on
  the simulator), batches packed greedily from all samples sorted by length (fairseq-style),
  then shuffled, each split evenly;
- (c) **per-bucket plan**: :func:`dptune.lengths.plan_lengths` with
  :class:`~dptune.lengths.BucketBatchSampler` and each batch's planned split.

Reported: optimizer steps per epoch and real (unpadded) tokens per step; the probes of the
per-bucket search, seeded from each neighbour, against searching every bucket on its own from
the same start; which buckets are certified (one more sample measured over) and, for those
that are not, the search's notes; and a replay of the epoch through the simulator: every
split its batches are given, at the longest padded length any batch with that split has (at
one split a longer batch only uses more memory), counted over a card's budget or not (0 is
safe).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from typing import Any, Callable, Optional

import torch

from dptune.backends.simulated import SimulatedBackend
from dptune.budget import at_level
from dptune.examples import models as M
from dptune.lengths import BucketBatchSampler, plan_lengths
from dptune.lengths.plan import LengthPlan
from dptune.split import even_split
from dptune.step.workload import Workload

from benchmarks import config

HEADROOM = "1GiB"    # the allocated level's default (each level's own unless --headroom)
#: samples per case: enough that every bucket holds several of its planned batches (the
#: encoder's short buckets plan batches of tens of thousands), else each bucket is one short
#: batch and the comparison measures how the buckets cut the data, not the batches
N_SAMPLES = {"GPT": 20_000, "BERT": 400_000}
BUCKETS = 6
CLUSTERS = ("4x24GB", "40GB,24GB,2x16GB")


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


def gpt() -> torch.nn.Module:
    return M.TinyGPT(vocab_size=32000, d_model=512, n_layers=4, n_heads=8, seq_len=2048)


def gpt_sample(n: int, length: int) -> Any:
    return torch.randint(0, 32000, (n, length))


def bert() -> torch.nn.Module:
    return M.BertClassifier(vocab_size=30522, d_model=512, n_layers=4, n_heads=8, seq_len=512)


def bert_sample(n: int, length: int) -> Any:
    return {"input_ids": torch.randint(0, 30522, (n, length)),
            "attention_mask": torch.ones(n, length, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,))}


MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int, int], Any], int]] = {
    "GPT": (gpt, gpt_sample, 2048), "BERT": (bert, bert_sample, 512)}


def lengths_of(dist: str, n: int, longest: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if dist == "lognormal":     # median ~ longest/8, a long tail up to the longest
        xs = [rng.lognormvariate(math.log(longest / 8), 0.8) for _ in range(n)]
    else:                       # bimodal: short prompts and long documents
        xs = [rng.gauss(longest / 10, longest / 40) if rng.random() < 0.7
              else rng.gauss(longest * 0.7, longest / 8) for _ in range(n)]
    return [max(8, min(longest, int(x))) for x in xs]


# ---- the three ways to batch an epoch ------------------------------------------------------
def epoch_longest(lengths: list[int], batch: int, seed: int = 0) -> list[list[int]]:
    idx = list(range(len(lengths)))
    random.Random(seed).shuffle(idx)
    return [idx[i:i + batch] for i in range(0, len(idx), batch)]


def epoch_token_budget(lengths: list[int], budget: int, seed: int = 0) -> list[list[int]]:
    """fairseq-style: every sample sorted by length (ties in a random order), packed while
    count x longest <= budget, the batches then shuffled."""
    rng = random.Random(seed)
    keys = [rng.random() for _ in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], keys[i]))
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:   # sorted: the newest sample is the longest
        if cur and (len(cur) + 1) * lengths[i] > budget:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def epoch_plan(lengths: list[int], plan: LengthPlan, seed: int = 0) -> list[list[int]]:
    return list(BucketBatchSampler(lengths, plan, seed=seed))


def figures(lengths: list[int], batches: list[list[int]]) -> dict[str, float]:
    tokens = sum(lengths)
    return {"steps": len(batches), "tokens_per_step": tokens / max(1, len(batches)),
            "padded_share": sum(len(b) * max(lengths[i] for i in b) for b in batches) / tokens - 1}


# ---- the simulator: even-split bisection and the replay ------------------------------------
class Sim:
    """The cards at ``budget``'s level (default: the allocated level, headroom 1 GiB)."""

    def __init__(self, model: Callable[[], torch.nn.Module], sample: Callable[[int, int], Any],
                 cluster: str, budget: Any = None):
        self.length = 1
        budget = config.level_budget("allocated", HEADROOM) if budget is None else budget
        self.level = budget.level
        self.backend = SimulatedBackend(
            Workload(model, lambda n: sample(n, self.length), None, _adamw, amp="bf16"), cluster,
            reserved=budget.reserved)
        self.budgets = [d.budget_bytes(budget.headroom_bytes) for d in self.backend.devices]
        self.probes = 0

    def fits(self, length: int, split: list[int]) -> bool:
        self.length = length
        self.probes += 1
        r = at_level(self.backend.probe(split), self.backend.devices, self.level)
        return r.feasible and all(p <= b for i, (p, b, c) in enumerate(
            zip(r.peak_bytes, self.budgets, split)) if i == 0 or c > 0)

    def largest_even(self, length: int, hi: int) -> int:
        n = len(self.budgets)
        lo, hi = 0, max(hi, 1)
        while self.fits(length, even_split(hi, n)):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(length, even_split(mid, n)) else (lo, mid)
        return lo

    def replay(self, lengths: list[int], batches: list[list[int]],
               split: Callable[[int, int], list[int]]) -> tuple[int, int]:
        """(shapes replayed, those over a budget): every batch's split, each at the longest
        padded length any batch of the epoch has with that split (at the same split a longer
        batch only uses more memory, so it stands for the shorter ones)."""
        longest: dict[tuple[int, ...], int] = {}
        for b in batches:
            L = max(lengths[i] for i in b)
            key = tuple(split(L, len(b)))
            longest[key] = max(longest.get(key, 0), L)
        over = sum(not self.fits(L, list(key)) for key, L in sorted(longest.items()))
        return len(longest), over


def run_one(name: str, dist: str, cluster: str, level: str = config.LEVELS[0],
            headroom: Optional[str] = None) -> dict[str, Any]:
    model, sample, longest = MODELS[name]
    lengths = lengths_of(dist, N_SAMPLES[name], longest)
    budget = config.level_budget(level, headroom)
    common = dict(simulate=cluster, budget=budget, optimizer=_adamw, amp="bf16",
                  max_length=longest, batch_size=256)   # as Sim
    t0 = time.perf_counter()
    plan = plan_lengths(model, sample, lengths, BUCKETS, **common)
    t_plan = time.perf_counter() - t0
    scratch = plan_lengths(model, sample, lengths, BUCKETS, from_neighbour=False, **common)
    same = [b.batch_size for b in plan.buckets] == [b.batch_size for b in scratch.buckets]
    sim = Sim(model, sample, cluster, budget)
    n = len(plan.devices)
    last = plan.buckets[-1]
    a = epoch_longest(lengths, last.batch_size)
    even = sim.largest_even(last.length, last.batch_size)
    tokens = even * last.length
    b = epoch_token_budget(lengths, tokens)
    c = epoch_plan(lengths, plan)
    row: dict[str, Any] = {
        "model": name, "lengths": dist, "cluster": cluster, "buckets": len(plan.buckets),
        "samples": len(lengths),
        "plan": [bk.to_dict() for bk in plan.buckets], "plan_seconds": t_plan,
        "plan_scratch": [bk.to_dict() for bk in scratch.buckets],
        "probes_neighbour": plan.probes, "probes_scratch": scratch.probes, "same_answers": same,
        "certified": plan.certified, "token_budget_even": tokens, "level": level,
        "buckets_certified": [bk.certified for bk in plan.buckets],
        "uncertified_notes": uncertified_bucket_notes(plan),
        "looked_notes": [n for n in plan.notes if "looked past the over points" in n],
        "a": figures(lengths, a), "b": figures(lengths, b), "c": figures(lengths, c)}
    row["a"]["replay"] = sim.replay(lengths, a, lambda L, k: plan.chunk_sizes_for(
        last.length, k))
    row["b"]["replay"] = sim.replay(lengths, b, lambda L, k: even_split(k, n))
    row["c"]["replay"] = sim.replay(lengths, c, lambda L, k: plan.chunk_sizes_for(L, k))
    sim.backend.close()
    return row


def uncertified_bucket_notes(plan: LengthPlan) -> list[str]:
    """The plan's notes about its buckets that are not certified (``length <= L: ...``)."""
    open_ = {bk.length for bk in plan.buckets if not bk.certified}
    return [n for n in plan.notes
            if n.startswith("length <= ") and int(n[len("length <= "):].split(":")[0]) in open_]


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | samples | lengths | cards | level | (a) longest: steps, tok/step | (b) token "
            "budget even: steps, tok/step | (c) per-bucket plan: steps, tok/step | (c)/(a) | probes: "
            "neighbour / scratch | buckets certified | replay over budget (a/b/c) |")
    out = [head, "|" + "---|" * 12]
    for r in rows:
        a, b, c = r["a"], r["b"], r["c"]
        cert = r.get("buckets_certified")
        cert_txt = f"{sum(cert)}/{len(cert)}" if cert is not None else (
            f"{r['buckets']}/{r['buckets']}" if r.get("certified") else "not all")
        out.append(
            f"| {r['model']} | {r.get('samples', 1500):,} | {r['lengths']} | {r['cluster']} | "
            f"{r.get('level', 'allocated')} | "
            f"{a['steps']}, "
            f"{a['tokens_per_step']:,.0f} | {b['steps']}, {b['tokens_per_step']:,.0f} | "
            f"{c['steps']}, {c['tokens_per_step']:,.0f} | "
            f"{c['tokens_per_step'] / a['tokens_per_step']:.1f}x | "
            f"{r['probes_neighbour']} / {r['probes_scratch']} | {cert_txt} | "
            f"{a['replay'][1]}/{a['replay'][0]}, {b['replay'][1]}/{b['replay'][0]}, "
            f"{c['replay'][1]}/{c['replay'][0]} |")
    return "\n".join(out)


def gpt_1b() -> torch.nn.Module:
    """A 0.98B-parameter decoder: d 2048, 18 layers, vocabulary 32000, 4096 positions."""
    return M.TinyGPT(vocab_size=32000, d_model=2048, n_layers=18, n_heads=16, seq_len=4096)


def scale(budget: Any = None) -> dict[str, Any]:
    """8 buckets of log-normal lengths (20,000 samples up to 4096) for the 1B decoder on 4
    simulated 80 GB cards, AdamW and bf16: wall and CPU seconds, probes, and each probe's wall
    and CPU seconds (the machine may be shared: CPU time is what the search itself costs)."""
    from dptune.backends.simulated import backend as sim_backend

    rng = random.Random(0)
    lengths = [min(4096, max(16, int(rng.lognormvariate(6, 0.9)))) for _ in range(20000)]
    timed: list[tuple[float, float]] = []
    probe = sim_backend.SimulatedBackend.probe

    def timed_probe(self: Any, *a: Any, **k: Any) -> Any:   # the benchmark's stopwatch only
        w, c = time.perf_counter(), time.process_time()
        try:
            return probe(self, *a, **k)
        finally:
            timed.append((time.perf_counter() - w, time.process_time() - c))
    sim_backend.SimulatedBackend.probe = timed_probe  # type: ignore[method-assign]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_lengths(gpt_1b, gpt_sample, lengths, 8, simulate="4x80GB", optimizer=_adamw,
                            amp="bf16",
                            budget=config.level_budget("allocated", HEADROOM) if budget is None
                            else budget)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        sim_backend.SimulatedBackend.probe = probe  # type: ignore[method-assign]
    return {"wall_seconds": wall, "cpu_seconds": cpu, "probes": plan.probes,
            "probes_per_bucket": [b.probes for b in plan.buckets],
            "probe_wall_seconds": [round(w, 2) for w, _ in timed],
            "probe_cpu_seconds": [round(c, 2) for _, c in timed],
            "outside_probes_cpu_seconds": cpu - sum(c for _, c in timed),
            "lines": plan.lines()}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one model, one distribution, one cluster")
    p.add_argument("--scale", action="store_true",
                   help="only the 1B-parameter decoder over 8 buckets: the time it takes")
    p.add_argument("--models", default=",".join(MODELS), help="which models, e.g. BERT")
    p.add_argument("--out", default=None, help="default: benchmarks/lengths.json at the allocated "
                   "level, benchmarks/lengths_LEVEL.json at another")
    p.add_argument("--table", metavar="JSON", default=None,
                   help="only print the table of rows saved by an earlier run")
    config.add_level_options(p)
    args = p.parse_args(argv)
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            print(table(json.load(f)))
        return 0
    out = args.out or ("benchmarks/lengths.json" if args.level == "allocated"
                       else f"benchmarks/lengths_{args.level}.json")
    if args.scale:
        print(json.dumps(scale(config.level_budget(args.level, args.headroom)), indent=2))
        return 0
    models = [m for m in args.models.split(",") if m]
    combos = [(m, d, c) for m in models for d in ("lognormal", "bimodal") for c in CLUSTERS]
    if args.quick:
        combos = combos[:1]
    rows = []
    for m, d, c in combos:
        t, cpu = time.perf_counter(), time.process_time()
        rows.append(run_one(m, d, c, args.level, args.headroom))
        rows[-1]["seconds"] = time.perf_counter() - t
        rows[-1]["cpu_seconds"] = time.process_time() - cpu
        print(f"{m} {d} {c}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
        with open(out, "w", encoding="utf-8") as f:   # each row as it comes
            json.dump(rows, f, indent=2)
    print(table(rows))
    for r in rows:
        for n in r["uncertified_notes"]:
            print(f"{r['model']} {r['lengths']} {r['cluster']} not certified: {n}")
        for n in r.get("looked_notes", []):
            print(f"{r['model']} {r['lengths']} {r['cluster']} certified, {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
