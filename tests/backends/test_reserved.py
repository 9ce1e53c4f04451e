"""The allocator model on the simulator's traces (dptune.backends.simulated.reserved)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dptune.backends.simulated.allocator import AllocatorConfig, CachingAllocator, replay
from dptune.budget import NCCL_COMMUNICATOR_BYTES, FixedCosts
from dptune.backends.simulated.reserved import ReservedModel, TraceRecorder
from dptune.backends.simulated import SimulatedBackend
from dptune.examples.models import MLP, TinyGPT
from dptune.units import MiB
from dptune.step.workload import Workload


def mlp_workload() -> Workload:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1000, 2000), nn.ReLU(), nn.Linear(2000, 10))
    return Workload(m, lambda b: torch.randn(b, 1000), optimizer=lambda p: torch.optim.Adam(p))


def gpt_workload() -> Workload:
    torch.manual_seed(0)
    m = TinyGPT(n_layers=2)
    return Workload(m, m.sample, optimizer=lambda p: torch.optim.AdamW(p))


def backend(wl: Workload, spec: str = "2x24GB", conf: str = "", nccl=None) -> SimulatedBackend:
    model = ReservedModel(AllocatorConfig.parse(conf), FixedCosts(nccl_bytes=nccl))
    return SimulatedBackend(wl, spec, reserved=model)


@pytest.mark.parametrize("make", [mlp_workload, gpt_workload])
def test_model_off_leaves_todays_figures(make):
    plain = SimulatedBackend(make(), "2x24GB").probe([3, 5])
    on = backend(make()).probe([3, 5])
    assert on.peak_bytes == plain.peak_bytes and on.breakdown == plain.breakdown
    assert plain.reserved_bytes is None and plain.total_bytes is None
    assert on.reserved_bytes is not None


@pytest.mark.slow
def test_trace_is_the_ledger_and_reserved_covers_allocated_at_every_event():
    b = backend(gpt_workload())
    r = b.probe([4, 4])
    rec = b._recorder
    assert rec is not None
    for card, step in enumerate(b._step_trace):
        # the ledger's own peak over the step, from the trace: live bytes replayed in order,
        # each storage's own size (what the trace holds) rounded as the ledger counts it
        def counted(delta: int) -> int:
            return (1 if delta > 0 else -1) * -(-abs(delta) // 512) * 512
        live = sum(counted(e.delta) for e in rec.events[card])   # set-up bytes still alive
        peak = live
        for e in step:
            live += counted(e.delta)
            peak = max(peak, live)
        assert peak == r.peak_bytes[card]
        # replayed event by event: reserved >= allocated after every one
        a = CachingAllocator(1 << 40)
        for s, trace in enumerate((rec.events[card], step, step)):
            for e in trace:
                if e.delta > 0:
                    assert a.malloc((s, e.id), e.delta)
                else:
                    a.free((s, e.id)) if (s, e.id) in a.live else a.free((0, e.id))
                assert a.reserved >= a.allocated
    assert r.memory_stats is not None and r.reserved_bytes is not None
    for card, ms in enumerate(r.memory_stats):
        # the model's allocated peak counts whole unsplit blocks: never below the ledger's
        assert ms["reserved_bytes.all.peak"] >= ms["allocated_bytes.all.peak"] >= r.peak_bytes[card]
        assert ms["reserved_bytes.all.peak"] == r.reserved_bytes[card]


@pytest.mark.slow
def test_replay_is_deterministic():
    one, two = backend(mlp_workload()).probe([2, 6]), backend(mlp_workload()).probe([2, 6])
    assert one.memory_stats == two.memory_stats and one.total_bytes == two.total_bytes
    b = backend(gpt_workload())
    first, again = b.probe([2, 6]), b.probe([2, 6])
    assert first.memory_stats == again.memory_stats      # the set-up trace is not consumed


def test_total_is_reserved_plus_context_plus_nccl():
    b = backend(mlp_workload(), "2x24GB,context=300MiB")
    r = b.probe([8, 8])
    assert r.reserved_bytes is not None and r.total_bytes is not None
    # DataParallel on 2 cards: torch.cuda.comm's one clique (nccl #964's 2-device figure)
    assert r.total_bytes == tuple(x + 300 * MiB + 544 * 10**6 for x in r.reserved_bytes)
    four = backend(mlp_workload(), "3x24GB,context=0MiB").probe([8, 8, 8])
    assert four.total_bytes == tuple(x + 688 * 10**6 for x in four.reserved_bytes)
    one = backend(mlp_workload(), "1x24GB,context=300MiB").probe([8])
    assert one.total_bytes == (one.reserved_bytes[0] + 300 * MiB,)      # no NCCL on one card
    set_ = backend(mlp_workload(), "2x24GB,context=0MiB", nccl=5 * MiB).probe([8, 8])
    assert set_.total_bytes == tuple(x + 5 * MiB for x in set_.reserved_bytes)


def test_reserved_over_the_card_is_an_oom_of_the_probe():
    wl = mlp_workload()
    peak = SimulatedBackend(wl, "1x24GB").probe([8]).peak_bytes[0]
    # a card with room for the allocated peak but not for 20 MiB segments around it
    spec = f"1x{(peak + 4 * MiB) // 1024}KiB,context=0MiB"
    plain = SimulatedBackend(wl, spec).probe([8])
    assert plain.feasible
    r = backend(wl, spec).probe([8])
    assert not r.feasible and r.oom_device == 0
    assert r.alloc_retries is not None and r.alloc_retries[0] >= 1


def test_a_step_that_retries_reads_what_it_needs():
    """Where the allocator had to free its cache and retry a cudaMalloc, the reserved figure
    is the step's need (the replay without a limit), not the lower peak after the retry: the
    post-retry peak depends on fragmentation, so a larger step that retries could read lower
    than a smaller one, and the level's figure would not grow with the work."""
    wl = mlp_workload()
    need = backend(wl, "1x24GB,context=0MiB").probe([8])
    assert need.alloc_retries == (0,) and need.reserved_bytes is not None
    cap = need.peak_bytes[0] + 27 * MiB        # room for the step only after a retry
    r = backend(wl, f"1x{cap // 1024}KiB,context=0MiB").probe([8])
    assert r.alloc_retries is not None and r.alloc_retries[0] >= 1
    assert r.reserved_bytes == need.reserved_bytes and need.reserved_bytes[0] > cap


def test_recorder_cut_keeps_setup():
    rec = TraceRecorder(1)
    rec(0, 512, 1)
    mark = rec.mark()
    rec(0, 1024, 2)
    rec(0, -1024, 2)
    step = rec.cut(mark)
    assert [e.id for e in rec.events[0]] == [1] and [e.delta for e in step[0]] == [1024, -1024]
    s = replay([rec.events[0], step[0], step[0]], 1 << 40, measure_from=2)
    assert s.allocated_peak == 512 + 1024 and s.reserved_peak == 2 * MiB


def test_small_mlp_example_runs():
    m = MLP()
    r = SimulatedBackend(Workload(m, m.sample), "2x24GB", reserved=ReservedModel()).probe([4, 4])
    assert r.reserved_bytes is not None and all(x > 0 for x in r.reserved_bytes)


# -- the budget level in the tuner -----------------------------------------------------------------
@pytest.mark.slow
def test_tuner_reserved_level_checks_reserved_plus_nccl():
    from dptune.budget import DEFAULT_HEADROOM, BudgetLevel
    from dptune.tuner import Tuner

    wl = mlp_workload()
    kw = dict(simulate="2x1GB,context=0MiB", objective="max_batch", verbose=False, max_probes=6)
    plain = Tuner(wl.model, wl.sample, 64, optimizer=wl.optimizer, headroom="64MiB",
                  budget_level="allocated", **kw)
    res = Tuner(wl.model, wl.sample, 64, optimizer=wl.optimizer, headroom="64MiB",
                nccl_bytes="100MiB", **kw)                  # the reserved level is the default
    assert plain.headroom_bytes == 64 * MiB and plain.reserved_model is None
    assert res.budget_level is BudgetLevel.RESERVED and res.reserved_model is not None
    assert Tuner(wl.model, wl.sample, 8).headroom_bytes == 256 * MiB
    assert Tuner(wl.model, wl.sample, 8, budget_level="allocated").headroom_bytes == \
        DEFAULT_HEADROOM[BudgetLevel.ALLOCATED] == 1024 * MiB
    a, r = plain.fit(), res.fit()
    for p in r.probes:
        assert p.allocated_peak_bytes is not None and p.reserved_bytes is not None
        assert p.peak_bytes == tuple(x + 100 * MiB for x in p.reserved_bytes)
        assert all(x >= y for x, y in zip(p.peak_bytes, p.allocated_peak_bytes))
    assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))
    # the reserved level costs at least NCCL's 100 MiB per card: a smaller batch fits
    assert sum(r.chunk_sizes) < sum(a.chunk_sizes)
    assert any("reserved level" in n for n in r.notes)


def test_budget_level_errors_and_real_card_figures():
    from dptune.backends.base import Device, ProbeResult
    from dptune.budget import BudgetLevel, at_level
    from dptune.errors import BackendUnavailableError, UsageError
    from dptune.tuner import Tuner

    with pytest.raises(UsageError, match="budget level"):
        Tuner(nn.Linear(2, 2), lambda b: torch.randn(b, 2), 8, budget_level="nvml")
    devs = [Device(0, "x", 10 * 2**30, context_bytes=400 * MiB)]
    measured = ProbeResult((4,), (100 * MiB,), reserved_bytes=(140 * MiB,))
    got = at_level(measured, devs, BudgetLevel.RESERVED)
    assert got.peak_bytes == (140 * MiB,) and got.allocated_peak_bytes == (100 * MiB,)
    assert at_level(measured, devs, BudgetLevel.ALLOCATED) is measured
    with pytest.raises(BackendUnavailableError, match="reserved figures"):
        at_level(ProbeResult((4,), (1,)), devs, BudgetLevel.RESERVED)


def test_advice_names_the_expandable_segments_figure():
    from dptune.backends.base import ProbeResult
    from dptune.backends.simulated.reserved import advice_lines

    stats = ({"allocated_bytes.all.peak": 1024 * MiB, "reserved_bytes.all.peak": 1700 * MiB},
             {"allocated_bytes.all.peak": 1024 * MiB, "reserved_bytes.all.peak": 1100 * MiB})
    r = ProbeResult((1, 1), (1, 1), memory_stats=stats,
                    expandable_reserved_bytes=(1536 * MiB, 1040 * MiB))
    lines = advice_lines(r)
    assert len(lines) == 1 and lines[0].startswith("card 0")      # card 1's gap is small
    assert "expandable_segments:True" in lines[0] and lines[0].endswith("reserve 1.5 GiB")
    assert advice_lines(ProbeResult((1,), (1,))) == []


def _deep(n: int, layers: int = 30) -> list:
    from dptune.backends.simulated.allocator import Event
    ev = [Event(k, n * 12 * MiB) for k in range(layers)]      # kept for the backward
    return ev + [Event(k, -1) for k in reversed(range(layers))]


def test_wide_gap_computes_the_expandable_prediction():
    from dptune.backends.base import Device

    card = [Device(0, "x", 80 * 2**30)]
    same = ReservedModel().predict([_deep(8)], [_deep(8)], card)
    assert same.wide_gap() == [] and same.expandable is None        # segments reused exactly
    # the set-up left segments for batch 8, the step runs at 9: every one is 12 MiB short
    grown = ReservedModel().predict([_deep(8)], [_deep(9)], card)
    s = grown.stats[0]
    assert s.allocated_peak == 30 * 9 * 12 * MiB
    assert s.reserved_peak == 30 * 8 * 12 * MiB + 30 * 9 * 12 * MiB     # nothing fits: all new
    assert grown.wide_gap() == [0] and grown.expandable is not None
    # expandable segments: one segment, pages of 20 MiB, the batch-8 pages reused
    assert grown.expandable[0].reserved_peak == 20 * MiB * -(-s.allocated_peak // (20 * MiB))


def test_input_chunks_from_the_host_are_on_the_copy_stream():
    host = backend(mlp_workload())
    host.probe([8, 8])
    on_card0 = SimulatedBackend(mlp_workload(), "2x24GB", batch_on_card0=True,
                                reserved=ReservedModel())
    on_card0.probe([8, 8])
    x_chunk = 8 * 1000 * 4       # one card's chunk of the batch (the trace holds the storage's
    #                              own size; the replay rounds it as the allocator does)
    streamed = [e for e in host._step_trace[1] if e.stream == 1]
    assert [e.delta for e in streamed] == [x_chunk]
    assert all(e.stream == 0 for card in on_card0._step_trace for e in card)


def test_warmup_traces_of_other_shapes():
    from dptune.backends.base import Device

    card = [Device(0, "x", 80 * 2**30)]
    plain = ReservedModel().predict([[]], [_deep(9)], card)
    varied = ReservedModel().predict([[]], [_deep(9)], card, warmup=[[_deep(8)], [_deep(10)]])
    # after a batch-10 step every batch-9 block fits a cached batch-10 block: no new segment,
    # but the batch-8 and batch-10 segments stay reserved
    assert plain.stats[0].reserved_peak == 30 * 9 * 12 * MiB
    assert varied.stats[0].reserved_peak == 30 * (8 + 10) * 12 * MiB
    # each 108 MiB request splits a cached 120 MiB block (remainder 12 MiB > kSmallSize)
    assert varied.stats[0].allocated_peak == 30 * 9 * 12 * MiB


def test_ddp_ranks_get_reserved_and_nccl_figures():
    from dptune.backends.simulated.ddp import SimulatedDDP

    wl = mlp_workload()
    plain = SimulatedDDP(wl, "2x24GB,context=0MiB").probe([8, 16])
    model = ReservedModel(fixed=FixedCosts(nccl_bytes=None))
    sim = SimulatedDDP(mlp_workload(), "2x24GB,context=0MiB", reserved=model)
    r = sim.probe([8, 16])
    assert r.peak_bytes == plain.peak_bytes and r.chunk_sizes == (8, 16)   # figures unchanged
    assert plain.reserved_bytes is None
    assert r.reserved_bytes is not None and r.total_bytes is not None and r.memory_stats is not None
    # every rank is one NCCL rank of a world of two: the process group's communicator, more
    # than DataParallel's clique
    assert r.total_bytes == tuple(x + NCCL_COMMUNICATOR_BYTES for x in r.reserved_bytes)
    assert NCCL_COMMUNICATOR_BYTES > FixedCosts().nccl_for(2)
    for card, ms in enumerate(r.memory_stats):
        assert ms["reserved_bytes.all.peak"] >= ms["allocated_bytes.all.peak"] >= r.peak_bytes[card]
    one = SimulatedDDP(mlp_workload(), "1x24GB,context=0MiB", reserved=model).probe([8])
    assert one.total_bytes == one.reserved_bytes                           # no NCCL alone


def test_report_json_keeps_the_allocator_figures(tmp_path):
    from dptune.result.model import TuneResult
    from dptune.tuner import Tuner

    wl = mlp_workload()
    res = Tuner(wl.model, wl.sample, 16, optimizer=wl.optimizer, simulate="2x24GB", verbose=False,
                budget_level="reserved", max_probes=3).fit()
    d = res.to_dict()
    probe = d["probes"][0]
    assert set(probe["memory_stats"][0]) >= {"allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                              "num_alloc_retries"}
    back = TuneResult.from_dict(d)
    for a, b in zip(res.probes, back.probes):
        assert (a.memory_stats, a.total_bytes, a.allocated_peak_bytes, a.reserved_bytes) == \
               (b.memory_stats, b.total_bytes, b.allocated_peak_bytes, b.reserved_bytes)


@pytest.mark.slow
def test_steps_of_changing_batch_fragment_by_default_not_with_expandable_segments():
    # the allocator note's scenario on the simulator's own traces: a batch that changes
    # slightly from step to step in a transformer
    from dptune.backends.simulated.reserved import predict_steps

    torch.manual_seed(0)
    m = TinyGPT(n_layers=2)
    b = SimulatedBackend(Workload(m, m.sample, optimizer=lambda p: torch.optim.AdamW(p)), "1x24GB",
                         reserved=ReservedModel())
    same = predict_steps(b, [[16], [16]]).stats[0]
    varied = predict_steps(b, [[17], [14], [18], [16]])
    grown = varied.stats[0]
    expandable = predict_steps(b, [[17], [14], [18], [16]],
                               ReservedModel(AllocatorConfig(expandable_segments=True))).stats[0]
    assert grown.allocated_peak == same.allocated_peak          # the measured step is the same
    assert grown.reserved_peak > 1.25 * same.reserved_peak       # slivers of other shapes
    assert expandable.reserved_peak < grown.reserved_peak
    assert varied.wide_gap() == [0] and varied.expandable is not None
    assert varied.expandable[0].reserved_peak == expandable.reserved_peak
    with pytest.raises(Exception, match="allocator model"):
        predict_steps(SimulatedBackend(Workload(m, m.sample), "1x24GB"), [[4]])


def test_real_card_probe_reports_torch_key_names_and_the_reserved_level():
    # the CUDA backend on test_cuda_backend's fake runtime: its measured figures under
    # torch.cuda.memory_stats()'s names, and the reserved level checks max_memory_reserved
    from dptune.budget import BudgetLevel, at_level
    from tests.backends.cuda.test_cuda_backend import FakeRuntime, backend as cuda_backend

    rt = FakeRuntime()
    b = cuda_backend(rt)
    r = b.probe([3, 5])
    assert r.memory_stats is not None and r.reserved_bytes is not None and r.alloc_retries is not None
    for card in range(2):
        assert r.memory_stats[card] == {"allocated_bytes.all.peak": r.peak_bytes[card],
                                        "reserved_bytes.all.peak": r.reserved_bytes[card],
                                        "num_alloc_retries": r.alloc_retries[card]}
    level = at_level(r, b.devices, BudgetLevel.RESERVED)
    assert level.peak_bytes == r.reserved_bytes and level.allocated_peak_bytes == r.peak_bytes


def test_recorder_moves_frees_of_setup_storages_to_the_setup_after_the_probe():
    rec = TraceRecorder(1)
    rec(0, 4 * MiB, 1)                 # set-up: a buffer
    mark = rec.mark()
    rec(0, 4 * MiB, 2)                 # the step replaces it
    rec(0, -4 * MiB, 1)
    step = rec.cut(mark)
    # this probe's replay: the buffer is alive until the step frees it
    assert [e.delta for e in rec.events[0]] == [4 * MiB]
    s = replay([rec.events[0], step[0], step[0]], 1 << 40, measure_from=2)
    assert s.allocated_peak == 8 * MiB
    rec.mark()                         # the next probe starts from the buffer gone
    assert [(e.id, e.delta) for e in rec.events[0]] == [(1, 4 * MiB), (1, -4 * MiB)]


def test_allocator_environment_read_only_at_the_reserved_level(monkeypatch):
    from dptune.errors import SpecError
    from dptune.tuner import Tuner

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    m = nn.Linear(2, 2)
    low = Tuner(m, lambda b: torch.randn(b, 2), 8, budget_level="allocated")
    assert low.reserved_model is None                          # not read at the allocated level
    for level in ({}, {"budget_level": "reserved"}):          # the reserved level is the default
        with pytest.raises(SpecError, match="PYTORCH_CUDA_ALLOC_CONF: .*native.*--budget-level allocated"):
            Tuner(m, lambda b: torch.randn(b, 2), 8, **level)
    t = Tuner(m, lambda b: torch.randn(b, 2), 8, budget_level="reserved",
              allocator="expandable_segments:True")
    assert t.reserved_model is not None and t.reserved_model.config.expandable_segments
