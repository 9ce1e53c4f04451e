"""dptune: measure per-GPU memory of a DataParallel training step and balance the split.

Importing dptune is cheap: it imports neither torch's CUDA runtime, NVML, pandas nor
matplotlib, and prints nothing. Public names are loaded on first use.

Public API (grouped):

- Tuning: :class:`Tuner`, :class:`TuneResult`, :func:`load_result` (a saved report; its
  ``.wrap(model)`` reuses the split), :class:`StepSettings` (what a split was tuned for),
  :class:`Workload` (the training step), :class:`WorkloadSpec` (the same, by import strings),
  :class:`Budget` (what each card is checked against), :class:`SearchSettings` (how hard
  the search looks)
- Wrapping: :class:`BalancedDataParallel`, :func:`patch_dataparallel` (scripts that build
  ``torch.nn.DataParallel`` themselves); the Hugging Face Trainer: :mod:`dptune.integrations.transformers`
- Simulation: :func:`estimate_memory`, :class:`Cluster`, :func:`parse_cluster`
- Watching a run: :class:`MemoryMonitor` (every card against the plan, at training time)
- Devices: :func:`devices`, :class:`Device`, :class:`ProbeResult`
- Checkpoints: :func:`state_dict`, :func:`load_state_dict`
- Units: :func:`parse_bytes`, :func:`format_bytes`
- Errors: :class:`DptuneError` and its subclasses (see :mod:`dptune.errors`)
"""

from __future__ import annotations

from dptune._lazy import lazy_names

__version__ = "0.1.0"

_LAZY = {
    # tuning
    "Tuner": "dptune.tuner",
    "TuneResult": "dptune.result.model",
    "load_result": "dptune.result.model",
    "StepSettings": "dptune.step.workload",
    "Workload": "dptune.step.workload",
    "WorkloadSpec": "dptune.step.spec",
    "Budget": "dptune.settings",
    "SearchSettings": "dptune.settings",
    # wrapping
    "BalancedDataParallel": "dptune.parallel",
    "patch_dataparallel": "dptune.integrations.dataparallel",
    # simulation
    "estimate_memory": "dptune.backends.simulated",
    "Cluster": "dptune.hardware.cluster",
    "parse_cluster": "dptune.hardware.cluster",
    # watching a run
    "MemoryMonitor": "dptune.monitor",
    # devices
    "devices": "dptune.hardware.devices",
    "Device": "dptune.types",
    "ProbeResult": "dptune.types",
    # checkpoints
    "state_dict": "dptune.checkpoint",
    "load_state_dict": "dptune.checkpoint",
    # units
    "parse_bytes": "dptune.units",
    "format_bytes": "dptune.units",
    # errors
    "DptuneError": "dptune.errors",
    "UsageError": "dptune.errors",
    "SpecError": "dptune.errors",
    "ImportStringError": "dptune.errors",
    "ReportError": "dptune.errors",
    "OutputError": "dptune.errors",
    "NoFeasibleSplitError": "dptune.errors",
    "BackendUnavailableError": "dptune.errors",
    "UserCodeError": "dptune.errors",
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals(), __all__)
