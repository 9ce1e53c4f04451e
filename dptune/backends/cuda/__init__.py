"""Real-GPU probes: one DataParallel training step per probe, measured by the CUDA allocator.

The modules, bottom to top: :mod:`~dptune.hardware.devices` (the one device layer: the
visible cards matched to NVML, used by ``dptune devices`` too),
:mod:`~dptune.hardware.runtime` (every ``torch.cuda`` and NVML call of a probe, and
:func:`check_devices`), :mod:`~dptune.backends.cuda.step` (the step a probe runs) and
:mod:`~dptune.backends.cuda.backend` (:class:`CudaBackend`: the measurement protocol, in its
docstring, and isolation).

The names below are imported on first use, so that the device layer stays light.
"""

from __future__ import annotations

from dptune._lazy import lazy_names

__all__ = ["CudaBackend", "CudaRuntime", "StepContext", "default_step", "check_devices"]

_HOME = {"CudaBackend": "dptune.backends.cuda.backend", "CudaRuntime": "dptune.hardware.runtime",
         "check_devices": "dptune.hardware.runtime", "StepContext": "dptune.backends.cuda.step",
         "default_step": "dptune.backends.cuda.step"}


__getattr__, __dir__ = lazy_names(__name__, _HOME, globals(), __all__)
