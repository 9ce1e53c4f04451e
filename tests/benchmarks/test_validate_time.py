"""benchmarks/validate_time.py without a GPU: it says so; GPU names map to the card table;
the estimate half runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import validate_time
from dptune.examples.models import MLP
from dptune.hardware.speeds import CARD_SPEEDS


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert validate_time.main([]) == 0
    assert "unvalidated" in capsys.readouterr().out


@pytest.mark.parametrize("gpu, card", [
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"), ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ("NVIDIA GeForce RTX 2080 Ti", "RTX2080Ti"), ("NVIDIA RTX A6000", "A6000"),
    ("Tesla T4", "T4"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("NVIDIA H200", "H200"), ("Some Other GPU", None)])
def test_gpu_names_map_to_the_card_table(gpu, card):
    assert validate_time.card_name(gpu) == card
    assert card is None or card in CARD_SPEEDS


def test_the_estimate_half_runs_on_the_cpu():
    model = MLP(in_features=32, hidden=64, depth=1)
    t = validate_time.estimate(model, model.sample, 8, "RTX4090")
    assert 0 < t < 1


def test_the_fit_finds_the_constants_that_made_the_times():
    """Times made from known constants (ops of each dtype class, memory-bound ops, kernels):
    the fit gives those constants back."""
    from dptune.backends.simulated.timing import OpCost
    from dptune.hardware.speeds import Calibration

    speed = CARD_SPEEDS["H200"]
    true = Calibration({"fp32": 0.6, "tf32": 0.3, "fp16": 0.3, "bf16": 0.3}, 0.4, 9e-6, 30e-6)
    rows, sims = [], []
    for scale, (a, b, c, k) in enumerate([(1, 1, 1, 10), (30, 1, 1, 10), (1, 30, 1, 10), (1, 1, 30, 10),
                                          (1, 1, 1, 300), (10, 5, 20, 50)]):
        costs = (OpCost(a * 10**9, 10**6, "fp32", True), OpCost(b * 10**10, 10**6, "tf32", True),
                 OpCost(0, c * 10**7, "fp32", True)) + (OpCost(0, 10**4, "fp32", True),) * k
        sim = validate_time.Simulated(ops=100 + scale, costs=costs, copy_seconds=0.0)
        sims.append(sim)
        rows.append(dict(model="M", batch=scale, step_seconds=sim.step(speed, true),
                         kernel_seconds=sim.device(speed, true), host_seconds=sim.host(true)))
    got = validate_time.fit(rows, sims, speed)
    assert got.compute["fp32"] == pytest.approx(0.6, rel=0.05)
    assert got.compute["tf32"] == pytest.approx(0.3, rel=0.05)
    assert got.memory == pytest.approx(0.4, rel=0.05)
    assert got.kernel_seconds == pytest.approx(9e-6, rel=0.05)
    # the ops grow a little with the batch here: the host's cost is their geometric mean's
    assert got.host_seconds_per_op == pytest.approx(30e-6, rel=0.02)


def test_the_cpu_mode_rescores_measured_facts(tmp_path, monkeypatch, capsys):
    import gzip
    import json

    facts = tmp_path / "time.json.gz"
    row = dict(model="MLP", batch=2, step_seconds=0.003, host_seconds=0.002, kernel_seconds=0.0029,
               kernels=56, aten_ops=213)
    with gzip.open(facts, "wt", encoding="utf-8") as f:
        json.dump({"card": "NVIDIA H200", "time": [row]}, f)
    out = tmp_path / "cpu.csv"
    monkeypatch.setattr(validate_time, "CPU_CSV_PATH", str(out))
    assert validate_time.main(["--cpu", "--facts", str(facts)]) == 0
    text = capsys.readouterr().out
    assert "before" in text and "now" in text and "host" in text
    import csv

    (scored,) = list(csv.DictReader(open(out, encoding="utf-8")))
    assert float(scored["estimate_s"]) == pytest.approx(max(float(scored["host_estimate_s"]),
                                                            float(scored["device_estimate_s"])))
    assert float(scored["error"]) == pytest.approx(float(scored["estimate_s"]) / 0.003 - 1)
