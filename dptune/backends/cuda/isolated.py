"""Isolation: a probe of ``CudaBackend(..., isolate=True)`` run in a fresh spawned process.

A sticky CUDA error (an illegal memory access, a device-side assert) leaves a process's CUDA
context unusable; run in a child, it costs only that child. Each probe gets a new process
(``concurrent.futures.ProcessPoolExecutor`` with one worker and the ``spawn`` start method),
which rebuilds the workload from its :class:`~dptune.step.spec.WorkloadSpec` and runs one probe
with an ordinary :class:`~dptune.backends.cuda.backend.CudaBackend`. The child answers with a
small tuple (its result as a dict, or the error's kind and text): dptune's exceptions are
rebuilt from their class names in the parent, the user's keep the child's traceback as text.
A child that dies without an answer (a crash in native code, the host out of memory) is a
:class:`~dptune.errors.UserCodeError` that says so.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass
from typing import Any, Optional

from dptune.errors import DptuneError, UsageError, UserCodeError
from dptune.step.spec import WorkloadSpec
from dptune.types import ProbeResult

__all__ = ["IsolatedProbe", "probe_in_child"]


@dataclass(frozen=True)
class IsolatedProbe:
    """Everything the child needs for one probe (it must pickle). ``backend`` is the class
    that runs the probe there (:class:`~dptune.backends.cuda.backend.CudaBackend`, pickled by
    reference), so that this module needs nothing above it."""

    backend: Any
    spec: WorkloadSpec
    device_ids: list[int]
    repeats: int
    runtime: Any                    # None: the child's own CudaRuntime
    step_fn: Any                    # None: the default step
    batch_on_card0: bool
    chunk_sizes: list[int]
    output_device: int = 0


def probe_in_child(job: IsolatedProbe) -> ProbeResult:
    """Run ``job`` in a fresh spawned process and return its :class:`ProbeResult`; the
    child's failures are raised here (see the module docstring)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        pickle.dumps(job)
    except Exception as exc:
        raise UsageError(f"isolate=True needs a picklable workload spec, runtime and step "
                         f"function: {type(exc).__name__}: {exc}") from exc
    msg: Optional[tuple] = None
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            msg = pool.submit(_child_probe, job).result()
        except BrokenProcessPool:
            msg = None
    if msg is None:
        raise UserCodeError(
            f"the probe's child process (chunk_sizes {job.chunk_sizes} on devices "
            f"{job.device_ids}) exited without a result: a crash in native code "
            "(a CUDA extension, a driver fault) or the host running out of memory")
    return _answer(msg)


def _answer(msg: tuple) -> ProbeResult:
    """The child's answer as a result, or its failure raised."""
    status = msg[0]
    if status == "ok":
        result = ProbeResult.from_dict(msg[1])
        note = (result.note + "; " if result.note else "") + "isolated child process"
        return ProbeResult.from_dict({**result.to_dict(), "note": note})
    if status == "user":
        raise UserCodeError(f"{msg[1]}\n\nin the probe's child process:\n{msg[2]}")
    if status == "dptune":
        import dptune.errors as errors

        cls = getattr(errors, msg[1], None)
        if isinstance(cls, type) and issubclass(cls, DptuneError):
            try:
                raise cls(msg[2])
            except TypeError:
                pass
        raise DptuneError(f"{msg[1]}: {msg[2]}")
    raise DptuneError(f"the isolated probe failed with {msg[1]}: {msg[2]}\n{msg[3]}")


def _child_probe(job: IsolatedProbe) -> tuple:
    """In the child: one probe with an ordinary (not isolated) backend; its result or failure
    as a tuple."""
    import contextlib

    try:
        backend = job.backend(job.spec, job.device_ids, repeats=job.repeats, runtime=job.runtime,
                              step_fn=job.step_fn, batch_on_card0=job.batch_on_card0)
        try:
            result = backend.probe(job.chunk_sizes, job.output_device)
        finally:
            with contextlib.suppress(Exception):
                backend.close()
        return ("ok", result.to_dict())
    except UserCodeError as exc:
        return ("user", str(exc), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except DptuneError as exc:
        return ("dptune", type(exc).__name__, str(exc))
    except BaseException as exc:  # noqa: BLE001 - report anything to the parent
        return ("error", type(exc).__name__, str(exc),
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
