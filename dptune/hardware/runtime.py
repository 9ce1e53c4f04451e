"""The CUDA runtime as the backend uses it: every ``torch.cuda`` and NVML call goes through
:class:`CudaRuntime` (tests pass a fake one)."""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any, Mapping, Optional, Sequence

from dptune.hardware.devices import format_uuid, nvml_handle, torch_pci
from dptune.errors import BackendUnavailableError, UsageError


class CudaRuntime:
    """The real CUDA runtime and NVML, as the backend uses them (device indices are torch's).

    NVML figures come from :mod:`dptune.hardware.nvml`, the card found as the device layer
    (:mod:`dptune.hardware.devices`) finds it: by UUID, then PCI bus id, never by index;
    where NVML is missing, or a card does not answer a query, the ``nvml_*`` methods return
    ``None`` (one warning per runtime for a failed query; :mod:`dptune.hardware.nvml` warns once for
    a missing library).
    """

    #: whether state snapshots should include the CUDA generators
    cuda_rng = True

    def __init__(self) -> None:
        self._handles: dict[int, Any] = {}
        self._warned = False

    def __getstate__(self) -> dict:   # NVML handles do not pickle; a child finds its own
        return {"_handles": {}, "_warned": False}

    # -- torch.cuda ------------------------------------------------------------------------
    def is_available(self) -> bool:
        import torch

        return bool(torch.cuda.is_available())

    def device_count(self) -> int:
        import torch

        return int(torch.cuda.device_count())

    def torch_device(self, d: int) -> Any:
        import torch

        return torch.device("cuda", d)

    def name(self, d: int) -> str:
        import torch

        return str(torch.cuda.get_device_name(d))

    def total(self, d: int) -> int:
        import torch

        return int(torch.cuda.get_device_properties(d).total_memory)

    def uuid(self, d: int) -> Optional[str]:
        """The card's UUID as :func:`~dptune.hardware.devices.format_uuid` writes it."""
        import torch

        from dptune.hardware import nvml as _nvml

        return format_uuid(_nvml.normalize_uuid(getattr(torch.cuda.get_device_properties(d), "uuid", None)))

    def pci_bus_id(self, d: int) -> Optional[str]:
        """The card's PCI bus id (NVML's form), from torch; ``None`` when unknown."""
        import torch

        return torch_pci(torch.cuda.get_device_properties(d))

    def mem_get_info(self, d: int) -> tuple[int, int]:
        import torch

        free, total = torch.cuda.mem_get_info(d)
        return int(free), int(total)

    def memory_allocated(self, d: int) -> int:
        import torch

        return int(torch.cuda.memory_allocated(d))

    def memory_reserved(self, d: int) -> int:
        import torch

        return int(torch.cuda.memory_reserved(d))

    def max_memory_allocated(self, d: int) -> int:
        import torch

        return int(torch.cuda.max_memory_allocated(d))

    def max_memory_reserved(self, d: int) -> int:
        import torch

        return int(torch.cuda.max_memory_reserved(d))

    def reset_peak_memory_stats(self, d: int) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(d)

    def memory_stats(self, d: int) -> Mapping[str, Any]:
        import torch

        return torch.cuda.memory_stats(d)

    def empty_cache(self) -> None:
        import torch

        torch.cuda.empty_cache()

    def synchronize(self, d: int) -> None:
        import torch

        torch.cuda.synchronize(d)

    def gc_collect(self) -> None:
        gc.collect()

    def event_clock(self) -> "CudaEventClock":
        """CUDA events for each card's own time in a step (:mod:`~dptune.backends.cuda.card_timer`)."""
        return CudaEventClock()

    # -- NVML ------------------------------------------------------------------------------
    def _warn(self, what: str, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"NVML could not {what} ({type(exc).__name__}: {exc}); dptune goes on "
                          "with the CUDA allocator's figures only", RuntimeWarning, stacklevel=3)

    def _handle(self, d: int) -> Any:
        if d in self._handles:
            return self._handles[d]
        handle = None
        try:   # the device layer's matching: by UUID, then PCI bus id, never by index
            handle = nvml_handle(self.uuid(d), lambda: self.pci_bus_id(d))
        except Exception as exc:  # noqa: BLE001 - NVML must never break a probe
            self._warn(f"find card {d} by UUID or PCI bus id", exc)
            handle = None
        self._handles[d] = handle
        return handle

    def nvml_used(self, d: int) -> Optional[int]:
        """Bytes in use on the whole card (every process), NVML's view; ``None`` if unknown."""
        handle = self._handle(d)
        if handle is None:
            return None
        try:
            from dptune.hardware import nvml as _nvml

            info = _nvml.memory_info(handle)
        except Exception as exc:  # noqa: BLE001
            self._warn(f"read card {d}'s memory", exc)
            return None
        return None if info is None else int(info.used)

    def nvml_process_used(self, d: int) -> Optional[int]:
        """Bytes this process holds on the card (context + allocator), NVML's view, or ``None``."""
        handle = self._handle(d)
        if handle is None:
            return None
        try:
            from dptune.hardware import nvml as _nvml

            m = _nvml.nvml()
            if m is None:
                return None
            procs = m.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # noqa: BLE001 - unsupported query: context unknown, no warning
            return None
        pid = os.getpid()
        for p in procs or ():
            if getattr(p, "pid", None) == pid:
                used = getattr(p, "usedGpuMemory", None)
                return int(used) if isinstance(used, int) and used >= 0 else None
        return None


class CudaEventClock:
    """Timing events (``torch.cuda.Event(enable_timing=True)``) on a card's current stream."""

    def record(self, device: int) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def elapsed(self, start: Any, end: Any) -> float:
        return float(start.elapsed_time(end)) / 1e3      # elapsed_time is in milliseconds

    def current_device(self) -> Optional[int]:
        import torch

        return int(torch.cuda.current_device())


def _ids_text(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in ids)


def check_devices(device_ids: Optional[Sequence[int]], runtime: Any = None) -> list[int]:
    """The CUDA cards to use: ``device_ids`` checked against what torch sees, or every
    visible card. Raises :class:`UsageError` for a malformed list and
    :class:`BackendUnavailableError` (saying why: no CUDA build, ``CUDA_VISIBLE_DEVICES``,
    how torch numbers the cards) when they are not all visible. The one check, for the tuner's
    choice of backend and for a backend built directly."""
    rt = runtime if runtime is not None else CudaRuntime()
    if device_ids is not None:
        ids = list(device_ids)
        if not ids:
            raise UsageError("device_ids is empty; give at least one CUDA device index, e.g. [0, 1]")
        for d in ids:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise UsageError(f"device_ids must be non-negative ints (torch device indices), got {ids!r}")
        if len(set(ids)) != len(ids):
            raise UsageError(f"device_ids {ids} names a card twice")
    else:
        ids = None
    asked = f"GPUs {_ids_text(ids)} were" if ids else "real GPUs (all visible ones) were"
    hint = ("; to tune without GPUs, simulate a cluster: Tuner(..., simulate='4x24GB') or "
            "`dptune search ... --simulate 4x24GB`")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    cvd_text = f"CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "CUDA_VISIBLE_DEVICES is not set"
    if not rt.is_available():
        why = "torch.cuda.is_available() is False"
        if isinstance(rt, CudaRuntime):
            import torch

            if getattr(torch.version, "cuda", None) is None:
                why += f"; this torch build has no CUDA support: torch {torch.__version__}"
        why += f"; {cvd_text}"
        raise BackendUnavailableError(f"{asked} asked for but torch sees none ({why}){hint}")
    count = rt.device_count()
    if ids is None:
        if count < 1:
            raise BackendUnavailableError(f"{asked} asked for but torch sees none ({cvd_text}){hint}")
        return list(range(count))
    missing = [d for d in ids if d >= count]
    if missing:
        raise BackendUnavailableError(
            f"GPU{'s' if len(missing) > 1 else ''} {_ids_text(missing)} "
            f"{'were' if len(missing) > 1 else 'was'} asked for but only {count} "
            f"{'is' if count == 1 else 'are'} visible ({cvd_text}); torch numbers the visible "
            f"cards 0..{count - 1}{hint}")
    return ids


def alloc_retries(rt: Any, device: int, default: int) -> int:
    """The allocator's ``num_alloc_retries`` counter on ``device`` (``default`` when absent)."""
    return int(rt.memory_stats(device).get("num_alloc_retries", default))
