"""benchmarks/probe_cost.py: one probe against a plain fake step, as the cards grow."""

from __future__ import annotations

import json

import pytest

from benchmarks import probe_cost


@pytest.mark.slow
def test_probe_cost_measures_the_plain_step_and_each_card_count(capsys):
    probe_cost.main(["--cards", "4,8", "--repeats", "1", "--per-card", "1", "--json"])
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(got) == {"plain", "probe@4", "probe@8"}
    assert all(isinstance(v, float) and v > 0 for v in got.values())


def test_probe_cost_refuses_an_unknown_model():
    with pytest.raises(SystemExit):
        probe_cost.main(["--model", "nope"])


def test_the_clock_is_the_same_for_this_checkout_and_the_other(monkeypatch, capsys):
    """``--clock cpu`` measures both checkouts in CPU seconds: the other run is asked for it."""
    calls = {}

    def elsewhere(path, argv):
        calls["argv"] = argv
        return {"plain": 2.0, "probe@4": 6.0}

    def measure(model, cards, repeats, per_card, clock):
        calls["clock"] = clock
        return {"plain": 1.0, "probe@4": 2.0}

    monkeypatch.setattr(probe_cost, "_run_elsewhere", elsewhere)
    monkeypatch.setattr(probe_cost, "measure", measure)
    probe_cost.main(["--clock", "cpu", "--against", "/elsewhere"])
    assert calls["clock"] == "cpu"
    assert calls["argv"][calls["argv"].index("--clock") + 1] == "cpu"
    out = capsys.readouterr().out
    assert "cpu seconds" in out
    probe_line = next(line for line in out.splitlines() if line.strip().startswith("probe@4"))
    # this: 2.0 s, 2x its plain step; the other: 6.0 s, 3x its own; speed-up 6.0 / 2.0
    assert probe_line.split() == ["probe@4", "2.000", "2.00", "6.000", "3.00", "3.00"]


def test_probe_cost_refuses_an_unknown_clock():
    with pytest.raises(SystemExit):
        probe_cost.main(["--clock", "sundial"])
