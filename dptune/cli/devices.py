"""The CUDA GPUs this process can see (``dptune devices``, :func:`dptune.devices`).

The device layer lives in :mod:`dptune.hardware.devices`, shared with the real-GPU
backend; this module keeps the public names where they were, and renders the list as a table
(:func:`format_devices`, with the one table renderer of :mod:`dptune.report.tables`).
"""

from __future__ import annotations

from typing import Sequence

from dptune.hardware.devices import GpuInfo, devices
from dptune.units import format_bytes

__all__ = ["GpuInfo", "devices", "format_devices"]


def format_devices(gpus: Sequence[GpuInfo]) -> str:
    """A table of the GPUs (index, name, total, used, UUID) for ``dptune devices``."""
    from dptune.report.tables import text_table

    if not gpus:
        return ("no CUDA GPU is visible (torch.cuda.is_available() is False); check the NVIDIA "
                "driver with `nvidia-smi`, that torch is a CUDA build, and CUDA_VISIBLE_DEVICES")
    rows = [(str(g.index), g.name, format_bytes(g.total_bytes), format_bytes(g.used_bytes),
             g.uuid or "n/a") for g in gpus]
    lines = text_table(("index", "name", "total", "used", "uuid"), rows)
    if any(g.used_bytes is None for g in gpus):
        lines.append("used: n/a where NVML cannot say (see the warning, if any)")
    return "\n".join(lines)
