"""``dptune.ddp.plan(..., strategy="fsdp")`` and ``dptune plan --strategy fsdp`` on the
simulated cluster: per-rank batches for an FSDP2-sharded model, certified per rank against
an independent simulation of each rank, the same plan object, loss scales and sampler."""

from __future__ import annotations

import json

import pytest
import torch

from dptune import ddp
from dptune.hardware.cluster import parse_cluster
from dptune.backends.simulated.ddp import card_of
from dptune.backends.simulated.fsdp import SimulatedFSDPRank
from dptune.ddp.fsdp import FSDPOptions, repeated_blocks
from dptune.errors import NoFeasibleSplitError, UsageError
from dptune.step.workload import Workload
from fsdp_models import Decoder, MLPStack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

SPEC = "2x64MB,48MB,context=8MB"        # three ranks, the last card smaller


def mlp() -> MLPStack:
    return MLPStack(dim=256, depth=4)


def seqs(b: int) -> torch.Tensor:       # 64 positions a sample: activations grow with b
    return torch.randn(b, 64, 256)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _rank_peak(spec: str, rank: int, b: int) -> int:
    """Rank ``rank``'s peak at local batch ``b``, simulated afresh (not the planner's memo)."""
    cluster = parse_cluster(spec)
    sim = SimulatedFSDPRank(Workload(mlp, seqs, None, adamw), card_of(cluster, rank), len(cluster),
                            FSDPOptions().shard_fn())
    try:
        return sim.estimate([b]).peak_bytes[0]
    finally:
        sim.close()


def test_default_sharding_takes_the_outermost_module_list():
    model = Decoder(depth=3)
    assert repeated_blocks(model) == list(model.layers)
    assert len(repeated_blocks(mlp())) == 4


@pytest.mark.slow
def test_fsdp_max_batch_is_certified_per_rank():
    plan = ddp.plan(mlp, seqs, optimizer=adamw, objective="max_batch", simulate=SPEC, headroom=0,
                    strategy="fsdp", budget_level="allocated")
    assert plan.certified and plan.world_size == 3
    b = plan.batch_sizes
    assert b[0] == b[1] > b[2] >= 1
    budgets = [d.budget_bytes(0) for d in parse_cluster(SPEC).devices]
    for r in (0, 2):      # one rank per card type; each checked by a fresh simulation
        assert _rank_peak(SPEC, r, b[r]) <= budgets[r] < _rank_peak(SPEC, r, b[r] + 1)
    assert plan.even_batch_size == 3 * b[2] < plan.global_batch
    assert plan.loss_scales == pytest.approx([3 * x / plan.global_batch for x in b])
    assert any("strategy fsdp" in n for n in plan.notes)
    assert not torch.distributed.is_initialized()      # the fake process group is gone
    # the same sampler: every rank its own slice of each global batch
    n = 5 * plan.global_batch
    seen = [i for r in range(3) for batch in ddp.UnevenBatchSampler(n, plan, rank=r) for i in batch]
    assert sorted(seen) == list(range(n))


@pytest.mark.slow
def test_fsdp_balance_and_one_simulation_per_card_and_batch(monkeypatch):
    calls: list[tuple[str, int]] = []
    estimate = SimulatedFSDPRank.estimate

    def counted(self, sizes, *a, **k):
        calls.append((self.cluster.names[0], sizes[0]))
        return estimate(self, sizes, *a, **k)

    monkeypatch.setattr(SimulatedFSDPRank, "estimate", counted)
    plan = ddp.plan(mlp, seqs, optimizer=adamw, global_batch=30, simulate=SPEC, headroom=0,
                    strategy="fsdp", objective="balance", budget_level="allocated")
    assert plan.global_batch == 30 and min(plan.batch_sizes) >= 1
    b = plan.batch_sizes
    assert abs(b[0] - b[1]) <= 1 and min(b[0], b[1]) > b[2]     # the same card: the same share
    for r in plan.ranks:
        assert r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
    # ranks 0 and 1 share a card type: one simulation per (card, local batch)
    assert len(calls) == len(set(calls))
    names = parse_cluster(SPEC).names
    assert set(calls) == {(names[p.rank], p.batch_size) for p in plan.probes}
    assert len(plan.probes) > len(calls)


@pytest.mark.slow
def test_fsdp_fits_a_model_that_ddp_cannot():
    big = "4x90MB,context=8MB"          # 82 MiB each: a 33.6 MB model with AdamW does not fit DDP

    def wide() -> MLPStack:
        return MLPStack(dim=512, depth=4)

    def x(b: int) -> torch.Tensor:
        return torch.randn(b, 16, 512)

    with pytest.raises(NoFeasibleSplitError, match="rank 0"):
        ddp.plan(wide, x, optimizer=adamw, objective="max_batch", simulate=big, headroom=0,
                 budget_level="allocated")
    plan = ddp.plan(wide, x, optimizer=adamw, objective="max_batch", simulate=big, headroom=0,
                    strategy="fsdp", budget_level="allocated")
    assert min(plan.batch_sizes) >= 1 and plan.certified


def test_fsdp_arguments_are_checked():
    with pytest.raises(UsageError, match="strategy must be"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, strategy="zero3")
    with pytest.raises(UsageError, match="not inside a torch.distributed job"):
        ddp.plan(mlp, seqs, global_batch=8, strategy="fsdp")
    with pytest.raises(UsageError, match="FSDP's: pass strategy='fsdp'"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, reshard_after_forward=False)
    with pytest.raises(UsageError, match="inside it"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, strategy="fsdp",
                 shard=lambda m, mesh: m, reshard_after_forward=False)
    with pytest.raises(UsageError, match="not available with strategy='fsdp'"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, strategy="fsdp", objective="throughput")
    with pytest.raises(UsageError, match="MixedPrecisionPolicy"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, strategy="fsdp", mp_policy="bf16")


def test_a_shard_function_that_leaves_the_root_unsharded_is_named():
    def blocks_only(model, mesh):
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block, mesh=mesh)

    with pytest.raises(UsageError, match="on the root last"):
        ddp.plan(mlp, seqs, global_batch=8, simulate=SPEC, strategy="fsdp", shard=blocks_only)
    assert not torch.distributed.is_initialized()      # the fake process group is gone


def test_cli_plan_strategy_fsdp(tmp_path, capsys):
    from dptune.cli import main

    out = tmp_path / "p.json"
    code = main(["plan", "--model", "dptune.examples.models:MLP", "--simulate", "32GB,24GB",
                 "--batch-size", "96", "--strategy", "fsdp", "--mp-param-dtype", "bf16",
                 "--out", str(out), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert sum(printed["batch_sizes"]) == 96 and printed["world_size"] == 2
    assert any("bfloat16" in n for n in printed["notes"])
    assert ddp.DDPPlan.load(str(out)).batch_sizes == printed["batch_sizes"]
    # `dptune show` names FSDP2 in its header, not "DDP plan" / "DDP: buckets of 25 MiB"
    assert main(["show", str(out)]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].startswith("FSDP2 plan: MLP on 32GB,24GB")
    assert not any("DDP: buckets" in line for line in shown)
    assert any(line.startswith("FSDP2: fully_shard") and "bfloat16" in line for line in shown)
    assert main(["show", str(out), "--html", str(tmp_path / "p.html")]) == 0
    assert "<h1>dptune FSDP2 plan: MLP on 32GB,24GB</h1>" in (tmp_path / "p.html").read_text()
    capsys.readouterr()
    assert main(["plan", "--model", "dptune.examples.models:MLP", "--simulate", "32GB,24GB",
                 "--batch-size", "96", "--strategy", "fsdp", "--gradient-as-bucket-view"]) == 2
    assert "DDP's" in capsys.readouterr().err


@pytest.mark.slow
def test_fsdp_benchmark_exact_caps_agree_with_the_plan():
    """benchmarks/fsdp.py's exact caps (bisection on the simulated rank) are the plan's."""
    from benchmarks.fsdp import Case, exact_caps

    case = Case("tiny", "2x160MB,128MB,context=8MB", d_model=128, n_layers=2, seq_len=64)
    options = FSDPOptions()
    caps = exact_caps(Workload(case.model(), case.sample(), None, adamw), case.cluster, 0, options)
    plan = ddp.plan(case.model(), case.sample(), optimizer=adamw, objective="max_batch",
                    simulate=case.cluster, headroom=0, strategy="fsdp", budget_level="allocated")
    assert plan.certified and plan.batch_sizes == caps
    assert caps[0] == caps[1] > caps[2] >= 1
    assert not torch.distributed.is_initialized()
