"""CudaBackend's logic on the CPU, against a fake CUDA runtime with a memory model.

The fake runtime counts bytes per card like the caching allocator (allocated, peak, reserved,
retries) and raises a real ``torch.OutOfMemoryError`` when a card is full; step functions
allocate from it. The real torch here has no CUDA, which the no-GPU tests rely on.
"""

from __future__ import annotations

import gc
import random
import traceback
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from dptune.backends.base import Backend, ProbeResult
from dptune.backends.cuda import CudaBackend, CudaRuntime, StepContext, default_step
from dptune.step.spec import WorkloadSpec
from dptune.errors import (BackendUnavailableError, ImportStringError, NoFeasibleSplitError, UsageError,
                           UserCodeError)
from dptune.step.state import snapshot

from state_check import differences
from dptune.units import GiB, MiB
from dptune.step.workload import Workload

CONTEXT = 500 * MiB


class FakeRuntime:
    """A memory model of n cards; logs every call in order."""

    cuda_rng = False

    def __init__(self, n: int = 2, total: int = 80 * GiB, others=None, nvml: bool = True,
                 names=None):
        self.n = n
        self.total_ = total
        self.others = list(others or [0] * n)
        self.nvml = nvml
        self.names = names or ["Fake H100"] * n
        self.allocated = [0] * n
        self.peak = [0] * n
        self.reserved = [0] * n
        self.max_reserved = [0] * n
        self.retries = [0] * n
        self.log: list = []
        self.fail_cleanup = False
        self.watch = None                 # a weakref checked at every empty_cache

    # memory model
    def capacity(self, d: int) -> int:
        return self.total_ - self.others[d] - CONTEXT

    def alloc(self, d: int, nbytes: int) -> None:
        if self.allocated[d] + nbytes > self.capacity(d):
            self.retries[d] += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / GiB:.2f} GiB. GPU {d} has a "
                f"total capacity of {self.total_ / GiB:.2f} GiB of which "
                f"{(self.capacity(d) - self.allocated[d]) / GiB:.2f} GiB is free.")
        self.allocated[d] += nbytes
        self.peak[d] = max(self.peak[d], self.allocated[d])
        self.reserved[d] = max(self.reserved[d], self.allocated[d])
        self.max_reserved[d] = max(self.max_reserved[d], self.reserved[d])

    def free(self, d: int, nbytes: int) -> None:
        self.allocated[d] -= nbytes

    # runtime interface
    def is_available(self) -> bool:
        return self.n > 0

    def device_count(self) -> int:
        return self.n

    def torch_device(self, d: int):
        return torch.device("cpu")

    def name(self, d: int) -> str:
        return self.names[d]

    def total(self, d: int) -> int:
        return self.total_

    def uuid(self, d: int) -> str:
        return f"GPU-{d:08d}-0000-0000-0000-000000000000"

    def mem_get_info(self, d: int):
        return self.total_ - self.others[d] - CONTEXT - self.reserved[d], self.total_

    def memory_allocated(self, d: int) -> int:
        self.log.append(("allocated", d))
        return self.allocated[d]

    def memory_reserved(self, d: int) -> int:
        return self.reserved[d]

    def max_memory_allocated(self, d: int) -> int:
        self.log.append(("peak", d))
        return self.peak[d]

    def max_memory_reserved(self, d: int) -> int:
        return self.max_reserved[d]

    def reset_peak_memory_stats(self, d: int) -> None:
        self.log.append(("reset", d))
        if self.fail_cleanup:
            raise RuntimeError("CUDA error: reset failed")
        self.peak[d] = self.allocated[d]
        self.max_reserved[d] = self.reserved[d]

    def memory_stats(self, d: int):
        return {"num_alloc_retries": self.retries[d]}

    def empty_cache(self) -> None:
        self.log.append(("empty_cache", None if self.watch is None else self.watch() is not None))
        if self.fail_cleanup:
            raise RuntimeError("CUDA error: empty_cache failed")
        self.reserved = list(self.allocated)

    def synchronize(self, d: int) -> None:
        self.log.append(("sync", d))

    def gc_collect(self) -> None:
        # the call is logged (its place in the protocol is what these tests pin); a real collection
        # only where a test watches for an object that needs one (it cost 22 s of a 39 s test)
        self.log.append(("gc", None))
        if self.watch is not None:
            gc.collect()

    def nvml_used(self, d: int):
        return self.others[d] + CONTEXT + self.reserved[d] if self.nvml else None

    def nvml_process_used(self, d: int):
        return CONTEXT + self.reserved[d] if self.nvml else None


class MemStep:
    """A step that allocates per-sample bytes on each card; optimizer state once, on card 0.

    ``jitter[k]`` extra bytes on every card in the k-th call; ``raise_at`` raises an
    exception (given, or built by a callable) in that call.
    """

    def __init__(self, per_sample: int = 100 * MiB, opt_state: int = 1 * GiB, jitter=None,
                 raise_at=None, exc=None):
        self.per_sample, self.opt_state = per_sample, opt_state
        self.jitter = jitter or {}
        self.raise_at, self.exc = raise_at, exc
        self.calls = 0
        self.state_made = False

    def __call__(self, ctx: StepContext, sizes) -> None:
        rt = ctx.runtime
        k = self.calls
        self.calls += 1
        rt.log.append(("step", tuple(sizes)))
        held = []
        for d, c in zip(ctx.device_ids, sizes):
            n = c * self.per_sample + self.jitter.get(k, 0)
            rt.alloc(d, n)
            held.append((d, n))
        if self.raise_at == k:
            exc = self.exc() if callable(self.exc) and not isinstance(self.exc, BaseException) else self.exc
            for d, n in held:        # a real step's tensors die with its frames
                rt.free(d, n)
            raise exc
        for d, n in held:
            rt.free(d, n)
        if not self.state_made:      # optimizer state: created at the end of the first step
            rt.alloc(ctx.device_ids[0], self.opt_state)
            self.state_made = True


def tiny_workload(**kw) -> Workload:
    return Workload(model=nn.Linear(4, 2), sample=lambda b: torch.randn(b, 4), **kw)


def backend(rt=None, step=None, device_ids=(0, 1), **kw) -> CudaBackend:
    rt = rt if rt is not None else FakeRuntime()
    return CudaBackend(tiny_workload(), list(device_ids), runtime=rt,
                       step_fn=step if step is not None else MemStep(), **kw)


# ---- without GPUs -----------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_real_runtime_without_gpus_raises_backend_unavailable():
    with pytest.raises(BackendUnavailableError) as info:
        CudaBackend(tiny_workload(), [0, 1])
    msg = str(info.value)
    assert "GPUs 0, 1 were asked for but torch sees none" in msg
    assert "torch.cuda.is_available() is False" in msg
    assert "--simulate 4x24GB" in msg and "simulate=" in msg
    assert info.value.exit_code == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_real_runtime_without_gpus_all_visible():
    with pytest.raises(BackendUnavailableError, match="all visible"):
        CudaBackend(tiny_workload())


def test_missing_cards_named_with_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(BackendUnavailableError) as info:
        backend(FakeRuntime(n=2), device_ids=[0, 2, 3])
    msg = str(info.value)
    assert "GPUs 2, 3 were asked for but only 2 are visible (CUDA_VISIBLE_DEVICES=2,3)" in msg
    assert "--simulate" in msg


@pytest.mark.parametrize("ids", [[], [0, 0], [-1], ["0"]])
def test_bad_device_ids(ids):
    with pytest.raises(UsageError):
        backend(device_ids=ids)


def test_default_device_ids_are_all_visible():
    b = CudaBackend(tiny_workload(), runtime=FakeRuntime(n=3), step_fn=MemStep())
    assert b.device_ids == [0, 1, 2] and [d.index for d in b.devices] == [0, 1, 2]
    assert b.describe() == "3x Fake H100"
    assert isinstance(b, Backend) and b.kind == "cuda"


# ---- budget basis -----------------------------------------------------------------------

def test_devices_subtract_our_reserved_memory_and_context():
    rt = FakeRuntime(others=[5 * GiB, 0])
    rt.reserved = [2 * GiB, 0]          # e.g. the user's model is already on card 0
    b = backend(rt)
    d0, d1 = b.devices
    assert d0.total_bytes == 80 * GiB
    assert d0.context_bytes == CONTEXT and d1.context_bytes == CONTEXT
    assert d0.used_bytes == 5 * GiB and d1.used_bytes == 0
    assert d0.available_bytes == 80 * GiB - 5 * GiB - CONTEXT
    assert d0.uuid == "GPU-00000000-0000-0000-0000-000000000000"


def test_devices_without_nvml_count_context_as_used():
    rt = FakeRuntime(others=[5 * GiB, 0], nvml=False)
    b = backend(rt)
    assert b.devices[0].context_bytes == 0
    assert b.devices[0].used_bytes == 5 * GiB + CONTEXT
    assert b.devices[0].available_bytes == 80 * GiB - 5 * GiB - CONTEXT


# ---- probe sequencing -------------------------------------------------------------------

def test_sequence_reset_baseline_step_read():
    rt = FakeRuntime()
    b = backend(rt, repeats=2)
    b.probe([3, 1])
    log = rt.log
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    assert len(steps) == 3                              # warm-up + 2 measured
    prev = 0
    for n, s in enumerate(steps):
        before = log[prev:s]
        kinds = [e[0] for e in before]
        # gc, sync every card, (empty_cache before the probe's first step only: the later steps
        # keep the cache the step before left, as training does), reset every card, baseline
        # every card: in order
        g = kinds.index("gc")
        assert kinds[g + 1:g + 3] == ["sync", "sync"]
        e = g + 3
        assert (kinds[e] == "empty_cache") == (n == 0) and kinds.count("empty_cache") == (n == 0)
        r = [i for i, k in enumerate(kinds) if k == "reset" and i > g + 2]
        a = [i for i, k in enumerate(kinds) if k == "allocated" and i > max(r)]
        assert len(r) == 2 and len(a) == 2
        after = log[s + 1:s + 5]
        assert [x[0] for x in after[:2]] == ["sync", "sync"]   # synchronise before reading
        prev = s + 1
    assert rt.log[-1][0] == "reset"                     # recovery resets peaks at the end


def test_warm_up_once_then_again_for_a_new_card():
    step = MemStep()
    b = backend(step=step, repeats=2)
    r1 = b.probe([4, 0])
    assert step.calls == 3 and r1.note.startswith("warm-up")
    b.probe([3, 0])
    assert step.calls == 5                              # warm: no warm-up
    r3 = b.probe([2, 2])                                # card 1 runs its first step
    assert step.calls == 8 and "warm-up" in r3.note
    b.probe([1, 3])
    assert step.calls == 10


def test_steady_state_peak_includes_optimizer_state():
    # The optimizer state appears at the end of the first step; without a warm-up the first
    # step's peak would miss it. Measured peaks are steady state.
    rt = FakeRuntime()
    b = backend(rt, step=MemStep(per_sample=100 * MiB, opt_state=1 * GiB))
    r = b.probe([4, 2])
    assert r.peak_bytes == (1 * GiB + 400 * MiB, 200 * MiB)
    assert b.last_baseline_bytes == [1 * GiB, 0]
    assert r.feasible and r.oom_device is None and r.chunk_sizes == (4, 2)
    assert r.reserved_bytes[0] >= r.peak_bytes[0]
    assert r.breakdown is None


def test_repeats_take_the_max_and_report_the_spread():
    step = MemStep(per_sample=MiB, jitter={0: 10 * MiB, 1: 100, 2: 300, 3: 200})
    b = backend(step=step, repeats=3)
    r = b.probe([2, 2])
    base = [1 * GiB + 2 * MiB, 2 * MiB]
    assert r.peak_bytes == (base[0] + 300, base[1] + 300)  # warm-up's 10 MiB not counted
    assert r.repeat_spread_bytes == (200, 200)


def test_repeats_validated():
    with pytest.raises(UsageError):
        backend(repeats=0)


def test_chunk_sizes_validated():
    b = backend()
    with pytest.raises(UsageError):
        b.probe([1, 2, 3])
    with pytest.raises(UsageError):
        b.probe([0, 0])


def test_nvml_figures_and_fallback():
    r = backend(FakeRuntime()).probe([1, 1])
    assert r.nvml_used_bytes is not None and all(v > CONTEXT for v in r.nvml_used_bytes)
    r = backend(FakeRuntime(nvml=False)).probe([1, 1])
    assert r.nvml_used_bytes is None
    assert r.peak_bytes[0] > 0                          # allocator figures still there


def test_alloc_retries_counted_per_step():
    class RetryStep(MemStep):
        def __call__(self, ctx, sizes):
            super().__call__(ctx, sizes)
            ctx.runtime.retries[1] += 2

    r = backend(step=RetryStep()).probe([1, 1])
    assert r.alloc_retries == (0, 2)


def test_cudnn_benchmark_off_during_probe_and_restored(monkeypatch):
    seen = {}

    def step(ctx, sizes):
        seen["benchmark"] = torch.backends.cudnn.benchmark
        seen["enabled"] = torch.backends.cudnn.enabled
        seen["grad"] = torch.is_grad_enabled()

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    b = backend(step=step)
    with torch.no_grad():
        b.probe([1, 1])
        assert not torch.is_grad_enabled()
    assert seen == {"benchmark": False, "enabled": torch.backends.cudnn.enabled, "grad": True}
    assert torch.backends.cudnn.benchmark is True


def test_rng_untouched_by_a_probe():
    def step(ctx, sizes):
        random.random()
        torch.randn(10)

    b = backend(step=step)
    py, tr = random.getstate(), torch.get_rng_state()
    b.probe([1, 1])
    assert random.getstate() == py and torch.equal(torch.get_rng_state(), tr)


# ---- out of memory ----------------------------------------------------------------------

def test_oom_from_the_memory_model_is_a_result():
    rt = FakeRuntime()
    b = backend(rt, step=MemStep(per_sample=10 * GiB))
    r = b.probe([1, 9])                                  # 90 GiB on card 1
    assert not r.feasible and r.oom_device == 1
    assert "from the error message" in r.note and "lower bounds" in r.note
    assert "CUDA out of memory" in r.note
    assert r.peak_bytes[0] == 10 * GiB                  # what was allocated before it failed
    assert r.repeat_spread_bytes is None                # failed in the warm-up: no repeats
    # the backend is usable afterwards; the failed warm-up does not count as warm
    r2 = b.probe([1, 1])
    assert r2.feasible and "warm-up" in r2.note


def test_oom_torch_index_mapped_to_position():
    rt = FakeRuntime()
    b = backend(rt, step=MemStep(per_sample=10 * GiB), device_ids=[1, 0])
    r = b.probe([1, 9])                                  # torch card 0 is position 1
    assert r.oom_device == 1 and "cuda:0" in r.note


def test_oom_in_replica_thread_message():
    msg = ("Caught OutOfMemoryError in replica 1 on device 1.\nOriginal Traceback (most recent "
           "call last):\n  File \"x.py\", line 1, in forward\n    y = x @ w\n"
           "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 1 has a "
           "total capacity of 79.19 GiB of which 10.00 MiB is free.")
    b = backend(step=MemStep(raise_at=1, exc=lambda: torch.OutOfMemoryError(msg)), repeats=2)
    r = b.probe([2, 2])
    assert r.oom_device == 1 and "measure step" in r.note


def test_oom_in_disguise_without_card_is_inferred_from_memory_use():
    rt = FakeRuntime()
    exc = lambda: RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    b = backend(rt, step=MemStep(per_sample=GiB, opt_state=0, raise_at=0, exc=exc))
    r = b.probe([1, 30])
    assert r.oom_device == 1 and "inferred" in r.note


def test_oom_single_card_without_card_in_message():
    exc = lambda: RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
    b = backend(FakeRuntime(n=1), step=MemStep(raise_at=0, exc=exc), device_ids=[0])
    assert b.probe([4]).oom_device == 0


def test_recovery_runs_after_the_except_block_with_frames_released():
    rt = FakeRuntime()

    class Sentinel:
        pass

    def step(ctx, sizes):
        big = Sentinel()                                  # a "tensor" held by the frame
        rt.watch = weakref.ref(big)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB. GPU 0 has ...")

    b = backend(rt, step=step)
    r = b.probe([1, 1])
    assert r.oom_device == 0
    last_empty = [e for e in rt.log if e[0] == "empty_cache"][-1]
    assert last_empty == ("empty_cache", False)           # freed before the cache was emptied


def test_cleanup_failure_is_guarded():
    rt = FakeRuntime()

    def step(ctx, sizes):
        rt.fail_cleanup = True
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB. GPU 1 has ...")

    r = backend(rt, step=step).probe([1, 1])
    assert r.oom_device == 1
    assert "cleanup failed" in r.note and "empty_cache failed" in r.note


# ---- errors in the user's code ----------------------------------------------------------

def test_user_error_wrapped_with_context_and_chained():
    rt = FakeRuntime()

    class Sentinel:
        pass

    def step(ctx, sizes):
        ctx.stage = "the forward"
        held = Sentinel()
        rt.watch = weakref.ref(held)
        raise ValueError("bad shape")

    b = backend(rt, step=step)
    with pytest.raises(UserCodeError) as info:
        b.probe([3, 1])
    err = info.value
    assert isinstance(err.__cause__, ValueError)
    msg = str(err)
    assert "raised ValueError: bad shape during the forward" in msg and "[3, 1]" in msg
    assert err.exit_code == 1
    assert rt.watch() is None                             # frames cleared, tensors freed
    assert "raise ValueError" in "".join(traceback.format_exception(err.__cause__))  # lines kept


def test_user_error_in_replica_keeps_the_card():
    text = ("Caught KeyError in replica 1 on device 1.\nOriginal Traceback (most recent call "
            "last):\n  File \"m.py\", line 3, in forward\n    x = d['a']\nKeyError: 'a'")
    b = backend(step=MemStep(raise_at=0, exc=lambda: RuntimeError(text)))
    with pytest.raises(UserCodeError) as info:
        b.probe([1, 1])
    msg = str(info.value)
    assert "raised KeyError: 'a' in replica 1 on device 1 (card 1 of device_ids [0, 1])" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_sticky_cuda_error_suggests_isolation():
    exc = lambda: RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(UserCodeError, match="isolate=True"):
        backend(step=MemStep(raise_at=0, exc=exc)).probe([1, 1])


def test_dptune_errors_pass_through_unwrapped():
    with pytest.raises(UsageError, match="no tensor"):
        backend(step=MemStep(raise_at=0, exc=lambda: UsageError("no tensor"))).probe([1, 1])


def test_factory_and_optimizer_errors_are_user_code_errors():
    def bad_factory():
        raise RuntimeError("cannot build")

    wl = Workload(model=bad_factory, sample=lambda b: torch.randn(b, 4))
    b = CudaBackend(wl, [0], runtime=FakeRuntime(n=1), step_fn=MemStep())
    with pytest.raises(UserCodeError, match="model factory") as info:
        b.probe([1])
    assert isinstance(info.value.__cause__, RuntimeError)

    def bad_opt(params):
        raise TypeError("lr missing")

    model = nn.Linear(4, 2)
    before = snapshot(model)
    wl = Workload(model=model, sample=lambda b: torch.randn(b, 4), optimizer=bad_opt)
    b = CudaBackend(wl, [0], runtime=FakeRuntime(n=1), step_fn=MemStep())
    with pytest.raises(UserCodeError, match="optimizer factory"):
        b.probe([1])
    assert differences(before) == []


# ---- leave no trace, with a real model and a real optimizer step ------------------------

class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)
        self.out.requires_grad_(False)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.fc(x))))


def real_cpu_step(ctx: StepContext, sizes) -> None:
    """A real training step on the CPU (the fake runtime places models on the CPU)."""
    ctx.zero_grad()
    x = ctx.workload.sample(sum(sizes))
    out = ctx.model(x)
    ctx.workload.loss(out, x).backward()
    ctx.optimizer.step()
    ctx.model.fc.eval()                  # even a mode change is undone on close
    random.random()


def test_model_state_bit_identical_after_close():
    torch.manual_seed(0)
    model = BNNet()
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.5)   # the user's leftover grad
    user_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 6)).sum().backward()
    user_opt.step()
    before = snapshot(model, optimizers=[user_opt])
    ids = [id(p) for p in model.parameters()]
    wl = Workload(model=model, sample=lambda b: torch.randn(b, 6),
                  optimizer=lambda p: torch.optim.AdamW(p, lr=1.0))
    with CudaBackend(wl, [0, 1], runtime=FakeRuntime(), step_fn=real_cpu_step) as b:
        r = b.probe([3, 2])
        r = b.probe([2, 3])
        assert r.feasible
        assert differences(before)                           # the probes did train it
    assert differences(before) == []
    assert [id(p) for p in model.parameters()] == ids


def test_default_step_on_cpu_through_balanced_data_parallel():
    # Without CUDA, BalancedDataParallel passes through: the default step runs for real.
    torch.manual_seed(0)
    model = BNNet()
    before = snapshot(model)
    seen = []

    def loss_fn(out, batch):
        seen.append(batch.device)
        return (out.sum(1) - batch.sum(1)).pow(2).mean()

    wl = Workload(model=model, sample=lambda b: torch.randn(b, 6), loss_fn=loss_fn,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with CudaBackend(wl, [0, 1], runtime=FakeRuntime()) as b:
            r = b.probe([4, 4])
    assert r.feasible and len(seen) == 3
    assert differences(before) == []


def test_default_step_batch_on_card0():
    ctx = StepContext(workload=tiny_workload(), model=nn.Linear(4, 2), optimizer=None,
                      device_ids=[0], devices=[torch.device("cpu")], runtime=FakeRuntime(n=1),
                      batch_on_card0=True)
    default_step(ctx, [3])
    assert ctx.stage == "done" and ctx.model.weight.grad is not None


def test_factory_model_built_once_and_dropped_on_close():
    built = []

    def factory():
        built.append(nn.Linear(4, 2))
        return built[-1]

    wl = Workload(model=factory, sample=lambda b: torch.randn(b, 4))
    b = CudaBackend(wl, [0], runtime=FakeRuntime(n=1), step_fn=MemStep())
    b.probe([2])
    b.probe([3])
    assert len(built) == 1
    ref = weakref.ref(built.pop())
    b.close()
    gc.collect()
    assert ref() is None
    with pytest.raises(UsageError, match="closed"):
        b.probe([1])
    b.close()                                                # idempotent


def test_result_round_trips():
    r = backend().probe([2, 1])
    assert ProbeResult.from_dict(r.to_dict()) == r


# ---- workload specs and isolation -------------------------------------------------------

def test_isolation_needs_a_spec():
    with pytest.raises(UsageError, match="import strings"):
        CudaBackend(tiny_workload(), [0], runtime=FakeRuntime(n=1), isolate=True)


def test_spec_pickles_and_builds():
    import pickle

    spec = WorkloadSpec("dptune.examples.models:MLP",
                        model_kwargs={"in_features": 8, "hidden": 16, "depth": 1, "num_classes": 3},
                        optimizer="torch.optim:AdamW", optimizer_kwargs={"lr": 1e-3})
    spec2 = pickle.loads(pickle.dumps(spec))
    assert spec2 == spec
    wl = spec2.build()
    assert wl.is_factory
    model = wl.model()
    assert isinstance(model, nn.Module) and model.in_features == 8
    assert wl.sample(5).shape == (5, 8)                     # the model's own sample()
    opt = wl.optimizer(model.parameters())
    assert isinstance(opt, torch.optim.AdamW)
    pickle.dumps(wl)                                         # the built workload pickles too


def test_spec_input_shape_and_sample_forms():
    s = WorkloadSpec("dptune.examples.models:MLP", input_shape=(3, 4)).build()
    assert s.sample(2).shape == (2, 3, 4) and s.sample(2).dtype == torch.float32
    s = WorkloadSpec("dptune.examples.models:TinyGPT", input_shape=(7,), dtype="long",
                     vocab_size=50).build()
    x = s.sample(2)
    assert x.dtype == torch.int64 and x.shape == (2, 7) and int(x.max()) < 50
    s = WorkloadSpec("dptune.examples.models:TinyGPT",
                     model_kwargs={"vocab_size": 50, "d_model": 8, "n_layers": 1, "n_heads": 2,
                                   "seq_len": 4},
                     sample=".sample_with_targets").build()
    s.model()
    idx, tgt = s.sample(3)
    assert idx.shape == tgt.shape == (3, 4)
    s = WorkloadSpec("dptune.examples.models:MLP", sample="torch:randn", sample_kwargs={}).build()
    assert s.sample(2).shape == (2,)


def test_spec_errors():
    with pytest.raises(ImportStringError):
        WorkloadSpec("no_such_module_xyz:Net").build()
    with pytest.raises(UsageError, match="Linear has no sample"):
        WorkloadSpec("torch.nn:Linear", model_kwargs={"in_features": 2, "out_features": 2}).build()
    with pytest.raises(UsageError, match="dtype"):
        WorkloadSpec("dptune.examples.models:MLP", input_shape=(2,), dtype="nope")


def spawn_ok_step(ctx, sizes):
    ctx.runtime.alloc(ctx.device_ids[0], 1000 * sum(sizes))
    ctx.runtime.free(ctx.device_ids[0], 1000 * sum(sizes))


def spawn_bad_step(ctx, sizes):
    raise ValueError("broken in the child")


@pytest.mark.slow      # spawns a Python process with torch (about 9 s)
def test_isolated_probe_runs_in_a_child_process():
    spec = WorkloadSpec("dptune.examples.models:MLP",
                        model_kwargs={"in_features": 8, "hidden": 16, "depth": 1, "num_classes": 3})
    b = CudaBackend(spec, [0, 1], runtime=FakeRuntime(), step_fn=spawn_ok_step, isolate=True)
    r = b.probe([3, 1])
    assert r.feasible and r.peak_bytes[0] == 4000 and "isolated child process" in r.note
    b2 = CudaBackend(spec, [0, 1], runtime=FakeRuntime(), step_fn=spawn_bad_step, isolate=True)
    with pytest.raises(UserCodeError, match="broken in the child"):
        b2.probe([1, 1])


def spawn_crash_step(ctx, sizes):
    import os

    os._exit(3)          # as a segfault in native code: no answer, no exception


def spawn_dptune_error_step(ctx, sizes):
    from dptune.errors import NoFeasibleSplitError

    raise NoFeasibleSplitError("raised in the child")


@pytest.mark.slow      # spawns two Python processes with torch
def test_isolated_child_that_dies_or_raises_dptunes_error():
    spec = WorkloadSpec("dptune.examples.models:MLP",
                        model_kwargs={"in_features": 8, "hidden": 16, "depth": 1, "num_classes": 3})
    b = CudaBackend(spec, [0, 1], runtime=FakeRuntime(), step_fn=spawn_crash_step, isolate=True)
    with pytest.raises(UserCodeError, match="exited without a result"):
        b.probe([1, 1])
    b = CudaBackend(spec, [0, 1], runtime=FakeRuntime(), step_fn=spawn_dptune_error_step, isolate=True)
    with pytest.raises(NoFeasibleSplitError, match="raised in the child"):
        b.probe([1, 1])


def test_isolation_refuses_unpicklable_parts():
    spec = WorkloadSpec("dptune.examples.models:MLP")
    b = CudaBackend(spec, [0], runtime=FakeRuntime(n=1), step_fn=lambda c, s: None, isolate=True)
    with pytest.raises(UsageError, match="picklable"):
        b.probe([1])


# ---- the real runtime's NVML fallbacks ---------------------------------------------------

def test_real_runtime_nvml_degrades_to_none(monkeypatch):
    from dptune.hardware import nvml as _nvml

    rt = CudaRuntime()
    monkeypatch.setattr(rt, "uuid", lambda d: "GPU-00000000-0000-0000-0000-000000000000")
    monkeypatch.setattr(_nvml, "nvml", lambda: None)        # no library / no driver
    assert rt.nvml_used(0) is None and rt.nvml_process_used(0) is None


def test_real_runtime_nvml_query_failure_warns_once(monkeypatch):
    from dptune.hardware import nvml as _nvml

    rt = CudaRuntime()
    monkeypatch.setattr(rt, "uuid", lambda d: "GPU-00000000-0000-0000-0000-000000000000")
    monkeypatch.setattr(_nvml, "nvml", lambda: object())
    monkeypatch.setattr(_nvml, "handle_by_uuid", lambda u: "handle")

    def broken(handle):
        raise RuntimeError("Not Supported")

    monkeypatch.setattr(_nvml, "memory_info", broken)
    with pytest.warns(RuntimeWarning, match="NVML could not"):
        assert rt.nvml_used(0) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rt.nvml_used(1) is None                        # no second warning
        assert rt.nvml_process_used(0) is None                # object() has no such query


def test_real_runtime_nvml_matched_by_uuid(monkeypatch):
    from dptune.hardware import nvml as _nvml

    rt = CudaRuntime()
    uuids = {0: "GPU-aaaaaaaa-0000-0000-0000-000000000000", 1: "GPU-bbbbbbbb-0000-0000-0000-000000000000"}
    monkeypatch.setattr(rt, "uuid", lambda d: uuids[d])
    monkeypatch.setattr(_nvml, "nvml", lambda: object())
    monkeypatch.setattr(_nvml, "handle_by_uuid", lambda u: {"GPU-aaaaaaaa": "h-a", "GPU-bbbbbbbb": "h-b"}[u[:12]])
    monkeypatch.setattr(_nvml, "memory_info",
                        lambda h: _nvml.MemoryInfo(total=10, free=1, used={"h-a": 7, "h-b": 9}[h]))
    assert rt.nvml_used(1) == 9 and rt.nvml_used(0) == 7


# ---- the output device --------------------------------------------------------------------

OUT_PER_SAMPLE = 64 * MiB


def gathering_wrapper(rt: FakeRuntime, made: list):
    """Stands in for BalancedDataParallel on the fake runtime: the forward charges the whole
    batch's gathered outputs (``OUT_PER_SAMPLE`` a sample) to the output device, as torch's
    gather does, and each chunk's activations to its own card."""

    class Wrapper(nn.Module):
        def __init__(self, module, device_ids, output_device, dim, chunk_sizes):
            super().__init__()
            self.module, self.device_ids = module, list(device_ids)
            self.output_device, self.chunk_sizes = output_device, list(chunk_sizes)
            made.append((tuple(device_ids), output_device, tuple(chunk_sizes)))

        def forward(self, x):
            for d, c in zip(self.device_ids, self.chunk_sizes):
                rt.alloc(d, c * MiB)
                rt.free(d, c * MiB)
            b = sum(self.chunk_sizes)
            rt.alloc(self.output_device, b * OUT_PER_SAMPLE)
            rt.free(self.output_device, b * OUT_PER_SAMPLE)
            return self.module(x)

    return Wrapper


@pytest.mark.parametrize("out", [0, 1])
def test_default_step_gathers_on_the_output_device_asked_for(monkeypatch, out):
    import dptune.parallel

    rt, made = FakeRuntime(n=3), []
    monkeypatch.setattr(dptune.parallel, "BalancedDataParallel", gathering_wrapper(rt, made))
    loss_devices = []

    def loss_fn(output, batch):
        loss_devices.append(batch.device)
        return output.sum()

    wl = Workload(model=nn.Linear(4, 2), sample=lambda b: torch.randn(b, 4), loss_fn=loss_fn)
    with CudaBackend(wl, [0, 1, 2], runtime=rt, repeats=1) as b:
        r = b.probe([2, 4, 4], output_device=out)
    assert r.feasible
    # every wrapper built for the probe gathered on the card asked for
    assert made and all(m == ((0, 1, 2), out, (2, 4, 4)) for m in made)
    # the whole batch's outputs are charged to that card's peak, not to card 0's
    gathered = 10 * OUT_PER_SAMPLE
    assert r.peak_bytes[out] >= gathered
    assert all(r.peak_bytes[i] < gathered for i in range(3) if i != out)
    assert ("outputs gathered on card 1" in r.note) == (out == 1)
    assert loss_devices     # the loss ran (its targets moved to the output card's device)


def test_tuner_output_device_on_the_cuda_backend(monkeypatch):
    """Tuner(output_device=1) on the CUDA backend probes with the outputs on card 1 and keeps
    it when that fits a larger batch: card 0 also holds the optimizer state."""
    import dptune.parallel
    from dptune.tuner import Tuner

    rt, made = FakeRuntime(n=2, total=8 * GiB), []
    monkeypatch.setattr(dptune.parallel, "BalancedDataParallel", gathering_wrapper(rt, made))

    wl = Workload(model=nn.Linear(4, 2), sample=lambda b: torch.randn(b, 4),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    be = CudaBackend(wl, [0, 1], runtime=rt, repeats=1)
    rt.alloc(0, 2 * GiB)          # card 0 holds 2 GiB more (weights, state) for the whole run
    # wrapping the model at the end moves it to a real CUDA card, which this machine lacks
    monkeypatch.setattr(Tuner, "_wrap", lambda self, *a, **k: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = Tuner(wl.model, wl.sample, batch_size=8, optimizer=wl.optimizer,
                    objective="max_batch", headroom=256 * MiB, verbose=False, backend=be,
                    output_device=1, max_probes=24).fit()
    assert res.output_device == 1 and res.card0_output_batch_size is not None
    assert res.batch_size > res.card0_output_batch_size
    assert any(m[1] == 1 for m in made) and any(m[1] == 0 for m in made)
    assert any(p.purpose.startswith("output 1:") and list(p.chunk_sizes) == res.chunk_sizes
               for p in res.probes)
