"""How the monitor reads a card: a small protocol over the CUDA runtime, and one reading.

The monitor never calls ``torch.cuda`` or NVML itself: it asks a runtime with the few methods
of :class:`CardRuntime`, which the real-GPU backend's runtime
(:class:`dptune.hardware.runtime.CudaRuntime`: torch's allocator statistics, NVML's
figures for the whole card found by UUID) already has, and which tests fake with per-card
memory models. :func:`default_runtime` is the one place that names the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

__all__ = ["CardRuntime", "CardReading", "default_runtime", "read_card", "current_device", "TORCH_KEYS"]

#: the allocator statistics the monitor keeps, under ``torch.cuda.memory_stats``'s own names
TORCH_KEYS = ("allocated_bytes.all.peak", "reserved_bytes.all.peak",
              "allocated_bytes.all.current", "reserved_bytes.all.current",
              "num_alloc_retries", "num_ooms")


class CardRuntime(Protocol):
    """What the monitor asks of the CUDA runtime (device indices are torch's)."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...

    def name(self, d: int) -> str: ...

    def total(self, d: int) -> int: ...

    def uuid(self, d: int) -> Optional[str]: ...

    def memory_stats(self, d: int) -> Mapping[str, Any]: ...

    def reset_peak_memory_stats(self, d: int) -> None: ...

    def mem_get_info(self, d: int) -> tuple[int, int]: ...

    def nvml_used(self, d: int) -> Optional[int]: ...


def default_runtime() -> CardRuntime:
    """The real CUDA runtime (torch and NVML, both imported only when first asked)."""
    from dptune.hardware.runtime import CudaRuntime

    return CudaRuntime()


@dataclass(frozen=True)
class CardReading:
    """One card's figures after a step, in bytes.

    ``allocated_peak``/``reserved_peak``: ``allocated_bytes.all.peak`` and
    ``reserved_bytes.all.peak`` as torch reports them (since the last reset of the peaks);
    ``nvml_used``: the whole card's used memory (every process; ``None`` without NVML);
    ``free``: what the driver can still give (``total - nvml_used``, or ``mem_get_info``'s
    free without NVML).
    """

    allocated_peak: int
    reserved_peak: int
    allocated: int
    reserved: int
    retries: int
    ooms: int
    total: int
    free: int
    nvml_used: Optional[int]

    @property
    def headroom(self) -> int:
        """The room left on the card at this process's reserved peak: what is free now, plus
        what this process reserves now (it is part of the peak), less the peak."""
        return self.free + self.reserved - self.reserved_peak

    def torch_stats(self) -> dict[str, int]:
        """The allocator figures under ``torch.cuda.memory_stats``'s key names."""
        return dict(zip(TORCH_KEYS, (self.allocated_peak, self.reserved_peak, self.allocated,
                                     self.reserved, self.retries, self.ooms)))


def read_card(rt: CardRuntime, d: int, total: int) -> CardReading:
    """Card ``d``'s reading now (``total``: its capacity, read once by the caller); a key
    the allocator has not reported yet (no allocation so far) reads 0."""
    get = rt.memory_stats(d).get
    reserved = int(get("reserved_bytes.all.current") or 0)
    used = rt.nvml_used(d)
    free = total - used if used is not None else int(rt.mem_get_info(d)[0])
    return CardReading(allocated_peak=int(get("allocated_bytes.all.peak") or 0),
                       reserved_peak=int(get("reserved_bytes.all.peak") or 0),
                       allocated=int(get("allocated_bytes.all.current") or 0), reserved=reserved,
                       retries=int(get("num_alloc_retries") or 0), ooms=int(get("num_ooms") or 0),
                       total=total, free=free, nvml_used=used)


def current_device(rt: Any) -> int:
    """The card this process trains on (a DDP rank's own): the runtime's current device."""
    ask = getattr(rt, "current_device", None)
    if ask is None:
        clock = getattr(rt, "event_clock", None)
        ask = None if clock is None else clock().current_device
    found = None if ask is None else ask()
    return 0 if found is None else int(found)
