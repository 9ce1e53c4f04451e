"""benchmarks/validate_time.py without a GPU: it says so; GPU names map to the card table;
the estimate half runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import validate_time
from dptune.examples.models import MLP
from dptune.timing import CARD_SPEEDS


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
