"""Real-GPU probes: one DataParallel training step per probe, measured by the CUDA allocator.

- :class:`CudaBackend`: Probes on real CUDA cards (what a probe does and how it is measured: docs/concepts/design-notes.md).

Design notes: docs/concepts/design-notes.md, "dptune/backends/cuda/backend.py".
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from dptune.backends.base import Capabilities, Device, ModelFacts, ProbeResult
from dptune.backends.cuda.card_timer import CardTimer, measured_time
from dptune.backends.cuda.isolated import IsolatedProbe, probe_in_child
from dptune.hardware.runtime import CudaRuntime, alloc_retries, check_devices
from dptune.backends.cuda.step import StepContext, default_step
from dptune.errors import DptuneError, UsageError, UserCodeError
from dptune.step.oom import is_oom, oom_device, oom_summary, replica_where
from dptune.step.spec import WorkloadSpec
from dptune.split import validate_chunk_sizes
from dptune.step.state import Snapshot, restore, snapshot
from dptune.types import BackendKind
from dptune.step.workload import Workload

__all__ = ["CudaBackend"]

_STICKY = ("illegal memory access", "device-side assert", "misaligned address",
           "unspecified launch failure", "illegal instruction", "uncorrectable ecc",
           "an illegal", "hardware stack error")


# --------------------------------------------------------------------------------------------
# The backend
# --------------------------------------------------------------------------------------------
@dataclass
class _Failure:
    kind: str                          # "oom", "user" or "dptune"
    stage: str
    exc: Optional[BaseException] = None   # None for OOM: its frames hold the step's tensors
    torch_index: Optional[int] = None
    summary: str = ""
    where: Optional[tuple[int, int]] = None   # (replica, torch device) of a replica thread


@dataclass
class _Figures:
    peak: list[int]
    reserved: list[int]
    nvml: list[Optional[int]]
    retries: list[int]


@dataclass
class _Steps:
    """What the steps of one probe measured (see :meth:`CudaBackend._steps`)."""

    runs: list[_Figures] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)      # each measured step
    card_seconds: list[Optional[tuple[float, ...]]] = field(default_factory=list)
    baseline: list[int] = field(default_factory=list)
    failure: Optional[_Failure] = None
    failed_figures: Optional[_Figures] = None
    failed_in: str = ""


class CudaBackend:
    """Probes on real CUDA cards (what a probe does and how it is measured: docs/concepts/design-notes.md).

    Args:
        workload: a :class:`~dptune.step.workload.Workload`, or a :class:`WorkloadSpec` (needed
            for ``isolate=True``).
        device_ids: torch device indices; default all visible cards. ``device_ids[0]``
            holds the master weights.
        repeats: measured steps per probe (>= 1); figures are their maximum.
        isolate: run each probe in a spawned child process (needs a :class:`WorkloadSpec`).
        runtime: a :class:`CudaRuntime` (tests pass a fake).
        step_fn: ``step_fn(ctx, chunk_sizes)`` runs one step; default :func:`default_step`.
        batch_on_card0: move the batch to ``device_ids[0]`` before the forward.

    Raises :class:`~dptune.errors.BackendUnavailableError` when the cards asked for are not
    visible. Use as a context manager, or call :meth:`close`, to put the model back.
    """

    kind = BackendKind.CUDA

    @property
    def supports_output_device(self) -> bool:
        """Probes can gather the outputs on another card (``probe(..., output_device=k)``)
        with the default step; a custom ``step_fn`` runs its own step, which dptune cannot
        point elsewhere."""
        return not self._custom_step

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities.cuda(output_device=self.supports_output_device)

    @property
    def model_facts(self) -> ModelFacts:
        return ModelFacts(has_batchnorm=self.has_batchnorm)

    def __init__(self, workload: Union[Workload, WorkloadSpec], device_ids: Optional[Sequence[int]] = None,
                 *, repeats: int = 2, isolate: bool = False, runtime: Any = None,
                 step_fn: Optional[Callable[[StepContext, Sequence[int]], None]] = None,
                 batch_on_card0: bool = False):
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise UsageError(f"repeats must be an int >= 1, got {repeats!r}")
        if isinstance(workload, WorkloadSpec):
            self.spec: Optional[WorkloadSpec] = workload
            self.workload: Optional[Workload] = None
        elif isinstance(workload, Workload):
            self.spec, self.workload = None, workload
        else:
            raise UsageError(f"workload must be a Workload or a WorkloadSpec, got {type(workload).__name__}")
        if isolate and self.spec is None:
            raise UsageError(
                "isolate=True runs each probe in a new process, which must rebuild the model, the "
                "batch builder, the loss and the optimizer; objects given to Tuner(model=...) "
                "(a model instance, lambdas, closures) cannot be sent there reliably. Give the "
                "workload as import strings instead: the command line's --model mymod:Net "
                "[--model-kwargs ...] [--input-shape ...] --isolate, or "
                "Tuner.from_spec(WorkloadSpec('mymod:Net', ...), isolate=True)")
        self.runtime = runtime if runtime is not None else CudaRuntime()
        self.repeats = repeats
        self.isolate = bool(isolate)
        self.batch_on_card0 = bool(batch_on_card0)
        self._step_fn = step_fn if step_fn is not None else default_step
        self._custom_step = step_fn is not None
        self.device_ids = check_devices(device_ids, self.runtime)
        self.devices: list[Device] = [self._device(d) for d in self.device_ids]
        self._ctx: Optional[StepContext] = None
        self._model_snap: Optional[Snapshot] = None
        self._warmed: set[int] = set()
        self._closed = False
        self.last_baseline_bytes: Optional[list[int]] = None

    # -- devices -----------------------------------------------------------------------

    def _device(self, d: int) -> Device:
        rt = self.runtime
        free, total = rt.mem_get_info(d)
        reserved = rt.memory_reserved(d)
        context = 0
        mine = rt.nvml_process_used(d)
        if mine is not None:
            context = max(0, mine - reserved)
        used = max(0, (total - free) - reserved - context)
        return Device(index=d, name=rt.name(d), total_bytes=int(total), used_bytes=int(used),
                      context_bytes=int(context), uuid=rt.uuid(d))

    @property
    def has_batchnorm(self) -> Optional[bool]:
        """Whether the model has BatchNorm (``None`` for a factory not built yet)."""
        import torch

        from dptune.step.workload import has_batchnorm

        if self._ctx is not None:
            return has_batchnorm(self._ctx.model)
        if self.workload is not None and isinstance(self.workload.model, torch.nn.Module):
            return has_batchnorm(self.workload.model)
        return None

    def describe(self) -> str:
        names = [d.name for d in self.devices]
        if len(set(names)) == 1:
            return f"{len(names)}x {names[0]}"
        return " + ".join(names)

    # -- life cycle --------------------------------------------------------------------
    def __enter__(self) -> "CudaBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Drop the probe's optimizer and wrapper and put the user's model back as it was."""
        if self._closed:
            return
        self._closed = True
        ctx, self._ctx = self._ctx, None
        snap, self._model_snap = self._model_snap, None
        if ctx is not None:
            ctx.wrapper = ctx.optimizer = ctx.model = None
        del ctx
        error: Optional[BaseException] = None
        if snap is not None:
            try:
                restore(snap, consume=True)
            except Exception as exc:  # noqa: BLE001 - cleanup below still runs
                error = exc
        self._cleanup()
        if error is not None:
            raise error

    def _prepare(self) -> StepContext:
        """Build the workload, place the model on device_ids[0], build the optimizer (once)."""
        if self._ctx is not None:
            return self._ctx
        import torch

        if self.workload is None:
            assert self.spec is not None
            self.workload = self.spec.build()
        wl = self.workload
        dev0 = self.runtime.torch_device(self.device_ids[0])
        if wl.is_factory:
            try:
                with torch.device(dev0):
                    model = wl.model()
            except DptuneError:
                raise
            except Exception as exc:
                raise UserCodeError(
                    f"the model factory raised {type(exc).__name__} while building the model on "
                    f"{dev0}: {exc}") from exc
            if not isinstance(model, torch.nn.Module):
                raise UsageError(f"the model factory returned a {type(model).__name__}, not an nn.Module")
            snap = None
        else:
            assert isinstance(wl.model, torch.nn.Module)
            model = wl.model
            snap = snapshot(model, rng=False, backends=False)
        try:
            model.to(dev0)
            optimizer = None
            if wl.optimizer is not None:
                try:
                    optimizer = wl.optimizer(model.parameters())
                except Exception as exc:
                    raise UserCodeError(
                        f"the optimizer factory raised {type(exc).__name__}: {exc}") from exc
        except BaseException:
            if snap is not None:
                restore(snap)
            raise
        self._model_snap = snap
        self._ctx = StepContext(workload=wl, model=model, optimizer=optimizer,
                                device_ids=list(self.device_ids),
                                devices=[self.runtime.torch_device(d) for d in self.device_ids],
                                runtime=self.runtime, batch_on_card0=self.batch_on_card0)
        return self._ctx

    # -- probing -----------------------------------------------------------------------
    def probe(self, chunk_sizes: Sequence[int], output_device: int = 0) -> ProbeResult:
        """One training step with this split on the real cards; OOM is a result.

        ``output_device``: the position in ``device_ids`` of the card the outputs are
        gathered on (and the loss computed on), as ``BalancedDataParallel(output_device=...)``
        will run; the gathered outputs are then charged to that card's peak.
        """
        if self._closed:
            raise UsageError("this CudaBackend is closed; make a new one to probe again")
        try:
            sizes = validate_chunk_sizes(chunk_sizes, len(self.device_ids))
        except ValueError as e:
            raise UsageError(str(e)) from None
        n = len(self.device_ids)
        if isinstance(output_device, bool) or not isinstance(output_device, int) \
                or not 0 <= output_device < n:
            raise UsageError(f"output_device must be a position 0..{n - 1} in device_ids "
                             f"{self.device_ids}, got {output_device!r}")
        if output_device and self._custom_step:
            raise UsageError("output_device needs the default step: a custom step_fn runs its "
                             "own step, which dptune cannot point at another card")
        if self.isolate:
            return self._probe_isolated(sizes, output_device)
        return self._probe_here(sizes, output_device)

    def _probe_here(self, sizes: list[int], output_device: int = 0) -> ProbeResult:
        import torch

        t0 = time.perf_counter()
        probe_snap = snapshot(None, cuda=bool(getattr(self.runtime, "cuda_rng", False)))
        ok = False
        try:
            torch.backends.cudnn.benchmark = False
            torch.set_grad_enabled(True)
            ctx = self._prepare()
            result = self._measure(ctx, sizes, t0, output_device)
            ok = True
            return result
        finally:
            try:
                restore(probe_snap)
            except Exception as exc:  # noqa: BLE001
                if ok:
                    raise
                warnings.warn(f"dptune could not restore the RNG/cuDNN state after a failed probe: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)

    def _reset_and_baseline(self, ctx: StepContext, first: bool) -> tuple[list[int], list[int]]:
        rt = self.runtime
        ctx.zero_grad()
        rt.gc_collect()
        for d in self.device_ids:
            rt.synchronize(d)
        if first:                     # later steps keep the cache the one before left
            rt.empty_cache()
        for d in self.device_ids:
            rt.reset_peak_memory_stats(d)
        baseline = [rt.memory_allocated(d) for d in self.device_ids]
        retries = [int(rt.memory_stats(d).get("num_alloc_retries", 0)) for d in self.device_ids]
        return baseline, retries

    def _run_step(self, ctx: StepContext, sizes: list[int]) -> Optional[_Failure]:
        """The step; an exception becomes a :class:`_Failure` (an OOM keeps no reference)."""
        ctx.stage = "the step"
        failure: Optional[_Failure] = None
        try:
            self._step_fn(ctx, sizes)
            ctx.stage = "synchronize (errors of kernels launched by the step)"
            for d in self.device_ids:
                self.runtime.synchronize(d)
        except DptuneError as exc:
            traceback.clear_frames(exc.__traceback__)
            failure = _Failure("dptune", ctx.stage, exc=exc)
        except Exception as exc:
            if is_oom(exc):
                failure = _Failure("oom", ctx.stage, torch_index=oom_device(exc),
                                   summary=oom_summary(exc), where=replica_where(exc))
            else:
                # Keep the printable traceback, drop the frames' locals (the step's tensors).
                traceback.clear_frames(exc.__traceback__)
                failure = _Failure("user", ctx.stage, exc=exc, where=replica_where(exc))
        return failure

    def _read(self, baseline_retries: list[int], guarded: bool) -> _Figures:
        rt = self.runtime

        def safe(fn: Callable[[], Any], default: Any) -> Any:
            if not guarded:
                return fn()
            try:
                return fn()
            except Exception:  # noqa: BLE001 - after a failed step the card may not answer
                return default

        peak = [int(safe(functools.partial(rt.max_memory_allocated, d), 0)) for d in self.device_ids]
        reserved = [int(safe(functools.partial(rt.max_memory_reserved, d), 0)) for d in self.device_ids]
        nvml = [safe(functools.partial(rt.nvml_used, d), None) for d in self.device_ids]
        retries = [max(0, int(safe(functools.partial(alloc_retries, rt, d, r0), r0)) - r0)
                   for d, r0 in zip(self.device_ids, baseline_retries)]
        return _Figures(peak, reserved, nvml, retries)

    def _recover(self, ctx: Optional[StepContext]) -> Optional[str]:
        """Free what a step left (guarded: returns a note instead of raising)."""
        problems = []
        rt = self.runtime
        steps: list[tuple[str, Callable[[], Any]]] = []
        if ctx is not None:
            steps.append(("zero_grad", ctx.zero_grad))
        steps.append(("gc.collect", rt.gc_collect))
        steps.append(("empty_cache", rt.empty_cache))
        for d in self.device_ids:
            steps.append((f"reset_peak_memory_stats({d})",
                          functools.partial(rt.reset_peak_memory_stats, d)))
        for what, fn in steps:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{what}: {type(exc).__name__}: {exc}")
        return "; ".join(problems) or None

    def _cleanup(self) -> None:
        note = self._recover(None)
        if note:
            warnings.warn(f"dptune's cleanup after probing failed: {note}", RuntimeWarning, stacklevel=3)

    def _measure(self, ctx: StepContext, sizes: list[int], t0: float,
                 output_device: int = 0) -> ProbeResult:
        active = {i for i, c in enumerate(sizes) if c > 0} | {0, output_device}
        warm_up = not active <= self._warmed
        plan = (["warm-up"] if warm_up else []) + ["measure"] * self.repeats
        ctx.output_device = output_device
        if not self._custom_step:
            from dptune.parallel import BalancedDataParallel

            ctx.wrapper = BalancedDataParallel(ctx.model, device_ids=ctx.device_ids,
                                               output_device=ctx.device_ids[output_device], dim=0,
                                               chunk_sizes=list(sizes))
        try:
            steps = self._steps(ctx, sizes, plan, active)
        finally:
            ctx.wrapper = None
            ctx.output_device = 0
            recover_note = self._recover(ctx)
        self.last_baseline_bytes = steps.baseline
        notes = ["warm-up step before measuring" if warm_up else "warm (no warm-up step)"]
        if output_device:
            notes.append(f"outputs gathered on card {output_device} "
                         f"(device {self.device_ids[output_device]})")
        if recover_note:
            notes.append(f"cleanup failed: {recover_note}")
        failure = steps.failure
        if failure is not None and failure.kind == "dptune":
            assert failure.exc is not None
            raise failure.exc
        if failure is not None and failure.kind == "user":
            raise self._user_error(failure, sizes) from failure.exc
        return self._result(ctx, sizes, steps, notes, t0)

    def _steps(self, ctx: StepContext, sizes: list[int], plan: list[str], active: set[int]) -> _Steps:
        """The warm-up and measured steps, until the first failure; each measured step is
        timed whole (wall clock between synchronisations) and per card (:class:`CardTimer`)."""
        clock_of = getattr(self.runtime, "event_clock", None)     # optional in a fake runtime
        timer = CardTimer(clock_of(), self.device_ids) if clock_of is not None else None
        out = _Steps()
        for i, what in enumerate(plan):
            out.baseline, retries0 = self._reset_and_baseline(ctx, first=i == 0)
            timing = timer is not None and what == "measure" and ctx.model is not None
            with timer.attached(ctx.model) if timing and timer is not None else contextlib.nullcontext():
                started = time.perf_counter()
                failure = self._run_step(ctx, sizes)
                elapsed = time.perf_counter() - started
            if failure is not None:
                out.failure, out.failed_in = failure, what
                out.failed_figures = self._read(retries0, guarded=True)
                break
            figures = self._read(retries0, guarded=False)
            self._warmed |= active
            if what == "measure":
                out.runs.append(figures)
                out.step_seconds.append(elapsed)
                out.card_seconds.append(timer.card_seconds(sizes) if timing and timer is not None
                                        else None)
        return out

    def _result(self, ctx: StepContext, sizes: list[int], steps: _Steps, notes: list[str],
                t0: float) -> ProbeResult:
        """The probe's figures: the maximum over the steps run (how: docs/concepts/design-notes.md)."""
        n = len(self.device_ids)
        runs, failure = steps.runs, steps.failure
        all_runs = runs + ([steps.failed_figures] if steps.failed_figures is not None else [])
        peak = [max(r.peak[i] for r in all_runs) for i in range(n)]
        reserved = [max(r.reserved[i] for r in all_runs) for i in range(n)]
        retries = [max(r.retries[i] for r in all_runs) for i in range(n)]
        nvml_cards = [max((v for v in (r.nvml[i] for r in all_runs) if v is not None), default=None)
                      for i in range(n)]
        nvml = None if all(v is None for v in nvml_cards) else tuple(nvml_cards)
        spread = (tuple(max(r.peak[i] for r in runs) - min(r.peak[i] for r in runs) for i in range(n))
                  if runs else None)
        # DataParallel gathers on more than one card even when one replica ran (a copy onto
        # the output device); on one card nothing is gathered (as on the simulated cluster)
        unread = ctx.outcome.unread_outputs if ctx.outcome is not None and n > 1 else None
        ctx.outcome = None
        oom_pos = None
        if failure is not None:
            oom_pos, how = self._oom_position(failure, peak, reserved)
            stage = "" if failure.stage == "the step" else f", during {failure.stage}"
            notes.append(f"out of memory on card {oom_pos} ({how}) in the {steps.failed_in} step"
                         f"{stage}: {failure.summary}; peaks are lower bounds")
        return ProbeResult(chunk_sizes=tuple(sizes), peak_bytes=tuple(peak), oom_device=oom_pos,
                           breakdown=None, reserved_bytes=tuple(reserved), nvml_used_bytes=nvml,
                           alloc_retries=tuple(retries), repeat_spread_bytes=spread,
                           seconds=time.perf_counter() - t0, note="; ".join(notes),
                           unread_outputs=unread,
                           time=measured_time(steps.step_seconds, steps.card_seconds, failure is None),
                           memory_stats=tuple({"allocated_bytes.all.peak": a, "reserved_bytes.all.peak": r,
                                               "num_alloc_retries": k}
                                              for a, r, k in zip(peak, reserved, retries)))

    def _oom_position(self, failure: _Failure, peak: list[int], reserved: list[int]) -> tuple[int, str]:
        idx = failure.torch_index
        if idx is None and len(self.device_ids) == 1:
            return 0, f"cuda:{self.device_ids[0]}, the only card"
        if idx is not None and idx in self.device_ids:
            return self.device_ids.index(idx), f"cuda:{idx}, from the error message"

        def share(i: int) -> float:
            avail = max(1, self.devices[i].available_bytes)
            return max(reserved[i], peak[i]) / avail

        pos = max(range(len(self.device_ids)), key=share)
        why = "the message names no card" if idx is None else f"the message names cuda:{idx}, not probed"
        return pos, (f"cuda:{self.device_ids[pos]}, inferred: {why}, so the card with the largest "
                     "share of its memory in use was taken")

    def _user_error(self, failure: _Failure, sizes: list[int]) -> UserCodeError:
        from dptune.step.oom import original_message

        exc = failure.exc
        assert exc is not None
        where = ""
        if failure.where is not None:
            replica, dev = failure.where
            pos = self.device_ids.index(dev) if dev in self.device_ids else None
            card = f" (card {pos} of device_ids {self.device_ids})" if pos is not None else ""
            where = f" in replica {replica} on device {dev}{card}"
        elif failure.stage in ("the loss", "optimizer.step()") or len(self.device_ids) == 1:
            where = f" on device {self.device_ids[0]}"
        if failure.where is not None:
            # "Caught KeyError in replica 1 on device 1.\nOriginal Traceback ...\nKeyError: 'a'"
            lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
            last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  ")), default=0)
            first = lines[last_frame + 1] if last_frame + 1 < len(lines) else lines[-1]
        else:
            text = original_message(exc).strip().split("\n", 1)[0]
            first = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        hint = ""
        if any(k in str(exc).lower() for k in _STICKY):
            hint = (". This CUDA error leaves the process's CUDA context unusable: rerun with "
                    "isolate=True (command line: --isolate) so each probe runs in its own process, "
                    "and debug the model with CUDA_LAUNCH_BLOCKING=1")
        stage = "" if failure.stage == "the step" else f" during {failure.stage}"
        return UserCodeError(
            f"the user's code raised {first}{stage}{where} in a probe with chunk_sizes "
            f"{sizes} on devices {self.device_ids}{hint}")

    # -- isolation ---------------------------------------------------------------------
    def _probe_isolated(self, sizes: list[int], output_device: int = 0) -> ProbeResult:
        """This probe in a fresh spawned process (:mod:`dptune.backends.cuda.isolated`)."""
        assert self.spec is not None
        return probe_in_child(IsolatedProbe(
            backend=CudaBackend, spec=self.spec, device_ids=list(self.device_ids), repeats=self.repeats,
            runtime=None if type(self.runtime) is CudaRuntime else self.runtime,
            step_fn=self._step_fn if self._custom_step else None,
            batch_on_card0=self.batch_on_card0, chunk_sizes=list(sizes), output_device=output_device))
