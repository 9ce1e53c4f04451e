"""Measured step times on the CUDA backend, against the fake CUDA runtime of
``test_cuda_backend`` (a step that takes a known time per sample on each card).

No test here reads the real clock: the backend's wall clock (``time.perf_counter`` in
``dptune.backends.cuda.backend``) is replaced by :class:`FakeClock`, which the fake steps
advance by the time their work would take, so every measured time is exact however loaded
the machine is."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn as nn

from dptune.backends.cuda import CudaBackend
from dptune.types import TimeSource
from dptune.units import GiB, MiB
from dptune.step.workload import Workload

from tests.backends.cuda.test_cuda_backend import FakeRuntime, MemStep, tiny_workload


class FakeClock:
    """The host's wall clock and each card's events, advanced only by the work the fake steps
    say they do: :meth:`advance` moves the wall clock (what the backend reads between its
    synchronisations), :meth:`work` a card's own clock (as a card's stream runs its kernels one
    after another). Each thread's current card is set by the step (as ``parallel_apply`` and
    autograd's per-card threads do)."""

    def __init__(self):
        self.local = threading.local()
        self.lock = threading.Lock()
        self.card_time: dict = {}
        self.now = 0.0

    # the wall clock, in place of time.perf_counter
    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds):
        self.now += seconds

    # the cards' events (the runtime's event clock)
    def work(self, device, seconds):
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


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """A fake clock, the CUDA backend's wall clock for the test (only ``perf_counter``: any
    other use of ``time`` in the backend fails loudly here rather than reading real time)."""
    import dptune.backends.cuda.backend as backend

    fake = FakeClock()
    monkeypatch.setattr(backend, "time", type("FakeTime", (), {"perf_counter": staticmethod(fake.perf_counter)}))
    return fake


class SlowStep(MemStep):
    """MemStep whose step lasts as long as its slowest card: ``per_sample_s[d]`` per sample
    (on the fake wall clock)."""

    def __init__(self, clock, per_sample_s, **kw):
        super().__init__(**kw)
        self.clock, self.per_sample_s = clock, per_sample_s

    def __call__(self, ctx, sizes) -> None:
        super().__call__(ctx, sizes)
        self.clock.advance(max(c * s for c, s in zip(sizes, self.per_sample_s)))


def test_a_probe_carries_the_measured_step_time(clock):
    be = CudaBackend(tiny_workload(), [0, 1], runtime=FakeRuntime(), repeats=3,
                     step_fn=SlowStep(clock, [0.002, 0.002], per_sample=MiB))
    r = be.probe([5, 10])
    assert r.time is not None and r.time.source is TimeSource.MEASURED
    assert r.time.step_seconds == pytest.approx(0.020)                 # 10 samples x 2 ms
    assert r.time.card_seconds == ()                                   # per card: not measured
    assert be.probe([0, 2]).time.step_seconds == pytest.approx(0.004)


def test_throughput_on_the_cuda_backend_fits_each_card_timed_alone(monkeypatch, clock):
    """Card 1 takes 20 ms per sample, card 0 5 ms; memory binds nowhere. The step lasts as long
    as the slower card, so the fastest split of 20 gives card 0 four times card 1's samples:
    [16, 4] (80 ms), against [10, 10] (200 ms) even; [15, 5] and [17, 3] take 100 and 85 ms."""
    from dptune.tuner import Tuner

    rt = FakeRuntime(n=2, total=8 * GiB)
    be = CudaBackend(tiny_workload(), [0, 1], runtime=rt, repeats=1,
                     step_fn=SlowStep(clock, [0.005, 0.020], per_sample=MiB, opt_state=0))
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = Tuner(be.workload.model, be.workload.sample, batch_size=20,
                      objective="throughput", headroom=256 * MiB, verbose=False, backend=be)
        res = tuner.fit()
    assert res.chunk_sizes == [16, 4]
    alone = [p for p in res.probes if p.purpose.startswith("throughput: card")]
    assert {tuple(p.chunk_sizes) for p in alone} == {(10, 0), (5, 0), (0, 10), (0, 5)}
    at_batch = [p for p in res.probes if p.batch_size == 20 and p.feasible]
    assert all(p.time is not None and p.time.source is TimeSource.MEASURED for p in at_batch)
    chosen = next(p for p in at_batch if list(p.chunk_sizes) == res.chunk_sizes)
    assert chosen.time.step_seconds == pytest.approx(0.080)
    assert chosen.time.step_seconds == min(p.time.step_seconds for p in at_batch)
    assert any("each card alone" in n for n in res.notes)
    even, _, fastest = tuner.speed
    assert fastest.samples_per_second > 2 * even.samples_per_second


# ---- each card's own time: events recorded by hooks in the replicas' threads ----------------

class TimedRuntime(FakeRuntime):
    def __init__(self, clock, **kw):
        super().__init__(**kw)
        self.clock = clock

    def event_clock(self):
        return self.clock


class _BackwardWork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, clock, card, seconds):
        ctx.clock, ctx.card, ctx.seconds = clock, card, seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.work(ctx.card, ctx.seconds)
        return grad, None, None, None


class WorkModel(nn.Module):
    """A linear layer whose forward and backward last ``fwd[card]`` and ``bwd[card]`` seconds
    per sample, on the card the thread works for."""

    def __init__(self, clock, fwd, bwd):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.clock, self.fwd, self.bwd = clock, fwd, bwd

    def forward(self, x):
        card = self.clock.current_device()
        self.clock.work(card, self.fwd[card] * x.shape[0])
        return _BackwardWork.apply(self.lin(x), self.clock, card, self.bwd[card] * x.shape[0])


HOST_S = 0.002      # the host's own part of each micro-batch (scatter, loss, optimizer)


class ReplicaStep(MemStep):
    """MemStep's memory, then DataParallel's shape of a step: each card's forward in its own
    thread, then each card's backward in its own thread (``passes`` micro-batches). The cards
    run side by side: each phase moves the wall clock by its slowest card's work, and each
    micro-batch adds ``HOST_S`` of the host's own."""

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
                before = dict(clock.card_time)
                threads = [threading.Thread(target=fn, args=(i,)) for i in used]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                clock.advance(max((clock.card_time.get(d, 0.0) - before.get(d, 0.0)
                                   for d in clock.card_time), default=0.0))
            clock.advance(HOST_S)


def timed_backend(clock, fwd, bwd, passes=1, repeats=1, total=80 * GiB):
    rt = TimedRuntime(clock, n=len(fwd), total=total)
    wl = Workload(model=WorkModel(clock, fwd, bwd), sample=lambda b: torch.randn(b, 4))
    return CudaBackend(wl, list(range(len(fwd))), runtime=rt, repeats=repeats,
                       step_fn=ReplicaStep(passes=passes, per_sample=MiB, opt_state=0))


@pytest.mark.parametrize("passes", [1, 2])
def test_each_card_is_timed_from_its_own_forward_and_backward(clock, passes):
    """Card 0: 4 + 6 ms per sample, card 1: 1 + 4 ms; chunks [2, 6] give 20 and 30 ms per
    micro-batch (hand count), twice that with two micro-batches. Cards run side by side: the
    step's wall time is max(8, 6) ms of forwards, max(12, 24) ms of backwards and 2 ms of the
    host's own, 34 ms a micro-batch; the rest after the slower card, 4 ms, is serial."""
    be = timed_backend(clock, [0.004, 0.001], [0.006, 0.004], passes=passes, repeats=3)
    r = be.probe([2, 6])
    t = r.time
    assert t is not None and t.source is TimeSource.MEASURED
    assert t.card_seconds[0] == pytest.approx(0.020 * passes, abs=1e-9)
    assert t.card_seconds[1] == pytest.approx(0.030 * passes, abs=1e-9)
    assert t.step_seconds == pytest.approx(0.034 * passes, abs=1e-9)
    assert t.serial_seconds == pytest.approx(0.004 * passes, abs=1e-9)
    model = be._ctx.model
    assert not model._forward_hooks and not model._forward_pre_hooks     # hooks removed
    # a card without samples is 0.0, not a missing figure
    assert be.probe([0, 4]).time.card_seconds[0] == 0.0


def test_a_card_the_hooks_did_not_see_leaves_the_per_card_times_unmeasured(clock):
    """A step that runs card 1's chunk without calling the model: no per-card figure at all
    (the step's wall time is still measured: card 0's 3 + 3 ms and the host's 2 ms)."""
    be = timed_backend(clock, [0.001, 0.001], [0.001, 0.001])

    class OnlyCard0(ReplicaStep):
        def __call__(self, ctx, sizes):
            super().__call__(ctx, [sizes[0], 0])

    be._step_fn = OnlyCard0(per_sample=MiB, opt_state=0)
    t = be.probe([3, 3]).time
    assert t.card_seconds == () and t.step_seconds == pytest.approx(0.008, abs=1e-9)


def test_throughput_uses_each_cards_measured_time_without_probing_cards_alone(monkeypatch, clock):
    """Card 0 takes 2 + 8 ms per sample, card 1 8 + 32 ms: per-card times from the hooks fit
    each card (no probe of a card alone), and the solver gives card 0 four times card 1's
    share of 20: [16, 4] (160 ms of card time against 400 ms for [10, 10])."""
    from dptune.search.throughput import step_model
    from dptune.tuner import Tuner

    be = timed_backend(clock, [0.002, 0.008], [0.008, 0.032], total=8 * GiB)
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tuner = Tuner(be.workload.model, be.workload.sample, batch_size=20,
                      objective="throughput", headroom=256 * MiB, verbose=False, backend=be)
        res = tuner.fit()
    assert res.chunk_sizes == [16, 4]
    assert not [p for p in res.probes if p.purpose.startswith("throughput: card")]
    model = step_model(res.probes, 2)
    assert model.cards[0].per_sample_seconds == pytest.approx(0.010)
    assert model.cards[1].per_sample_seconds == pytest.approx(0.040)
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
        ctx.clock.work(ctx.card, 0.2)       # on the card's clock: it must not be counted
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
            clock.work(3, 0.010)
            return _BackwardWork.apply(x @ Broadcast.apply(self.w, clock, 3), clock, 3, 0.020)

    model = Replica()
    timer = CardTimer(clock, [3])
    with timer.attached(model):
        model(torch.randn(5, 4)).sum().backward()
    (card,) = timer.card_seconds([5])
    assert card == pytest.approx(0.030, abs=1e-9)
    assert model.w.grad is not None                       # the sink's backward did run
    assert timer.card_seconds([5]) is None               # the record was cleared
