"""A lazy, forgiving wrapper around NVML (``pynvml`` from the ``nvidia-ml-py`` package).

NVML is imported and initialised on the first call to :func:`nvml` (never at import time)
and shut down at exit. Where it cannot be used (the package is missing, no driver, a
driver/library mismatch) :func:`nvml` returns ``None`` and one warning is given per process;
callers then go on with what the CUDA allocator knows. Queries a card does not support (or
that fail) return ``None`` instead of raising.

Cards are found by UUID (:func:`handle_by_uuid`) or PCI bus id (:func:`handle_by_pci`),
never by index: CUDA numbers cards fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
and ``CUDA_VISIBLE_DEVICES`` renumbers them, while NVML numbers all cards in PCI order.

Tests replace the library with a fake: monkeypatch :func:`_import_pynvml` and call
:func:`reset` (or call ``reset(module)`` with the fake module).

All memory figures are ``int`` bytes.
"""

from __future__ import annotations

import atexit
import threading
import warnings
from typing import Any, NamedTuple, Optional

__all__ = [
    "MemoryInfo", "nvml", "reset", "handles", "handle_by_uuid", "handle_by_pci",
    "memory_info", "device_uuid", "device_pci_bus_id", "normalize_uuid", "normalize_pci",
]

_lock = threading.Lock()
_module: Any = None          # the initialised pynvml module
_tried = False               # whether nvml() ran its import + init already
_warned = False              # the one warning per process about a missing NVML
_injected: Any = None        # a module given to reset() (tests)
_atexit_registered = False


class MemoryInfo(NamedTuple):
    """A card's memory as NVML reports it, in bytes (``free`` is what can still be taken).

    With the v2 query (drivers >= 510) ``used`` excludes memory the driver reserves, as
    ``nvidia-smi`` shows it; with v1 it includes it.
    """

    total: int
    free: int
    used: int


def _import_pynvml() -> Any:
    """Import the NVML bindings (replaced in tests)."""
    import pynvml

    return pynvml


def _warn_once(reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"NVML is not available ({reason}); dptune goes on with what the CUDA allocator knows "
        "and cannot see memory used by other processes. HINT: install it with "
        "`pip install nvidia-ml-py` and check the NVIDIA driver with `nvidia-smi`",
        RuntimeWarning, stacklevel=3)


def _shutdown() -> None:
    module = _module
    if module is not None:
        try:
            module.nvmlShutdown()
        except Exception:  # at exit, nothing to do about it
            pass


def nvml() -> Any:
    """The initialised ``pynvml`` module, or ``None`` (with one warning) where NVML is unusable."""
    global _module, _tried, _atexit_registered
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            module = _injected if _injected is not None else _import_pynvml()
        except ImportError as e:
            _warn_once(f"cannot import pynvml: {e}")
            return None
        try:
            module.nvmlInit()
        except Exception as e:  # NVMLError: no driver, library mismatch, no permission
            _warn_once(f"nvmlInit failed: {type(e).__name__}: {e}")
            return None
        _module = module
        if not _atexit_registered:
            atexit.register(_shutdown)
            _atexit_registered = True
        return _module


def reset(module: Any = None) -> None:
    """Forget the initialised library (shutting it down) so the next :func:`nvml` starts again.

    ``module``: a stand-in for ``pynvml`` to use from now on (tests); ``None`` goes back to
    importing the real one. The once-per-process warning may be given again after a reset.
    """
    global _module, _tried, _warned, _injected
    with _lock:
        _shutdown()
        _module = None
        _tried = False
        _warned = False
        _injected = module


def _errors(m: Any) -> tuple:
    err = getattr(m, "NVMLError", None)
    return (err,) if isinstance(err, type) else (Exception,)


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def normalize_uuid(uuid: Any) -> Optional[str]:
    """A UUID as 32 lowercase hex digits, from NVML's ``'GPU-xxxxxxxx-...'``, a plain UUID
    string, bytes, or torch's ``_CUuuid`` (which has ``.bytes``). ``MIG-`` UUIDs keep their
    prefix so that they never match a whole card. ``None`` when there is none."""
    if uuid is None:
        return None
    raw = getattr(uuid, "bytes", None)
    if raw is not None and not isinstance(uuid, (str, bytes)):
        try:
            return bytes(raw).hex()
        except (TypeError, ValueError):
            pass
    text = _text(uuid).strip().lower()
    mig = text.startswith("mig-")
    if text.startswith(("gpu-", "mig-")):
        text = text[4:]
    text = text.replace("-", "")
    if not text:
        return None
    return ("mig-" + text) if mig else text


def normalize_pci(bus_id: Any) -> Optional[tuple[int, int, int, int]]:
    """A PCI bus id such as ``'00000000:3B:00.0'`` or ``'0000:3b:00.0'`` as
    ``(domain, bus, device, function)``; ``None`` when it does not parse."""
    if bus_id is None:
        return None
    text = _text(bus_id).strip()
    try:
        head, func = text.rsplit(".", 1)
        parts = head.split(":")
        if len(parts) == 2:
            parts = ["0"] + parts
        domain, bus, dev = parts
        return int(domain, 16), int(bus, 16), int(dev, 16), int(func, 16)
    except ValueError:
        return None


def handles() -> list:
    """Every card's NVML handle, in NVML's (PCI) order; ``[]`` without NVML."""
    m = nvml()
    if m is None:
        return []
    try:
        count = m.nvmlDeviceGetCount()
        return [m.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except _errors(m):
        return []


def device_uuid(handle: Any) -> Optional[str]:
    """NVML's UUID of a card, e.g. ``'GPU-5e3a...'``; ``None`` when it cannot be read."""
    m = nvml()
    if m is None or handle is None:
        return None
    try:
        return _text(m.nvmlDeviceGetUUID(handle))
    except _errors(m):
        return None


def device_pci_bus_id(handle: Any) -> Optional[str]:
    """NVML's PCI bus id of a card, e.g. ``'00000000:3B:00.0'``; ``None`` when unknown."""
    m = nvml()
    if m is None or handle is None:
        return None
    try:
        info = m.nvmlDeviceGetPciInfo(handle)
    except _errors(m):
        return None
    bus = getattr(info, "busId", None) or getattr(info, "busIdLegacy", None)
    return _text(bus) if bus is not None else None


def handle_by_uuid(uuid: Any) -> Any:
    """The NVML handle of the card with this UUID (any form :func:`normalize_uuid` reads)."""
    want = normalize_uuid(uuid)
    if want is None:
        return None
    for h in handles():
        if normalize_uuid(device_uuid(h)) == want:
            return h
    return None


def handle_by_pci(bus_id: Any) -> Any:
    """The NVML handle of the card at this PCI bus id (any form :func:`normalize_pci` reads)."""
    want = normalize_pci(bus_id)
    if want is None:
        return None
    for h in handles():
        if normalize_pci(device_pci_bus_id(h)) == want:
            return h
    return None


def memory_info(handle: Any) -> Optional[MemoryInfo]:
    """``MemoryInfo(total, free, used)`` of a card in bytes; ``None`` when NVML cannot say.

    Uses the v2 query where the driver and bindings have it, else v1.
    """
    m = nvml()
    if m is None or handle is None:
        return None
    errors = _errors(m)
    info = None
    v2 = getattr(m, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            info = m.nvmlDeviceGetMemoryInfo(handle, version=v2)
        except (TypeError, *errors):
            info = None
    if info is None:
        try:
            info = m.nvmlDeviceGetMemoryInfo(handle)
        except errors:
            return None
    try:
        return MemoryInfo(int(info.total), int(info.free), int(info.used))
    except (AttributeError, TypeError, ValueError):
        return None
