"""A 2-rank gloo DDP job, each rank watching its own fake card against an uneven per-rank
plan, with no collective while the monitor runs; ``dptune show`` merges both ranks' files."""

from __future__ import annotations

import pytest

from dptune.monitor import EventKind, load_run

import monitor_workers
from ddp_workers import launch
from fake_cards import probe_peak


@pytest.mark.slow
def test_each_rank_writes_its_own_card_and_show_merges_them(tmp_path, capsys):
    from dptune.cli import main

    out = launch(2, [("monitored", {"run_dir": str(tmp_path)})], scenarios=monitor_workers.SCENARIOS)
    for rank in (0, 1):
        assert "error" not in out[rank]["monitored"], out[rank]["monitored"].get("traceback")
    # each rank its own slot in the plan (its rank) and its own file
    assert [c["slot"] for r in (0, 1) for c in out[r]["monitored"]["cards"]] == [0, 1]
    assert sorted(p.name for p in tmp_path.glob("timeline.rank*.jsonl")) == ["timeline.rank0.jsonl",
                                                                              "timeline.rank1.jsonl"]
    rec = load_run(tmp_path)
    assert rec.ranks == [0, 1]
    assert [(r["rank"], r["step"], r["batch_size"], r["predicted_peak_bytes"]) for r in rec.rows] == \
        [(0, s, 4, probe_peak(4, 128)) for s in (1, 2, 3)] + [(1, s, 6, probe_peak(6, 128)) for s in (1, 2, 3)]
    # the grown length drifts on rank 1 only, at its third step
    assert [(e.rank, e.step, e.kind) for e in rec.events] == [(1, 3, EventKind.DRIFT)]
    assert out[0]["monitored"]["warnings"] == []
    assert "rank 1 card 0, step 3, batch 6 x length 200" in out[1]["monitored"]["warnings"][0]
    assert main(["show", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "2 rank(s), 2 card(s)" in text and "rank 0 card 0" in text and "rank 1 card 0" in text
    assert (tmp_path / "timeline.png").stat().st_size > 0
