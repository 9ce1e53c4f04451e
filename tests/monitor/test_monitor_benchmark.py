"""The overhead benchmark and the example recorder run (tiny settings); what they report is
checked for its form and its invariants, never against a wall-clock figure."""

from __future__ import annotations

from benchmarks import monitor_overhead


def test_the_overhead_benchmark_reports_both_shares():
    m = monitor_overhead.measure(cards=2, steps=6, repeats=1, width=16, batch=2)
    assert m["monitor_s"] > 0 and m["step_s"] > 0
    assert m["monitor_share"] == m["monitor_s"] / m["step_s"]
    assert "% of the step" in monitor_overhead.render(m)


def test_the_fake_cards_answer_as_many_keys_as_a_real_card():
    stats = monitor_overhead.full_stats({"num_ooms": 3})
    assert len(stats) == 118 and stats["num_ooms"] == 3 and stats["allocated_bytes.all.peak"] == 0


def test_the_example_records_every_kind_of_event(tmp_path):
    from benchmarks import monitor_example
    from dptune.monitor import EventKind, load_run

    monitor_example.record(tmp_path / "run")
    rec = load_run(tmp_path / "run")
    seen = {(e.kind, e.card, e.step) for e in rec.events}
    assert seen == {(EventKind.OFF_PLAN, 0, 30), (EventKind.DRIFT, 0, 30), (EventKind.OFF_PLAN, 1, 30),
                    (EventKind.DRIFT, 1, 30), (EventKind.HEADROOM, 1, 41), (EventKind.FRAGMENTATION, 0, 55),
                    (EventKind.OOM, 1, 70)}
    assert rec.ooms[0]["length"] == 640 and rec.metas[0]["finished"] is True
