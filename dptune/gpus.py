"""The CUDA GPUs this process can see (``dptune devices``, :func:`dptune.devices`).

The device layer lives in :mod:`dptune.backends.cuda.devices`, shared with the real-GPU
backend; this module keeps the public names where they were.
"""

from __future__ import annotations

from dptune.backends.cuda.devices import GpuInfo, devices, format_devices

__all__ = ["GpuInfo", "devices", "format_devices"]
