"""The one device layer: the CUDA cards this process can see, matched to NVML.

:func:`devices` lists them in torch's numbering (which follows ``CUDA_VISIBLE_DEVICES``),
with what NVML adds where it is available: memory used on the card by anyone, the UUID and
PCI bus id. Cards are matched to NVML by UUID, then by PCI bus id, never by index
(:func:`nvml_handle`), and UUIDs are written one way (:func:`format_uuid`): ``dptune devices``
and the real-GPU backend's runtime (:class:`dptune.hardware.runtime.CudaRuntime`) both
use these. Without CUDA the list is empty and CUDA is not initialised; without NVML the list
holds what torch knows (``used_bytes`` is ``None``) and one warning is given.

Known limitations: a MIG instance is not matched to NVML (its memory figures would be the
whole card's), so its ``used_bytes`` is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dptune.hardware import nvml as _nvml

__all__ = ["GpuInfo", "devices", "format_uuid", "nvml_handle", "torch_pci"]


@dataclass(frozen=True)
class GpuInfo:
    """One visible CUDA GPU. Memory in bytes.

    ``used_bytes`` is memory in use on the card by every process, as NVML reports it
    (``None`` when NVML is unavailable or cannot say). ``nvml_handle`` is NVML's handle for
    the card (``None`` without NVML); it is not compared nor shown.
    """

    index: int                       # torch device index (after CUDA_VISIBLE_DEVICES)
    name: str
    total_bytes: int
    used_bytes: Optional[int] = None
    uuid: Optional[str] = None       # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    pci_bus_id: Optional[str] = None  # "00000000:3B:00.0"
    nvml_handle: Any = field(default=None, compare=False, repr=False)


def format_uuid(norm: Optional[str]) -> Optional[str]:
    """A UUID from :func:`dptune.hardware.nvml.normalize_uuid` as CUDA and NVML print it: 32 hex
    digits -> ``GPU-8-4-4-4-12``, a MIG UUID as ``MIG-...`` (``None`` stays ``None``)."""
    if norm is None:
        return None
    if norm.startswith("mig-"):
        return "MIG-" + norm[4:]
    if len(norm) != 32:
        return norm
    return "GPU-" + "-".join((norm[:8], norm[8:12], norm[12:16], norm[16:20], norm[20:]))


def nvml_handle(uuid: Any, pci: Callable[[], Optional[str]]) -> Any:
    """The NVML handle of a torch card: by UUID, else by PCI bus id (``pci()`` is asked only
    then), never by index; ``None`` without NVML and for a MIG instance (NVML's figures for
    it would be the whole card's)."""
    norm = _nvml.normalize_uuid(uuid)
    if _nvml.nvml() is None or (norm is not None and norm.startswith("mig-")):
        return None
    handle = _nvml.handle_by_uuid(uuid) if norm is not None else None
    if handle is None:
        bus = pci()
        if bus is not None:
            handle = _nvml.handle_by_pci(bus)
    return handle


def torch_pci(props: Any) -> Optional[str]:
    """A card's PCI bus id from torch's device properties, NVML's form; ``None`` if unknown."""
    try:
        domain = int(props.pci_domain_id)
        bus = int(props.pci_bus_id)
        dev = int(props.pci_device_id)
    except (AttributeError, TypeError, ValueError):
        return None
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def _gpu(index: int) -> GpuInfo:
    import torch

    props = torch.cuda.get_device_properties(index)
    try:
        name = torch.cuda.get_device_name(index)
    except Exception:
        name = getattr(props, "name", f"cuda:{index}")
    total = int(props.total_memory)
    norm = _nvml.normalize_uuid(getattr(props, "uuid", None))
    pci = torch_pci(props)
    handle = nvml_handle(norm, lambda: pci)
    used = None
    uuid = format_uuid(norm)
    if handle is not None:
        mem = _nvml.memory_info(handle)
        used = mem.used if mem is not None else None
        uuid = _nvml.device_uuid(handle) or uuid
        pci = _nvml.device_pci_bus_id(handle) or pci
    return GpuInfo(index=index, name=str(name), total_bytes=total, used_bytes=used, uuid=uuid,
                   pci_bus_id=pci, nvml_handle=handle)


def devices() -> list[GpuInfo]:
    """The CUDA GPUs this process can see, in torch's order; ``[]`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [_gpu(i) for i in range(torch.cuda.device_count())]

