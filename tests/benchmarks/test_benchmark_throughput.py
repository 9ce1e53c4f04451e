"""benchmarks/throughput.py on a tiny model: the fastest split measured is never slower than
the even split (the even split is one of the probes it chooses from)."""

from __future__ import annotations

from benchmarks import config, throughput
from dptune.examples.models import MLP


def test_tiny_case_and_table(monkeypatch):
    tiny = config.ModelSpec("Tiny", lambda: MLP(in_features=64, hidden=256, depth=1), "tiny MLP", 16)
    monkeypatch.setitem(config.MODELS, "Tiny", tiny)
    row = throughput.run_case("Tiny", "RTX4090,T4")
    assert row.batch == 32 and sum(row.fastest_split) == 32
    assert row.fastest_sps >= row.even_sps > 0
    assert row.dropped == [i for i, c in enumerate(row.fastest_split) if c == 0]
    text = throughput.table([row])
    assert "| Tiny | RTX4090,T4 | 32 |" in text


def test_tiny_global_batch_case_and_table(monkeypatch):
    """The plan for a global batch of 128 is never slower than the even split of the usual batch
    (32) repeated 4 times: the even split is one of the probes it chooses from."""
    tiny = config.ModelSpec("Tiny", lambda: MLP(in_features=64, hidden=256, depth=1), "tiny MLP", 16)
    monkeypatch.setitem(config.MODELS, "Tiny", tiny)
    row = throughput.run_global("Tiny", "RTX4090,T4", 128)
    assert row.batch == 32 and row.micro_batches * sum(row.split) == 128
    assert row.seconds <= row.even_seconds * (1 + 1e-9)
    text = throughput.global_table([row])
    assert "| Tiny | RTX4090,T4 | 128 | 4 x [16/16]" in text
