"""``objective="throughput"`` on the simulated cluster: the fastest split that fits, measured."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from dptune import Tuner
from dptune.errors import UsageError
from dptune.step.presets import adamw


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def images(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32)


def tune(model, sample, cluster, objective, batch=128, **kw):
    return Tuner(model, sample, batch_size=batch, optimizer=adamw, simulate=cluster,
                 objective=objective, verbose=False, **kw).fit()


def within(r, budgets):
    return r.feasible and all(p <= b for i, (p, b, c) in enumerate(
        zip(r.peak_bytes, budgets, r.chunk_sizes)) if i == 0 or c > 0)


def test_a_slower_card_gets_fewer_samples_and_the_step_is_the_fastest_measured():
    # the same card twice, card 1 at a tenth of the speed (the spec's override)
    r = tune(cnn(), images, "2x24GB,tflops=0:100,tflops=1:10,bandwidth=1:100GB/s", "throughput")
    assert r.objective == "throughput"
    assert r.batch_size == 128 and r.chunk_sizes[0] > r.chunk_sizes[1]
    chosen = next(p for p in r.probes if list(p.chunk_sizes) == r.chunk_sizes)
    assert within(chosen, r.budget_bytes) and chosen.time is not None
    # no split measured within budget at this batch is faster
    rivals = [p for p in r.probes if p.batch_size == 128 and within(p, r.budget_bytes)]
    assert chosen.time.step_seconds == min(p.time.step_seconds for p in rivals)
    even = next(p for p in r.probes if p.chunk_sizes == (64, 64))
    assert chosen.time.step_seconds < even.time.step_seconds
    assert any(n.startswith("speed: even") and "fastest" in n for n in r.notes)


def test_a_card_worth_dropping_is_dropped_and_said():
    # a wide MLP: DataParallel's copies of its weights over PCIe 3 cost more than the T4 adds
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    r = tune(model, lambda n: torch.randn(n, 512), "RTX4090,T4", "throughput", batch=64)
    assert r.chunk_sizes == [64, 0]
    assert any("get no samples: the step is faster without them" in n for n in r.notes)
    solo = next(p for p in r.probes if p.chunk_sizes == (64, 0))
    even = next(p for p in r.probes if p.chunk_sizes == (32, 32))
    assert solo.time.step_seconds < even.time.step_seconds


def test_balance_reports_the_speed_of_its_split_beside_the_even_one():
    r = tune(cnn(), images, "RTX4090,RTX3090", "balance")
    line = next(n for n in r.notes if n.startswith("speed: "))
    assert "even: batch 128" in line and "memory-balanced" in line and "(estimated)" in line
    assert all(p.time is not None and p.time.source.value == "estimated" for p in r.probes)


def test_throughput_refuses_another_output_card():
    with pytest.raises(UsageError, match="output_device"):
        Tuner(cnn(), images, objective="throughput", output_device=1, simulate="2x24GB")


def test_a_global_batch_too_large_for_one_step_runs_as_the_fastest_micro_batches():
    """2 cards of 1 GB (146 MiB budgets after 500 MiB headroom), card 1 ten times slower: 1024
    samples cannot run in one step (the even split [512, 512] is over budget), so the plan
    accumulates equal micro-batches. Among the probes measured within every budget whose batch
    divides 1024, the one chosen finishes the 1024 samples in the least time (its steps x its
    step time)."""
    cluster = "2x1GB,tflops=0:100,tflops=1:10,bandwidth=1:100GB/s"
    tuner = Tuner(cnn(), images, batch_size=64, optimizer=adamw, simulate=cluster,
                  objective="throughput", verbose=False, headroom="500MiB", global_batch=1024,
                  budget_level="allocated")      # 1 GB cards: no room for NCCL's 1.6 GB
    r = tuner.fit()
    b = r.batch_size
    assert 1024 % b == 0 and b < 1024
    k = 1024 // b
    chosen = next(p for p in r.probes if list(p.chunk_sizes) == r.chunk_sizes)
    assert within(chosen, r.budget_bytes) and chosen.time is not None
    rivals = [p for p in r.probes if p.batch_size and 1024 % p.batch_size == 0
              and within(p, r.budget_bytes) and p.time is not None]
    assert k * chosen.time.step_seconds == min(1024 // p.batch_size * p.time.step_seconds
                                               for p in rivals)
    assert chosen.chunk_sizes[0] > chosen.chunk_sizes[1]          # the slow card gets fewer
    assert any(n.startswith(f"global batch 1024: {k} micro-batch") for n in r.notes)
    assert any(f"{k} accumulation step" in a for a in r.advice)
    from dptune.backends.simulated.backend import SimulatedBackend
    from dptune.step.workload import Workload

    one_step = SimulatedBackend(Workload(model=cnn(), sample=images, optimizer=adamw),
                                cluster).probe([512, 512])
    assert not within(one_step, r.budget_bytes)


def test_global_batch_is_checked():
    with pytest.raises(UsageError, match="objective='throughput'"):
        Tuner(cnn(), images, simulate="2x24GB", global_batch=64)
    with pytest.raises(UsageError, match="accumulate"):
        Tuner(cnn(), images, simulate="2x24GB", objective="throughput", global_batch=64,
              accumulate=2)
    with pytest.raises(UsageError, match="int >= 1"):
        Tuner(cnn(), images, simulate="2x24GB", objective="throughput", global_batch=0)


def test_the_command_line_refuses_global_batch_without_throughput(capsys):
    from dptune.cli import main

    code = main(["search", "--model", "dptune.examples.models:MLP", "--simulate", "2x24GB",
                 "--batch-size", "8", "--global-batch", "64", "--quiet", "--no-plots"])
    assert code == 2
    assert "--global-batch needs --objective throughput" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_line_plans_a_global_batch(tmp_path, capsys):
    import json

    from dptune.cli import main

    code = main(["search", "--model", "dptune.examples.models:MLP", "--simulate", "RTX4090,T4",
                 "--batch-size", "32", "--objective", "throughput", "--global-batch", "256",
                 "--no-plots", "--quiet", "--json", "--out", str(tmp_path / "rep")])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    k = 256 // sum(report["chunk_sizes"])
    assert 256 % sum(report["chunk_sizes"]) == 0
    assert f"global batch 256: {k} micro-batch" in text
    assert f"{k} accumulation step" in text
