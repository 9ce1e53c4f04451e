"""FSDP plans and ``--lengths`` plans at the reserved level (the default): each rank's / each
bucket's probe replayed through the allocator model, checked against fresh simulations with
the model and, for the FSDP trace, against the caching allocator replayed event by event."""

from __future__ import annotations

import pytest
import torch

from dptune import ddp
from dptune.backends.simulated.allocator import CachingAllocator
from dptune.hardware.cluster import parse_cluster
from dptune.budget import FixedCosts
from dptune.backends.simulated.reserved import ReservedModel
from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.ddp import card_of
from dptune.backends.simulated.fsdp import SimulatedFSDPRank
from dptune.ddp.fsdp import FSDPOptions
from dptune.examples.models import TinyGPT
from dptune.lengths import plan_lengths
from dptune.units import MiB
from dptune.step.workload import Workload
from fsdp_models import MLPStack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

NCCL = 2 * MiB
MODEL = ReservedModel(fixed=FixedCosts(NCCL))


# ---- FSDP ---------------------------------------------------------------------------------
FSDP_SPEC = "2x160MB,128MB,context=8MB"


def mlp() -> MLPStack:
    return MLPStack(dim=256, depth=4)


def seqs(b: int) -> torch.Tensor:
    return torch.randn(b, 64, 256)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _fsdp_rank(spec: str, rank: int, reserved=MODEL) -> SimulatedFSDPRank:
    cluster = parse_cluster(spec)
    return SimulatedFSDPRank(Workload(mlp, seqs, None, adamw), card_of(cluster, rank), len(cluster),
                             FSDPOptions().shard_fn(), reserved=reserved)


@pytest.mark.slow
def test_fsdp_rank_trace_follows_the_resized_storages():
    """The rank's trace (FSDP2's storage resizes as a free and a new block) summed in order
    is the ledger's own peak, and the allocator keeps reserved >= allocated at every event."""
    sim = _fsdp_rank(FSDP_SPEC, 0)
    try:
        r = sim.probe([3])
        rec = sim._recorder
        assert rec is not None and r.reserved_bytes is not None and r.total_bytes is not None
        setup, step = rec.events[0], sim._step_trace[0]
        def counted(delta: int) -> int:   # the storage's own size, as the ledger rounds it
            return (1 if delta > 0 else -1) * -(-abs(delta) // 512) * 512
        live = sum(counted(e.delta) for e in setup)
        peak = live
        for e in step:
            live += counted(e.delta)
            peak = max(peak, live)
        assert peak == r.peak_bytes[0]
        a = CachingAllocator(1 << 40)
        for s, trace in enumerate((setup, step, step)):
            for e in trace:
                if e.delta > 0:
                    assert a.malloc((s, e.id), e.delta)
                else:
                    a.free((s, e.id)) if (s, e.id) in a.live else a.free((0, e.id))
                assert a.reserved >= a.allocated
        assert r.reserved_bytes[0] >= r.peak_bytes[0]
        assert r.total_bytes[0] == r.reserved_bytes[0] + sim.devices[0].context_bytes + NCCL
    finally:
        sim.close()


@pytest.mark.slow
def test_fsdp_plan_at_the_reserved_level_checks_reserved_plus_nccl():
    plan = ddp.plan(mlp, seqs, optimizer=adamw, objective="max_batch", simulate=FSDP_SPEC,
                    headroom=0, strategy="fsdp", nccl_bytes=NCCL)    # the default level
    assert plan.certified and any("reserved level" in n for n in plan.notes)
    low = ddp.plan(mlp, seqs, optimizer=adamw, objective="max_batch", simulate=FSDP_SPEC,
                   headroom=0, strategy="fsdp", budget_level="allocated")
    budgets = [d.budget_bytes(0) for d in parse_cluster(FSDP_SPEC).devices]
    for r in (0, 2):          # one rank per card type, each checked by a fresh simulation
        sim = _fsdp_rank(FSDP_SPEC, r)
        try:
            def need(b: int, sim: SimulatedFSDPRank = sim) -> int:
                p = sim.probe([b])
                assert p.reserved_bytes is not None
                return p.reserved_bytes[0] + NCCL

            b = plan.batch_sizes[r]
            assert need(b) <= budgets[r] < need(b + 1)
            assert plan.ranks[r].measured_peak_bytes == need(b)
        finally:
            sim.close()
        assert plan.batch_sizes[r] <= low.batch_sizes[r]    # the cache and NCCL cost samples
    assert not torch.distributed.is_initialized()


# ---- --lengths ----------------------------------------------------------------------------
V = 500
LENGTHS = [20] * 5 + [32] * 4 + [64] * 4 + [128] * 2
LEN_SPEC = "1x415MB,1x425MB,context=384MiB"      # budgets of about 12 and 22 MB


def gpt():
    return TinyGPT(vocab_size=V, d_model=32, n_layers=1, n_heads=2, seq_len=128)


def gpt_sample(n, length):
    return torch.randint(0, V, (n, length))


def _fits(r, budgets) -> bool:
    """An independent reading of the reserved level: reserved peak + NCCL within the budget
    on card 0 and on every card given samples."""
    assert r.reserved_bytes is not None
    return r.feasible and all(res + NCCL <= b for i, (res, b, c) in enumerate(
        zip(r.reserved_bytes, budgets, r.chunk_sizes)) if i == 0 or c > 0)


@pytest.mark.slow
def test_lengths_buckets_at_the_reserved_level_equal_exhaustive():
    # the default level; reserved peaks rise in whole segments: more probes to certify
    plan = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=LEN_SPEC, headroom=0,
                        nccl_bytes=NCCL, max_probes=32)
    low = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=LEN_SPEC, headroom=0,
                       budget_level="allocated")
    assert any("reserved level" in n for n in plan.notes)
    assert not any("reserved level" in n for n in low.notes)
    for bucket, other in zip(plan.buckets, low.buckets):
        backend = SimulatedBackend(Workload(gpt, lambda n, L=bucket.length: gpt_sample(n, L)),
                                   LEN_SPEC, reserved=MODEL)
        budgets = [d.budget_bytes(0) for d in backend.devices]
        b = bucket.batch_size
        assert b >= 1 and bucket.certified and b <= other.batch_size
        assert _fits(backend.probe(list(bucket.chunk_sizes)), budgets)
        if bucket is plan.buckets[-1]:     # the longest (smallest batch): every split of one
            for c0 in range(b + 2):        # more sample, none fits
                assert not _fits(backend.probe([c0, b + 1 - c0]), budgets), (bucket.length, c0)
        backend.close()


@pytest.mark.slow
def test_lengths_ddp_ranks_at_the_reserved_level():
    from dptune.backends.simulated.ddp import SimulatedDDP

    plan = plan_lengths(gpt, gpt_sample, LENGTHS, [32, 64], simulate=LEN_SPEC, headroom=0,
                        ddp=True, nccl_bytes=NCCL, max_probes=32)
    assert plan.ddp and plan.certified
    for bucket in plan.buckets:
        sim = SimulatedDDP(Workload(gpt, lambda n, L=bucket.length: gpt_sample(n, L)), LEN_SPEC,
                           reserved=MODEL)

        def need(r: int, b: int, sim: SimulatedDDP = sim) -> int:
            p = sim.rank(r).probe([b])
            assert p.reserved_bytes is not None
            return p.reserved_bytes[0] + NCCL

        for r, b in enumerate(bucket.chunk_sizes):
            budget = sim.devices[r].budget_bytes(0)
            assert b >= 1 and need(r, b) <= budget < need(r, b + 1)
            assert bucket.peak_bytes[r] == need(r, b)
        sim.close()


def test_lengths_allocator_options_on_real_cards_are_refused(monkeypatch):
    import dptune.backends.choice as choice_mod
    from dptune.errors import UsageError

    # real cards chosen (none is built: the options are refused before any card is touched)
    monkeypatch.setattr(choice_mod, "choose_backend",
                        lambda *a: choice_mod.BackendChoice(device_ids=[0]))
    monkeypatch.setattr(choice_mod, "build_backend", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(UsageError, match="allocator set the allocator model of simulated"):
        plan_lengths(gpt, gpt_sample, [8, 16], 2, device_ids=[0],
                     allocator="expandable_segments:True")


# ---- the throughput objective -------------------------------------------------------------
@pytest.mark.slow
def test_throughput_search_probes_at_the_budget_level():
    """The timed probes of objective="throughput" are checked at the reserved level too."""
    from torch import nn

    from dptune import Tuner

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    r = Tuner(m, lambda b: torch.randn(b, 256), batch_size=64, simulate="2x24GB",
              objective="throughput", nccl_bytes=NCCL, max_probes=4, verbose=False).fit()
    assert any(p.time is not None for p in r.probes)
    for p in r.probes:
        assert p.allocated_peak_bytes is not None and p.reserved_bytes is not None
        assert p.peak_bytes == tuple(x + NCCL for x in p.reserved_bytes)
    assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))
