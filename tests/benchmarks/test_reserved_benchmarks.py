"""benchmarks/reserved.py and benchmarks/validate_reserved.py on the CPU."""

from __future__ import annotations

import pytest

from benchmarks import reserved as bench
from benchmarks import validate_reserved
from dptune.units import MiB


@pytest.mark.slow
def test_reserved_benchmark_rows_and_table():
    rows = bench.measure(["MLP"], "2x24GB", repeats=1, per_card=8)
    (row,) = rows
    assert row["events"] > 0 and row["replay_s"] > 0 and row["step_s"] > 0
    for a, r, t in zip(row["allocated"], row["reserved"], row["total"]):
        assert a <= r < t
    text = bench.table(rows)
    assert "| MLP | 0 |" in text and "replay / step" in text


def test_validate_reserved_without_a_gpu_says_so(capsys):
    assert validate_reserved.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_validate_reserved_estimate_runs_on_the_cpu():
    from benchmarks.validate_gpu import _cases, estimate_levels
    from dptune.backends.simulated import Cluster

    case = _cases()[0]
    cluster = Cluster.uniform(1, 80 * 1024 * MiB, context_bytes=500 * MiB)
    est = estimate_levels(case, case.batches[0], cluster)
    assert est["allocated"] <= est["reserved"] and est["total"] == est["reserved"] + 500 * MiB
    assert est["retries"] == 0
