"""Measured step times on the CUDA backend, against the fake CUDA runtime of
``test_cuda_backend`` (a step that takes a known time per sample on each card)."""

from __future__ import annotations

import time
import warnings

import pytest

from dptune.backends.cuda import CudaBackend
from dptune.timing import TimeSource
from dptune.units import GiB, MiB

from test_cuda_backend import FakeRuntime, MemStep, tiny_workload


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


def test_throughput_on_the_cuda_backend_returns_the_fastest_split_measured(monkeypatch):
    from dptune.tuner import Tuner

    # card 1 is four times slower per sample; memory is the same per sample on both cards
    rt = FakeRuntime(n=2, total=8 * GiB)
    be = CudaBackend(tiny_workload(), [0, 1], runtime=rt, repeats=1,
                     step_fn=SlowStep([0.0005, 0.002], per_sample=MiB, opt_state=0))
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = Tuner(be.workload.model, be.workload.sample, batch_size=20, objective="throughput",
                    headroom=256 * MiB, verbose=False, backend=be).fit()
    at_batch = [p for p in res.probes if p.batch_size == 20 and p.feasible]
    assert all(p.time is not None and p.time.source is TimeSource.MEASURED for p in at_batch)
    chosen = next(p for p in at_batch if list(p.chunk_sizes) == res.chunk_sizes)
    assert chosen.time.step_seconds == min(p.time.step_seconds for p in at_batch)
    assert any("whole step's time, not each card's" in n for n in res.notes)
