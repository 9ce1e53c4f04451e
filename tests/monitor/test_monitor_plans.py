"""The monitor with each kind of plan (a search result, a per-rank plan, a saved plan's path),
without a GPU (untouched, one warning), and ``dptune show RUN`` on good and damaged folders."""

from __future__ import annotations

import json
import pathlib
import warnings

import pytest
import torch
import torch.nn as nn

from dptune.ddp.result import DDPPlan, RankPlan
from dptune.monitor import EventKind, MemoryMonitor, MonitorWarning, load_run
from dptune.monitor.expect import PlanKind, expectation
from dptune.result.model import load_result
from dptune.solve.memory import Fit

from fake_cards import GiB, MiB, FakeCards, train_step

REPORT = pathlib.Path(__file__).resolve().parents[2] / "reports" / "TinyGPT-4x24GB"


def test_a_search_result_predicts_its_split_and_fits_other_batches():
    result = load_result(REPORT)
    exp = expectation(result)
    assert exp.kind is PlanKind.SPLIT and exp.slots == 4
    planned = [exp.expect(s, None, None).predicted for s in range(4)]
    assert planned == result.peak_bytes == [exp.expect(s, result.batch_size, 512).predicted for s in range(4)]
    smaller = [exp.expect(s, 400, None) for s in range(4)]
    for s in (1, 2, 3):          # cards that hold samples: less at a smaller batch, more than their fixed part
        assert result.fits[s].intercept_bytes < smaller[s].predicted < planned[s]
        assert smaller[s].off_plan == ""
    over = result.batch_size + 60
    assert f"batch {over} is over the planned {result.batch_size}" in exp.expect(1, over, None).off_plan
    assert [exp.budget(s) for s in range(4)] == result.budget_bytes


def test_a_saved_plans_path_is_read_and_the_monitor_takes_the_plans_cards():
    cards = FakeCards(n=6, total=24 * GiB)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mon = MemoryMonitor(str(REPORT), runtime=cards)
    assert [c.card for c in mon.cards] == [0, 1, 2, 3]          # the plan's four, not all six
    assert [c.budget_bytes for c in mon.cards] == load_result(REPORT).budget_bytes


def test_a_per_rank_plan_compares_each_rank_with_its_own_batch_and_fit():
    fit = Fit(intercept_bytes=2 * GiB, slope_bytes=100 * MiB)
    plan = DDPPlan(ranks=(RankPlan(rank=0, batch_size=8, loss_scale=1.0, budget_bytes=20 * GiB,
                                   predicted_peak_bytes=3 * GiB, fit=fit),
                          RankPlan(rank=1, batch_size=8, loss_scale=1.0, budget_bytes=20 * GiB,
                                   predicted_peak_bytes=3 * GiB, measured_peak_bytes=3 * GiB + 64 * MiB,
                                   fit=fit)))
    exp = expectation(plan)
    assert exp.expect(1, 8, None).predicted == 3 * GiB + 64 * MiB          # measured wins
    assert exp.expect(0, 4, None).predicted == 2 * GiB + 400 * MiB         # the fitted line
    assert "over rank 0's planned 8" in exp.expect(0, 12, None).off_plan
    cards = FakeCards(n=2, device=1)
    mon = MemoryMonitor(plan, runtime=cards, rank=1)
    assert [(c.card, c.slot) for c in mon.cards] == [(1, 1)]                # its own card, its rank's figures
    cards.alloc(1, 2 * GiB)
    with pytest.warns(MonitorWarning, match="card 1, step 1, batch 4"):
        with mon.step(batch_size=4):
            cards.alloc(1, 1 * GiB)                                          # 3 GiB > 2.39 GiB + margin
    assert [(e.kind, e.predicted_bytes) for e in mon.events] == [(EventKind.DRIFT, 2 * GiB + 400 * MiB)]


# ---- no GPU --------------------------------------------------------------------------------

def _train(monitor=None, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Dropout(0.2), nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(steps):
        x = torch.randn(8, 6)
        if monitor is None:
            model(x).pow(2).mean().backward()
        else:
            with monitor.step(batch_size=8, length=6):
                model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, torch.get_rng_state()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_the_monitor_warns_once_and_the_run_is_untouched(tmp_path):
    model_a, opt_a, rng_a = _train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = MemoryMonitor(run_dir=tmp_path / "run")     # the real CUDA runtime: no card here
        model_b, opt_b, rng_b = _train(mon)
        mon.close()
    mine = [w for w in caught if issubclass(w.category, MonitorWarning)]
    assert len(mine) == 1 and "no CUDA card is visible" in str(mine[0].message)
    assert all(torch.equal(a, b) for a, b in zip(model_a.state_dict().values(), model_b.state_dict().values()))
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in ("exp_avg", "exp_avg_sq"))
    assert torch.equal(rng_a, rng_b)
    assert not mon.active and mon.events == [] and mon.figures() == {}
    assert not (tmp_path / "run").exists()
    err = RuntimeError("CUDA out of memory. GPU 0")          # an error still goes on, the same one
    with pytest.raises(RuntimeError) as info:
        with mon.step():
            raise err
    assert info.value is err


# ---- dptune show ---------------------------------------------------------------------------

def _recorded(folder):
    cards = FakeCards(n=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MonitorWarning)
        mon = MemoryMonitor(runtime=cards, run_dir=folder)
        for k, n in enumerate((64, 128, 96)):
            with mon.step(batch_size=4, length=n):
                train_step(cards, 0, 4, n, setup=k == 0)
        mon.close()


def test_show_prints_the_summary_and_draws_the_timeline(tmp_path, capsys):
    from dptune.cli import main

    _recorded(tmp_path)
    assert main(["show", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "1 rank(s), 1 card(s), 3 step(s)" in text and "0 event(s)" in text
    assert (tmp_path / "timeline.png").stat().st_size > 0
    assert main(["show", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = data["rows"][1]
    assert row["step"] == 2 and row["length"] == 128
    assert all(isinstance(row[k], int) for k in ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
                                                  "num_alloc_retries", "num_ooms", "nvml_used_bytes"))


def test_a_torn_last_line_is_left_out_and_a_damaged_file_is_a_one_line_error(tmp_path, capsys):
    from dptune.cli import main

    _recorded(tmp_path)
    timeline = tmp_path / "timeline.rank0.jsonl"
    timeline.write_text(timeline.read_text() + '{"rank": 0, "card"')      # killed while writing
    assert len(load_run(tmp_path).rows) == 3
    (tmp_path / "monitor.rank0.json").write_text("{not json")
    assert main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "monitor.rank0.json: not a valid monitor file" in err and "Traceback" not in err
