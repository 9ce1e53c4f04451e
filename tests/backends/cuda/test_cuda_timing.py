"""Measured step times on the CUDA backend, against the fake CUDA runtime of
``test_cuda_backend`` (a step that takes a known time per sample on each card)."""

from __future__ import annotations

import time
import warnings

import pytest

from dptune.backends.cuda import CudaBackend
from dptune.timing import TimeSource
from dptune.units import GiB, MiB

from tests.backends.cuda.test_cuda_backend import FakeRuntime, MemStep, tiny_workload


class SlowStep(MemStep):
    """MemStep whose step lasts as long as its slowest card: ``per_sample_s[d]`` per sample."""

    def __init__(self, per_sample_s, **kw):
        super().__init__(**kw)
        self.per_sample_s = per_sample_s

    def __call__(self, ctx, sizes) -> None:
        super().__call__(ctx, sizes)
        time.sleep(max(c * s for c, s in zip(sizes, self.per_sample_s)))


def test_a_probe_carries_the_measured_step_time():
    be = CudaBackend(tiny_workload(), [0, 1], runtime=FakeRuntime(), repeats=3,
                     step_fn=SlowStep([0.002, 0.002], per_sample=MiB))
    r = be.probe([5, 10])
    assert r.time is not None and r.time.source is TimeSource.MEASURED
    assert r.time.step_seconds == pytest.approx(0.020, abs=0.015)     # 10 samples x 2 ms
    assert r.time.card_seconds == ()                                   # per card: not measured
    assert be.probe([0, 2]).time.step_seconds < r.time.step_seconds


def test_throughput_on_the_cuda_backend_fits_each_card_timed_alone(monkeypatch):
    """Card 1 takes 20 ms per sample, card 0 5 ms; memory binds nowhere. The step lasts as long
    as the slower card, so the fastest split of 20 gives card 0 four times card 1's samples:
    [16, 4] (80 ms), against [10, 10] (200 ms) even; [15, 5] and [17, 3] take 100 and 85 ms
    (sleeps on a loaded machine may overshoot a few ms: one sample either way is accepted)."""
    from dptune.tuner import Tuner

    rt = FakeRuntime(n=2, total=8 * GiB)
    be = CudaBackend(tiny_workload(), [0, 1], runtime=rt, repeats=1,
                     step_fn=SlowStep([0.005, 0.020], per_sample=MiB, opt_state=0))
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = Tuner(be.workload.model, be.workload.sample, batch_size=20,
                      objective="throughput", headroom=256 * MiB, verbose=False, backend=be)
        res = tuner.fit()
    assert res.chunk_sizes in ([16, 4], [17, 3], [15, 5])
    alone = [p for p in res.probes if p.purpose.startswith("throughput: card")]
    assert {tuple(p.chunk_sizes) for p in alone} == {(10, 0), (5, 0), (0, 10), (0, 5)}
    at_batch = [p for p in res.probes if p.batch_size == 20 and p.feasible]
    assert all(p.time is not None and p.time.source is TimeSource.MEASURED for p in at_batch)
    chosen = next(p for p in at_batch if list(p.chunk_sizes) == res.chunk_sizes)
    assert chosen.time.step_seconds == min(p.time.step_seconds for p in at_batch)
    assert any("each card alone" in n for n in res.notes)
    even, _, fastest = tuner.speed
    assert fastest.samples_per_second > 2 * even.samples_per_second
