"""The benchmark machinery (benchmarks/) on a tiny MLP over three tiny simulated cards.

The exact optimum in ``benchmarks.search`` rests on a property of the simulator, checked
here: card i >= 1's peak depends only on its own chunk, card 0's only on its chunk and the
whole batch. The searches are checked against brute force on the same simulator.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from benchmarks import config, run, search
from dptune.backends.simulated import SimulatedBackend, parse_cluster
from dptune.examples.models import MLP
from dptune.split import even_split
from dptune.step.workload import Workload

CLUSTER = "3x41.125MiB,context=0"  # ~0.5 MiB per sample: the even split fits ~50 samples
HEADROOM = "1MiB"


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP(in_features=131072, hidden=8, depth=1, num_classes=10)


@pytest.fixture(scope="module")
def setup():
    model = _model()
    workload = Workload(model, model.sample, None, config.optimizer)
    backend = SimulatedBackend(workload, CLUSTER)
    curves = search.Curves(workload, min_chunk=1)
    budgets = [d.budget_bytes(1 << 20) for d in parse_cluster(CLUSTER).devices]
    return model, workload, backend, curves, budgets


def _fits(backend, budgets, split) -> bool:
    r = backend.probe(split)
    return r.feasible and all(p <= b for p, b in zip(r.peak_bytes, budgets))


@pytest.mark.slow
def test_card_memory_depends_only_on_own_chunk_and_batch(setup):
    model, workload, backend, curves, _ = setup
    four = SimulatedBackend(workload, "4x41.125MiB,context=0")
    # card i >= 1: the same chunk on any card, whatever the others get, on 3 or 4 cards
    a = backend.estimate([0, 7, 20]).peak_bytes
    b = backend.estimate([9, 20, 7]).peak_bytes
    c = four.estimate([3, 1, 7, 20]).peak_bytes
    assert a[1] == b[2] == c[2] and a[2] == b[1] == c[3]
    # card 0: the same for one (chunk, batch), however the rest is shared, on 3 or 4 cards
    g = {backend.estimate([10, 5, 25]).peak_bytes[0], backend.estimate([10, 30, 0]).peak_bytes[0],
         four.estimate([10, 10, 10, 10]).peak_bytes[0]}
    assert len(g) == 1
    # so the 2-card curves give every card's peak of any split
    for split in ([0, 12, 30], [14, 14, 14], [25, 0, 3], [2, 40, 1]):
        assert curves.peaks(split) == list(backend.estimate(split).peak_bytes)
    # and they are non-decreasing, which the exact searches assume
    fs = [curves.f(c) for c in range(0, 40, 3)]
    gs = [curves.g(c, 40) for c in range(0, 41, 4)]
    assert fs == sorted(fs) and gs == sorted(gs) and fs[-1] > fs[1] and gs[-1] > gs[0]


@pytest.mark.slow
def test_power_then_binary_finds_largest_even_batch(setup):
    _, _, backend, _, budgets = setup
    E, trials = search.power_then_binary(lambda b: _fits(backend, budgets, even_split(b, 3)), init=2)
    scan = [b for b in range(1, E + 9) if _fits(backend, budgets, even_split(b, 3))]
    assert 20 < E < 200
    assert E == max(scan) and scan == list(range(1, E + 1))   # every smaller batch fits too
    # doubling from 2 until the first failure, then bisection: one probe per trial
    powers = [b for b, _ in itertools.takewhile(lambda t: t[1], trials)]
    assert powers == [2 ** k for k in range(1, len(powers) + 1)]
    fail = trials[len(powers)]
    assert fail == (2 * powers[-1], False) and powers[-1] <= E < fail[0]
    assert len(trials) == len(powers) + 1 + math.ceil(math.log2(fail[0] - powers[-1]))


@pytest.mark.slow
def test_gpu0_bsz_grid_probes_every_point_and_bisection_agrees(setup):
    _, _, backend, curves, budgets = setup
    calls: list[list[int]] = []

    def peaks(split):
        calls.append(list(split))
        return backend.probe(split).peak_bytes

    B = 40
    full = search.grid_gpu0_bsz(peaks, budgets, B, full=True)
    assert full.points == len(calls) == math.ceil(B / 3) + 1 == full.evaluated
    assert [c[0] for c in calls] == list(range(full.points))
    assert all(sum(c) == B for c in calls)
    fast = search.grid_gpu0_bsz(curves.peaks, budgets, B, full=False)
    assert fast.points == full.points and fast.evaluated < full.points
    assert (fast.gpu0_bsz, fast.chunk_sizes, fast.max_share) == (full.gpu0_bsz, full.chunk_sizes,
                                                                 full.max_share)
    assert full.fits and full.max_share <= 1.0


@pytest.mark.slow
def test_balance_optimum_matches_brute_force(setup):
    _, _, _, curves, budgets = setup
    B = 30
    best = min((max(p / b for p, b in zip(curves.peaks([c0, c1, B - c0 - c1]), budgets)), (c0, c1))
               for c0 in range(B + 1) for c1 in range(B - c0 + 1))
    for seed in ([10, 10, 10], [0, 0, 30], [28, 1, 1]):
        opt = search.balance_optimum(curves, budgets, B, seed)
        assert sum(opt.chunk_sizes) == B
        assert opt.max_share == pytest.approx(best[0], abs=0)
        assert search.linf_distance(opt.chunk_sizes, opt.caps, B) == 0


@pytest.mark.slow
def test_max_batch_optimum_is_largest_over_all_splits(setup):
    _, _, backend, curves, budgets = setup
    B, split = search.max_batch_optimum(curves, budgets)
    assert sum(split) == B and _fits(backend, budgets, split)
    # no split of B + 1 fits: with non-decreasing curves, a split fits iff every card is within
    # its largest fitting chunk, found here by linear scans
    def largest(fn, budget):
        c = 0
        while fn(c + 1) <= budget:
            c += 1
        return c

    cap0 = largest(lambda c: curves.g(c, B + 1), budgets[0])
    caps = [largest(curves.f, b) for b in budgets[1:]]
    assert cap0 + sum(caps) < B + 1
    assert curves.fits([cap0] + [caps[0], B + 1 - cap0 - caps[0]], budgets) is False


@pytest.mark.slow
def test_run_case_tiny_dptune_near_the_optimum(setup):
    model, _, _, curves, _ = setup
    spec = config.ModelSpec("tiny-MLP", _model, "test", hint_per_card=8)
    row = run.run_case(spec, CLUSTER, curves, model, model.sample, repeats=1, headroom=HEADROOM)
    assert not row.bal_error and not row.max_error
    assert row.even_max_batch == row.lightning_batch == row.even_max_exact > 0
    assert row.opt_max_verified
    # dptune's balanced split of the even split's largest batch: within 1 sample per card of
    # an optimal split, and never better than the optimum
    assert sum(row.bal_split) == row.even_max_batch and row.bal_distance <= 1
    assert row.bal_max_share >= row.opt_bal_max_share
    assert row.bal_max_share <= row.even_max_share
    # its largest batch: never below the even split's nor above the optimum (how far below the
    # optimum is a figure of the report: max_batch can stop short, see the note)
    assert row.even_max_batch <= row.max_batch <= row.opt_max_batch
    assert row.grid_points == math.ceil(row.even_max_batch / 3) + 1
    assert row.bal_probes <= 12 and row.max_probes <= 12
    md = run.headline_table([row])
    assert "tiny-MLP" in md and f"{row.even_max_batch} / {row.max_batch} / {row.opt_max_batch}" in md
    assert set(row.to_csv()) >= {"balance_distance_samples", "max_batch_gap_samples", "grid_points"}


def test_validate_gpu_cases_and_plain_step_run_without_a_gpu():
    """The GPU check cannot run here; its plain loop (the ground truth) and its estimate for
    each kind of step can, so the script is runnable when a GPU is at hand."""
    import torch

    from benchmarks import validate_gpu as v
    from dptune.backends.simulated import Cluster

    cases = v._cases()
    from dptune.examples.hf import gpt2_batch, tiny_gpt2

    assert {c.step_label for c in cases} >= {"fp32", "bf16 autocast", "fp32, accumulate 2",
                                             "bf16 autocast, accumulate 2"}
    hf = next(c for c in cases if c.label == "HF-GPT2+cache" and c.step)
    small = v.Case(hf.label, tiny_gpt2, lambda m, b: gpt2_batch(b, seq_len=16), [2], hf.optimizer,
                   hf.step)
    model = small.factory()
    opt = small.optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    v.plain_step(model, opt, [small.sample(model, 2) for _ in range(2)], "bf16", "cpu")
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))   # it stepped
    assert v.estimate(small, 2, Cluster.uniform(1, 24 * 2**30)) > 0


# slow: the benchmark's doubling-and-bisection caps (seconds); the fast selection checks the
# same property (the DDP max_batch plan is each rank's exact cap) in tests/ddp/test_ddp_plan.py
@pytest.mark.slow
def test_ddp_benchmark_exact_caps_agree_with_the_plan():
    import torch
    import torch.nn as nn

    from benchmarks.ddp import DDPRow, exact_caps, table
    from dptune import ddp
    from dptune.step.workload import Workload

    def net() -> nn.Module:
        return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 8))

    def batch(b: int) -> torch.Tensor:
        return torch.randn(b, 128)

    spec = "32GB,24GB,used=1:20GB"
    caps = exact_caps(Workload(net, batch), spec, 1 << 30)
    plan = ddp.plan(net, batch, objective="max_batch", simulate=spec,
                    budget_level="allocated")    # exact_caps bisects on allocated peaks
    assert plan.batch_sizes == caps and plan.certified and caps[0] > caps[1]
    row = DDPRow(model="net", cluster=spec, caps=caps, equal=2 * min(caps), planned=plan.batch_sizes,
                 optimum=sum(caps), rounds=plan.rounds, probes=len(plan.probes),
                 certified=plan.certified, seconds=0.0)
    assert f"| {sum(caps)} {caps} | {sum(caps)} |" in table([row])
