"""The budget level and the three figures per card (allocated peak, reserved peak, total use)
in every rendering of a report: the terminal table, summary.md, report.json (torch's key
names), probes.csv and peaks.png; and the reserved level through the command line
(``--budget-level``, ``--allocator``, ``--nccl-bytes``) and the DDP planner.

The reserved-level report is built by hand from test_report's result: each probe's allocated
peaks stay as they were, card 0 reserves 30% more (a wide gap: the advice), cards 1..3 20 MiB
more, NCCL takes 1 GiB per card and the CUDA context is the cards' 300 MiB.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import uuid

import pytest
import torch
from torch import nn

from dptune.backends.base import ProbeResult
from dptune.budget import NCCL_CLIQUE_BYTES
from dptune.cli import main
from dptune.errors import EXIT_OK, EXIT_USAGE
from dptune.report import (budget_level, memory_stats, plot_result, probes_table, read_report,
                           render_summary, render_table, result_table, write_report)
from dptune.report.files import figure_dpi
from dptune.result.model import TuneResult, imbalance
from dptune.units import GiB, MiB, format_bytes

from plot_check import text_problems
from tests.report.test_report import make_result

NCCL = GiB
CONTEXT = 300 * MiB


def _reserved_probe(p: ProbeResult) -> ProbeResult:
    """``p`` as the tuner leaves it at the reserved level (hand-made allocator figures)."""
    alloc = p.peak_bytes
    reserved = tuple(int(a * 1.3) if i == 0 else a + 20 * MiB for i, a in enumerate(alloc))
    total = tuple(r + CONTEXT + NCCL for r in reserved)
    retries = tuple(2 if i == 1 else 0 for i in range(len(alloc)))
    stats = tuple({"allocated_bytes.all.peak": a, "reserved_bytes.all.peak": r,
                   "num_alloc_retries": n} for a, r, n in zip(alloc, reserved, retries))
    expandable = tuple(a + 2 * MiB for a in alloc)
    return dataclasses.replace(p, peak_bytes=tuple(r + NCCL for r in reserved),
                               allocated_peak_bytes=alloc, reserved_bytes=reserved,
                               total_bytes=total, alloc_retries=retries, memory_stats=stats,
                               expandable_reserved_bytes=expandable)


def reserved_result(objective: str = "balance") -> TuneResult:
    """test_report's result checked at the reserved level (see the module docstring)."""
    r = make_result(objective)
    probes = [_reserved_probe(p) if p.feasible else p for p in r.probes]
    best = next(p for p in reversed(probes) if list(p.chunk_sizes) == r.chunk_sizes)
    even_p = next(p for p in probes if p.chunk_sizes == r.even.chunk_sizes)
    even = dataclasses.replace(r.even, peak_bytes=even_p.peak_bytes,
                               imbalance=imbalance(even_p.peak_bytes, r.budget_bytes,
                                                   r.even.chunk_sizes))
    advice = [f"card 0: the caching allocator is predicted to reserve "
              f"{format_bytes(best.reserved_bytes[0])} for ...; with "
              f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it is predicted to reserve "
              f"{format_bytes(best.expandable_reserved_bytes[0])}"]
    budgets = [d.budget_bytes(256 * MiB) for d in r.devices]
    even = dataclasses.replace(even, imbalance=imbalance(even.peak_bytes, budgets,
                                                         even.chunk_sizes))
    return dataclasses.replace(r, probes=probes, peak_bytes=list(best.peak_bytes), even=even,
                               advice=advice, headroom_bytes=256 * MiB, budget_bytes=budgets)


def best_probe(r: TuneResult) -> ProbeResult:
    return next(p for p in reversed(r.probes) if list(p.chunk_sizes) == r.chunk_sizes)


@pytest.fixture(params=["balance", "max_batch"])
def reserved(request) -> TuneResult:
    return reserved_result(request.param)


# ---- the level and the figures ------------------------------------------------------------

def test_level_is_read_from_the_probes(reserved):
    assert budget_level(make_result()) == "allocated"
    assert budget_level(reserved) == "reserved"
    back = TuneResult.from_dict(reserved.to_dict())
    assert budget_level(back) == "reserved"


def test_table_shows_allocated_reserved_and_total_per_card(reserved):
    text = render_table(reserved)
    lines = text.splitlines()
    assert "budget level reserved" in lines[0]
    header = re.split(r"\s{2,}", lines[1].strip())
    assert header[4:8] == ["peak", "allocated", "reserved", "total use"]
    p = best_probe(reserved)
    for i in range(4):
        cells = re.split(r"\s{2,}", lines[2 + i].strip())
        assert cells[4:8] == [format_bytes(p.reserved_bytes[i] + NCCL),
                              format_bytes(p.allocated_peak_bytes[i]),
                              format_bytes(p.reserved_bytes[i]),
                              format_bytes(p.reserved_bytes[i] + CONTEXT + NCCL)]
    assert "budget level: reserved" in text and f"({format_bytes(NCCL)} per card)" in text
    assert "checked on one card only (an H200" in text and "not on several cards" in text
    assert "retried a cudaMalloc: close to running out, and slower): card 1: 2" in text


def test_summary_says_the_level_and_gives_the_advice(reserved):
    md = render_summary(reserved, plots=())
    assert "- budget level: reserved (peaks are the caching allocator's reserved peak plus " \
           "NCCL's buffers" in md
    assert "| allocated | reserved | total use |" in md
    assert "## Advice" in md and "expandable_segments:True" in md
    plain = render_summary(make_result(), plots=())
    assert "- budget level: allocated" in plain and "total use" not in plain


def test_report_json_has_torch_key_names_per_card(tmp_path, reserved):
    folder = write_report(reserved, tmp_path / "rep", plots=False)
    d = json.loads((folder / "report.json").read_text())
    assert d["budget_level"] == "reserved"
    p = best_probe(reserved)
    for i, ms in enumerate(d["memory_stats"]):
        assert ms["allocated_bytes.all.peak"] == p.allocated_peak_bytes[i]
        assert ms["reserved_bytes.all.peak"] == p.reserved_bytes[i]
        assert ms["num_alloc_retries"] == (2 if i == 1 else 0)
        assert ms["total_bytes"] == p.reserved_bytes[i] + CONTEXT + NCCL
    back = read_report(folder)            # the derived keys do not trouble the reader
    assert back.probes == reserved.probes and memory_stats(back) == d["memory_stats"]
    plain = json.loads((write_report(make_result(), tmp_path / "plain", plots=False)
                        / "report.json").read_text())
    assert plain["budget_level"] == "allocated"


def test_probes_csv_and_tables_carry_the_three_figures(reserved):
    df = probes_table(reserved)
    for k, p in enumerate(reserved.probes):
        for i in range(4):
            if p.allocated_peak_bytes is None:
                continue
            assert df[f"allocated_peak_bytes_{i}"][k] == p.allocated_peak_bytes[i]
            assert df[f"reserved_bytes_{i}"][k] == p.reserved_bytes[i]
            assert df[f"total_bytes_{i}"][k] == p.reserved_bytes[i] + CONTEXT + NCCL
            assert df[f"peak_bytes_{i}"][k] == p.reserved_bytes[i] + NCCL
    cards = result_table(reserved)
    p = best_probe(reserved)
    assert list(cards["allocated_peak_bytes"]) == list(p.allocated_peak_bytes)
    assert list(cards["total_use_bytes"]) == [r + CONTEXT + NCCL for r in p.reserved_bytes]


def test_peaks_plot_outlines_reserved_above_allocated(reserved):
    from matplotlib.patches import Rectangle

    fig = plot_result(reserved, "peaks")
    assert text_problems(fig, figure_dpi(fig)) == []
    ax = fig.axes[0]
    labels = ax.get_legend().get_texts()
    assert {"reserved peak", "total use (nvidia-smi), against the card's memory"} <= {
        t.get_text() for t in labels}
    outlines = sorted(round(r.get_height() * GiB) for r in ax.patches
                      if isinstance(r, Rectangle) and not r.get_fill()
                      and r.get_linestyle() == "--")
    p = best_probe(reserved)
    even = next(q for q in reserved.probes if q.chunk_sizes == reserved.even.chunk_sizes)
    want = sorted(list(p.reserved_bytes) + list(even.reserved_bytes))
    assert outlines == pytest.approx(want, abs=2)


# ---- the command line -----------------------------------------------------------------------

MODEL = '''
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(256, 1024)
        self.b = nn.Linear(1024, 16)

    def forward(self, x):
        return self.b(self.a(x).relu())
'''


@pytest.fixture
def model(tmp_path, monkeypatch):
    name = f"net_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    yield name
    sys.modules.pop(name, None)


def one_line(capsys, argv, *fragments):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("dptune: error:")]
    assert len(lines) == 1, err
    for f in fragments:
        assert f in lines[0], lines[0]


NOWHERE = ["--model", "no_such_module_anywhere:Net", "--input-shape", "16"]


@pytest.mark.parametrize("command", ["search", "plan"])
@pytest.mark.parametrize("flags, fragments", [
    (["--budget-level", "nvml"], ["--budget-level", "'nvml' is not a budget level"]),
    (["--budget-level", "reserved", "--allocator", "expandable_segments:maybe"],
     ["--allocator", "expandable_segments", "True or False"]),
    (["--budget-level", "reserved", "--allocator", "max_split_size_mb:4"],
     ["--allocator", "max_split_size_mb"]),
    (["--budget-level", "reserved", "--allocator", "no_such_option:1"], ["no_such_option"]),
    (["--budget-level", "reserved", "--nccl-bytes", "lots"], ["--nccl-bytes", "'lots'"]),
    (["--budget-level", "reserved", "--nccl-bytes", "-1GB"], ["--nccl-bytes"]),
    (["--budget-level", "reserved", "--nccl-bytes", str(10**30)], ["--nccl-bytes", "more than"]),
    (["--budget-level", "allocated", "--allocator", "expandable_segments:True"],
     ["--allocator applies only at --budget-level reserved", "drop --budget-level allocated"]),
    (["--budget-level", "allocated", "--nccl-bytes", "1GB", "--allocator", "expandable_segments:True"],
     ["--allocator and --nccl-bytes apply only at --budget-level reserved"]),
    # the reserved level is the default: the model's options need no --budget-level
    (["--allocator", "max_split_size_mb:4"], ["--allocator", "max_split_size_mb"]),
])
def test_bad_level_flags_are_one_line_before_any_work(capsys, command, flags, fragments):
    one_line(capsys, [command, *NOWHERE, "--batch-size", "8", "--simulate", "2x24GB", *flags],
             *fragments)


def test_allocator_environment_is_read_only_at_the_reserved_level(model, capsys, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "no_such_option:1")
    argv = ["search", "--model", f"{model}:Net", "--input-shape", "256", "--batch-size", "16",
            "--simulate", "2x24GB", "--max-probes", "3", "-q", "--no-plots"]
    assert main(argv + ["--out", "a", "--budget-level", "allocated"]) == EXIT_OK
    capsys.readouterr()
    one_line(capsys, argv + ["--out", "b", "--budget-level", "reserved"], "no_such_option")
    one_line(capsys, argv + ["--out", "c"], "PYTORCH_CUDA_ALLOC_CONF", "no_such_option",  # default
             "--budget-level allocated")


def test_search_at_the_reserved_level_writes_the_three_figures(model, capsys):
    argv = ["search", "--model", f"{model}:Net", "--input-shape", "256", "--batch-size", "16",
            "--simulate", "2x24GB", "--max-probes", "3", "--no-plots", "--out", "r",
            "--budget-level", "reserved", "--nccl-bytes", "100MiB",
            "--allocator", "expandable_segments:True"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "budget level reserved" in out and "total use" in out
    d = json.loads(open("r/report.json").read())
    assert d["budget_level"] == "reserved" and d["headroom_bytes"] == 256 * MiB
    cards = d["memory_stats"]
    for i, ms in enumerate(cards):
        assert ms["reserved_bytes.all.peak"] >= ms["allocated_bytes.all.peak"] > 0
        assert d["peak_bytes"][i] == ms["reserved_bytes.all.peak"] + 100 * MiB
        context = d["devices"][i]["context_bytes"]
        assert ms["total_bytes"] == ms["reserved_bytes.all.peak"] + 100 * MiB + context
    # no level flags: the reserved level is the default, NCCL's buffers by default
    assert main(argv[:-6] + ["--out", "d"]) == EXIT_OK
    d = json.loads(open("d/report.json").read())
    assert d["budget_level"] == "reserved" and d["headroom_bytes"] == 256 * MiB
    for i, ms in enumerate(d["memory_stats"]):
        # DataParallel on 2 cards: torch.cuda.comm's clique (NVIDIA/nccl #964, 2 devices)
        assert d["peak_bytes"][i] == ms["reserved_bytes.all.peak"] + NCCL_CLIQUE_BYTES[2]
    # asked for: the allocated level, only the allocated peak and the 1 GiB headroom
    assert main(argv[:-6] + ["--out", "a", "--budget-level", "allocated"]) == EXIT_OK
    d = json.loads(open("a/report.json").read())
    assert d["budget_level"] == "allocated" and d["memory_stats"] is None
    assert d["headroom_bytes"] == GiB


def test_allocator_model_options_on_real_cards_are_refused_not_ignored():
    from dptune.errors import UsageError
    from dptune.tuner import BackendChoice, Tuner

    real = BackendChoice(device_ids=[0])        # refused before any card is touched
    for opts in ({"allocator": "expandable_segments:True"}, {"nccl_bytes": "1GB"}):
        t = Tuner(nn.Linear(4, 4), lambda b: torch.randn(b, 4), 8, choice=real,
                  budget_level="reserved", verbose=False, **opts)
        with pytest.raises(UsageError, match="PYTORCH_CUDA_ALLOC_CONF in the environment"):
            t.fit()
    from dptune import ddp
    with pytest.raises(UsageError, match=r"allocator set the allocator model of simulated"):
        ddp.plan(nn.Linear(4, 4), lambda b: torch.randn(b, 4), global_batch=8,
                 budget_level="reserved", allocator="expandable_segments:True")


# ---- the DDP planner ------------------------------------------------------------------------

def net() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 16))


def batch(b: int) -> torch.Tensor:
    return torch.randn(b, 256)


def adamw(p):
    return torch.optim.AdamW(p)


@pytest.mark.slow
def test_plan_at_the_reserved_level_checks_reserved_plus_nccl():
    from dptune import ddp
    from dptune.budget import FixedCosts
    from dptune.backends.simulated.reserved import ReservedModel
    from dptune.backends.simulated.ddp import SimulatedDDP
    from dptune.step.workload import Workload

    spec = "2x12GB,used=0:11GB,used=1:10.5GB"
    nccl = 64 * MiB
    plan = ddp.plan(net, batch, optimizer=adamw, objective="max_batch", simulate=spec,
                    budget_level="reserved", nccl_bytes=nccl, max_rounds=24)
    assert plan.headroom_bytes == 256 * MiB
    assert any("reserved level" in n for n in plan.notes)
    # the oracle: SimulatedDDP's own per-rank probes with the allocator model
    sim = SimulatedDDP(Workload(net, batch, None, adamw), spec,
                       reserved=ReservedModel(fixed=FixedCosts(nccl)))
    devices = sim.devices

    def need(r: int, b: int) -> int:
        p = sim.rank(r).probe([b])
        return p.total_bytes[0] - devices[r].context_bytes

    for r in plan.ranks:
        assert r.measured_peak_bytes == need(r.rank, r.batch_size) <= r.budget_bytes
        assert need(r.rank, r.batch_size + 1) > r.budget_bytes     # one more is over, at this level
    # rank 0's figure falls past its first cap: the look past it on the allocator model finds it
    # within budget again, the planner raises it to the last batch of that window within budget
    # (measured, and one more over: above), certified on the model; the oracle's own probes
    # agree (over at the first cap + 1, within budget again further on)
    assert plan.certified
    note = next(n for n in plan.notes if n.startswith("past the caps the ranks' figures fall"))
    found = re.search(r"rank (\d+): over at batch (\d+), within budget again at batch (\d+) "
                      r"and last at batch (\d+) \(measured\)", note)
    assert found is not None
    rank, over_at, fits_at, last = map(int, found.groups())
    budget = plan.ranks[rank].budget_bytes
    assert need(rank, over_at) > budget >= need(rank, fits_at) and last >= fits_at > over_at
    assert plan.ranks[rank].batch_size == last and "certified on the allocator model" in note
    # equal local batches stop at the first cap
    assert plan.even_batch_size == 2 * min(over_at - 1, *(r.batch_size for r in plan.ranks
                                                           if r.rank != rank))
    plain = ddp.plan(net, batch, optimizer=adamw, objective="max_batch", simulate=spec,
                     headroom="256MiB", budget_level="allocated")
    assert plain.headroom_bytes == 256 * MiB
    assert plan.batch_sizes[1] < plain.batch_sizes[1]      # NCCL and caching cost card 1 samples
    sim.close()
