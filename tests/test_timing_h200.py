"""The time estimate against a real card: the steps measured on an NVIDIA H200 (torch 2.11,
2026-11-27, ``benchmarks/measured/h200-2026-11-27``: ``time.json.gz`` from
``benchmarks/gpu_facts.py --part time``, each step's wall time, the host's time to issue it and
the profiler's summed kernel time; ``validate_time.csv`` there and in
``h200-2026-11-27-rerun``, the same steps' wall times from two more runs that day, on two
lent H200s, not fitted on).

The tolerances are the measurement's own spread, not the estimate's: the same step measured
in the two runs differs by up to 74% (ResNet at batch 64: 5.64 and 9.83 ms), and the host took
4.7 to 7.8 ms to issue the same ops (GPT at batches 1 to 16; ResNet 5.5 to 7.7 ms): one cost
per op is 25% or more off the ends of that range, so a row's host time and step get 40%; the
summed kernel times are steadier (25%). The constants
(:data:`dptune.hardware.speeds.CALIBRATION`) were fitted on ``time.json.gz``'s rows (five constants,
fifteen rows); fitted on two models, the third model's rows stay within 37%
(``python -m benchmarks.validate_time --cpu --fit``). The first estimate (datasheet peaks,
no host) was 25% to 90% low on these rows and fails every check here.
"""

from __future__ import annotations

import csv
import gzip
import json
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks.validate_time import cases
from dptune.backends.base import ProbeResult
from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.timing import TimedBackend
from dptune.search.throughput import speed_notes, step_model
from dptune.types import StepTime
from dptune.step.workload import Workload

#: the time model against the H200 session's measured steps (one estimate per model, seconds):
#: run by make test-slow
pytestmark = pytest.mark.slow

MEASURED = Path(__file__).resolve().parents[1] / "benchmarks" / "measured" / "h200-2026-11-27"
BUILDS = {label: build for label, build, _ in cases()}


def _facts() -> list[dict]:
    with gzip.open(MEASURED / "time.json.gz", "rt", encoding="utf-8") as f:
        return json.load(f)["time"]


RUNS = (MEASURED / "validate_time.csv", MEASURED.with_name(MEASURED.name + "-rerun") / "validate_time.csv")


def _run(path: Path) -> dict[tuple[str, int], float]:
    with open(path, encoding="utf-8") as f:
        return {(r["model"], int(r["batch"])): float(r["real_s"]) for r in csv.DictReader(f)}


def _backend(label: str, cluster: str) -> TimedBackend:
    model = BUILDS[label]()
    wl = Workload(model=model, sample=model.sample, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
    return TimedBackend(SimulatedBackend(wl, cluster))


@pytest.fixture(scope="module")
def estimated() -> dict[tuple[str, int], StepTime]:
    out = {}
    for label in BUILDS:
        backend = _backend(label, "H200")
        try:
            for row in _facts():
                if row["model"] == label:
                    t = backend.probe([row["batch"]]).time
                    assert t is not None
                    out[(label, row["batch"])] = t
        finally:
            backend.close()
    return out


def test_each_measured_step_within_the_measurements_spread(estimated):
    errors: dict[str, list[float]] = {}
    for row in _facts():
        t = estimated[(row["model"], row["batch"])]
        step = t.step_seconds / row["step_seconds"] - 1
        device = t.device_seconds / row["kernel_seconds"] - 1
        host = t.host_seconds / row["host_seconds"] - 1
        where = f"{row['model']} b{row['batch']}: step {step:+.0%}, device {device:+.0%}, host {host:+.0%}"
        assert abs(step) <= 0.4, where
        assert abs(device) <= 0.25, where
        assert abs(host) <= 0.4, where
        errors.setdefault(row["model"], []).append(step)
    for label, errs in errors.items():
        assert abs(statistics.median(errs)) <= 0.2, (label, errs)


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.parent.name)
def test_the_other_runs_steps_within_their_spread(estimated, path):
    """validate_time's runs (not fitted on): each step within 50% (the runs differ by up to 74%
    on one step), each model's median within 40%."""
    per_model: dict[str, list[float]] = {}
    for (label, batch), real in _run(path).items():
        t = estimated.get((label, batch))
        if t is None:
            continue
        err = t.step_seconds / real - 1
        assert abs(err) <= 0.5, (label, batch, err)
        per_model.setdefault(label, []).append(err)
    assert set(per_model) == set(BUILDS)
    for label, errs in per_model.items():
        assert abs(statistics.median(errs)) <= 0.4, (label, errs)


def test_host_or_card_bound_as_measured(estimated):
    """Where the measurement is clear (the host's time and the kernels' 25% apart), the
    estimate says which one sets the step."""
    clear = 0
    for row in _facts():
        ratio = row["host_seconds"] / row["kernel_seconds"]
        if 0.8 <= ratio <= 1.25:
            continue
        clear += 1
        assert estimated[(row["model"], row["batch"])].host_bound == (ratio > 1), row
    assert clear >= 12


@pytest.mark.parametrize("label, small, large", [("ResNet", 16, 64), ("GPT", 4, 8)])
def test_a_host_bound_step_gets_no_faster_with_fewer_samples(estimated, label, small, large):
    """Every run measured these steps host-bound: a quarter or half of the samples took about
    as long. The estimate's ratio of the two steps stays within the runs' ratios (25% either
    side); the first estimate's (device only) was 1.8 and 1.6."""
    facts = {(r["model"], r["batch"]): r["step_seconds"] for r in _facts()}
    ratios = [run[(label, large)] / run[(label, small)] for run in (facts, *map(_run, RUNS))]
    t = estimated[(label, large)].step_seconds / estimated[(label, small)].step_seconds
    assert min(ratios) / 1.25 <= t <= max(ratios) * 1.25, (ratios, t)


def test_the_solver_keeps_a_host_bound_batch_on_one_card(estimated):
    """DataParallel issues each replica from the one host: on two H200s, ResNet's batch of 16
    (host-bound on one card, as measured) is no faster split over both cards, in the probes
    and in the solver's model fitted on them; the solver drops a card."""
    backend = _backend("ResNet", "2xH200")
    try:
        probes = [backend.probe(split) for split in ([16, 0], [8, 8], [12, 4])]
    finally:
        backend.close()
    one, two = probes[0].time, probes[1].time
    assert one is not None and two is not None and one.host_bound
    assert two.step_seconds > one.step_seconds
    assert two.host_seconds > one.host_seconds      # the second replica's ops
    model = step_model(probes, 2)
    assert model is not None
    assert model.seconds([8, 8]) > model.seconds([16, 0])
    best = model.fastest([16, 16], 16)
    assert best is not None and 0 in best.chunk_sizes
    # the report says so; not for a step the card sets (ResNet at 256 on one card, as measured)
    assert any(n.startswith("the host sets the step (estimated") for n in speed_notes((), probes[0]))
    large = ProbeResult(chunk_sizes=(256,), peak_bytes=(0,), time=estimated[("ResNet", 256)])
    assert not any("host sets" in n for n in speed_notes((), large))
