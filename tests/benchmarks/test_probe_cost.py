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
