"""Real-GPU probes: one DataParallel training step per probe, measured by the CUDA allocator.

The modules, bottom to top: :mod:`~dptune.backends.cuda.runtime` (every ``torch.cuda`` and
NVML call), :mod:`~dptune.backends.cuda.devices` (which cards: the one check),
:mod:`~dptune.backends.cuda.step` (the step a probe runs) and
:mod:`~dptune.backends.cuda.backend` (:class:`CudaBackend`: the measurement protocol, in its
docstring, and isolation).
"""

from dptune.backends.cuda.backend import CudaBackend
from dptune.backends.cuda.devices import check_devices
from dptune.backends.cuda.runtime import CudaRuntime
from dptune.backends.cuda.step import StepContext, default_step

__all__ = ["CudaBackend", "CudaRuntime", "StepContext", "default_step", "check_devices"]
