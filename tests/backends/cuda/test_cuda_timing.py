"""Measured step times on the CUDA backend, against the fake CUDA runtime of
``test_cuda_backend`` (a step that takes a known time per sample on each card)."""

from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
import torch.nn as nn

from dptune.backends.cuda import CudaBackend
from dptune.hardware.speeds import TimeSource
from dptune.units import GiB, MiB
from dptune.step.workload import Workload

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
    # 10 samples x 2 ms: a sleep lasts at least that long, and a loaded machine may add to it
    assert 0.020 <= r.time.step_seconds < 0.5
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


# ---- each card's own time: events recorded by hooks in the replicas' threads ----------------

class FakeClock:
    """Events on a fake card: each card's own clock, advanced only by the work done for that
    card (:meth:`sleep`), as a card's stream runs its kernels one after another; so each
    card's time is exact whatever else loads the machine. Each thread's current card is set
    by the step (as ``parallel_apply`` and autograd's per-card threads do)."""

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.card_time: dict = {}

    def sleep(self, device, seconds):
        time.sleep(seconds)
        with self.lock:
            self.card_time[device] = self.card_time.get(device, 0.0) + seconds

    def record(self, device):
        with self.lock:
            return device, self.card_time.get(device, 0.0)

    def elapsed(self, start, end):
        assert start[0] == end[0], "an elapsed time across two cards"
        return end[1] - start[1]

    def current_device(self):
        return getattr(self.local, "device", None)


class TimedRuntime(FakeRuntime):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.clock = FakeClock()

    def event_clock(self):
        return self.clock


class _SleepBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, card, seconds):
        ctx.clock, ctx.card, ctx.seconds = clock, card, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.sleep(ctx.card, ctx.seconds)
        return grad, None, None, None


class SleepModel(nn.Module):
    """A linear layer whose forward and backward last ``fwd[card]`` and ``bwd[card]`` seconds
    per sample, on the card the thread works for."""

    def __init__(self, clock, fwd, bwd):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.clock, self.fwd, self.bwd = clock, fwd, bwd

    def forward(self, x):
        card = self.clock.current_device()
        self.clock.sleep(card, self.fwd[card] * x.shape[0])
        return _SleepBackward.apply(self.lin(x), self.clock, card, self.bwd[card] * x.shape[0])


class ReplicaStep(MemStep):
    """MemStep's memory, then DataParallel's shape of a step: each card's forward in its own
    thread, then each card's backward in its own thread (``passes`` micro-batches)."""

    def __init__(self, passes=1, **kw):
        super().__init__(**kw)
        self.passes = passes

    def __call__(self, ctx, sizes) -> None:
        super().__call__(ctx, sizes)
        clock = ctx.runtime.clock
        used = [i for i, c in enumerate(sizes) if c > 0]
        for _ in range(self.passes):
            outs = {}

            def forward(i, outs=outs):
                clock.local.device = ctx.device_ids[i]
                outs[i] = ctx.model(torch.randn(sizes[i], 4))

            def backward(i, outs=outs):
                clock.local.device = ctx.device_ids[i]
                outs[i].sum().backward()

            for fn in (forward, backward):
                threads = [threading.Thread(target=fn, args=(i,)) for i in used]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()


def sleep_backend(fwd, bwd, passes=1, repeats=1, total=80 * GiB):
    rt = TimedRuntime(n=len(fwd), total=total)
    wl = Workload(model=SleepModel(rt.clock, fwd, bwd), sample=lambda b: torch.randn(b, 4))
    return CudaBackend(wl, list(range(len(fwd))), runtime=rt, repeats=repeats,
                       step_fn=ReplicaStep(passes=passes, per_sample=MiB, opt_state=0))


@pytest.mark.parametrize("passes", [1, 2])
def test_each_card_is_timed_from_its_own_forward_and_backward(passes):
    """Card 0: 4 + 6 ms per sample, card 1: 1 + 4 ms; chunks [2, 6] give 20 and 30 ms per
    micro-batch (hand count), twice that with two micro-batches; cards run side by side, so
    the step lasts at least the slower card's time and less than the two added."""
    be = sleep_backend([0.004, 0.001], [0.006, 0.004], passes=passes, repeats=3)
    r = be.probe([2, 6])
    t = r.time
    assert t is not None and t.source is TimeSource.MEASURED
    assert t.card_seconds[0] == pytest.approx(0.020 * passes, abs=1e-9)
    assert t.card_seconds[1] == pytest.approx(0.030 * passes, abs=1e-9)
    assert max(t.card_seconds) <= t.step_seconds < sum(t.card_seconds) + 0.02
    assert t.serial_seconds == pytest.approx(t.step_seconds - max(t.card_seconds))
    model = be._ctx.model
    assert not model._forward_hooks and not model._forward_pre_hooks     # hooks removed
    # a card without samples is 0.0, not a missing figure
    assert be.probe([0, 4]).time.card_seconds[0] == 0.0


def test_a_card_the_hooks_did_not_see_leaves_the_per_card_times_unmeasured():
    """A step that runs card 1's chunk without calling the model: no per-card figure at all
    (the step's wall time is still measured)."""
    be = sleep_backend([0.001, 0.001], [0.001, 0.001])

    class OnlyCard0(ReplicaStep):
        def __call__(self, ctx, sizes):
            super().__call__(ctx, [sizes[0], 0])

    be._step_fn = OnlyCard0(per_sample=MiB, opt_state=0)
    t = be.probe([3, 3]).time
    assert t.card_seconds == () and t.step_seconds > 0


def test_throughput_uses_each_cards_measured_time_without_probing_cards_alone(monkeypatch):
    """Card 0 takes 2 + 8 ms per sample, card 1 8 + 32 ms: per-card times from the hooks fit
    each card (no probe of a card alone), and the solver gives card 0 four times card 1's
    share of 20: [16, 4] (160 ms of card time against 400 ms for [10, 10]); one sample either
    way is accepted (sleeps overshoot on a loaded machine)."""
    from dptune.search.throughput import step_model
    from dptune.tuner import Tuner

    be = sleep_backend([0.002, 0.008], [0.008, 0.032], total=8 * GiB)
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = Tuner(be.workload.model, be.workload.sample, batch_size=20,
                      objective="throughput", headroom=256 * MiB, verbose=False, backend=be)
        res = tuner.fit()
    assert res.chunk_sizes in ([16, 4], [17, 3], [15, 5])
    assert not [p for p in res.probes if p.purpose.startswith("throughput: card")]
    model = step_model(res.probes, 2)
    assert model.cards[0].per_sample_seconds == pytest.approx(0.010, rel=0.3)
    assert model.cards[1].per_sample_seconds == pytest.approx(0.040, rel=0.3)
    even, _, fastest = tuner.speed
    assert fastest.source == "measured"
    assert fastest.samples_per_second > 2 * even.samples_per_second


class Broadcast(torch.autograd.Function):
    """Named as DataParallel's (its backward node is ``BroadcastBackward``, a sink): the
    reduction of the gradients onto card 0, here 200 ms long, is not the card's own work."""

    @staticmethod
    def forward(ctx, w, clock, card):
        ctx.clock, ctx.card = clock, card
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.sleep(ctx.card, 0.2)       # on the card's clock: it must not be counted
        return grad, None, None


def test_a_cards_backward_ends_where_its_gradients_go_to_the_reduction():
    """One card: a 20 ms backward on the card, then a 200 ms "reduction" in the sink's backward
    (also on the card's clock): the card's time is the forward (10 ms) and its own backward,
    30 ms, without the reduction (230 ms with it)."""
    from dptune.backends.cuda.card_timer import CardTimer

    clock = FakeClock()

    class Replica(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 2))

        def forward(self, x):
            clock.sleep(3, 0.010)
            return _SleepBackward.apply(x @ Broadcast.apply(self.w, clock, 3), clock, 3, 0.020)

    model = Replica()
    timer = CardTimer(clock, [3])
    with timer.attached(model):
        model(torch.randn(5, 4)).sum().backward()
    (card,) = timer.card_seconds([5])
    assert card == pytest.approx(0.030, abs=1e-9)
    assert model.w.grad is not None                       # the sink's backward did run
    assert timer.card_seconds([5]) is None               # the record was cleared
