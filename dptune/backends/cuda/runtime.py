"""The CUDA runtime as the backend uses it: every ``torch.cuda`` and NVML call goes through
:class:`CudaRuntime` (tests pass a fake one)."""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any, Mapping, Optional


class CudaRuntime:
    """The real CUDA runtime and NVML, as the backend uses them (device indices are torch's).

    NVML figures come from :mod:`dptune._nvml` (cards matched by UUID, never by index);
    where NVML is missing, or a card does not answer a query, the ``nvml_*`` methods return
    ``None`` (one warning per runtime for a failed query; :mod:`dptune._nvml` warns once for
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
        import torch

        from dptune import _nvml

        norm = _nvml.normalize_uuid(getattr(torch.cuda.get_device_properties(d), "uuid", None))
        if norm is None or norm.startswith("mig-") or len(norm) != 32:
            return None if norm is None else norm
        return "GPU-" + "-".join((norm[:8], norm[8:12], norm[12:16], norm[16:20], norm[20:]))

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
        try:
            from dptune import _nvml

            if _nvml.nvml() is not None:
                uuid = self.uuid(d)
                handle = _nvml.handle_by_uuid(uuid) if uuid and not uuid.lower().startswith("mig-") else None
        except Exception as exc:  # noqa: BLE001 - NVML must never break a probe
            self._warn(f"find card {d} by UUID", exc)
            handle = None
        self._handles[d] = handle
        return handle

    def nvml_used(self, d: int) -> Optional[int]:
        """Bytes in use on the whole card (every process), NVML's view; ``None`` if unknown."""
        handle = self._handle(d)
        if handle is None:
            return None
        try:
            from dptune import _nvml

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
            from dptune import _nvml

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
