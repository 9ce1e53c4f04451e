"""The profiler at training time: every card watched during the real run, against the plan.

- :class:`MemoryMonitor` (also ``dptune.MemoryMonitor``): reads each card after each step (or
  every N) through the CUDA runtime (:mod:`dptune.monitor.cards`), compares the step's peak
  with the plan's prediction for its shape (:mod:`dptune.monitor.expect`), warns of drift,
  thin headroom, fragmentation and out-of-memory errors (:mod:`dptune.monitor.events`), and
  writes the run's folder (:mod:`dptune.monitor.record`);
- :func:`load_run`: a run's folder, every rank's files merged (``dptune show RUN`` prints it
  and draws ``timeline.png`` with :mod:`dptune.report.timeline`);
- callbacks: :mod:`dptune.integrations.monitor_transformers` (Hugging Face Trainer) and
  :mod:`dptune.integrations.lightning` (Lightning).

Importing this package imports neither torch nor NVML.
"""

from __future__ import annotations

from dptune.monitor.events import EventKind, MonitorEvent, MonitorWarning
from dptune.monitor.monitor import MemoryMonitor, StepScope
from dptune.monitor.record import CardInfo, RunRecord, is_run, load_run

__all__ = ["MemoryMonitor", "StepScope", "EventKind", "MonitorEvent", "MonitorWarning", "RunRecord",
           "CardInfo", "load_run", "is_run"]
