"""The training monitor in Lightning: the callback :class:`MemoryMonitor`.

::

    import lightning.pytorch as pl
    from dptune.integrations.lightning import MemoryMonitor

    trainer = pl.Trainer(callbacks=[MemoryMonitor(plan="reports/mymodel")], max_steps=1000)
    trainer.fit(module, loader)       # then: dptune show lightning_logs/dptune-monitor

- The monitor (:class:`dptune.MemoryMonitor`) starts at ``on_train_start`` on the card of
  this process (``trainer.strategy.root_device``; each DDP/FSDP rank its own, with
  ``trainer.global_rank`` as its rank and its own files) and writes
  ``trainer.default_root_dir/dptune-monitor`` unless ``run_dir`` says otherwise.
- Each training batch is a step: its shape is read at ``on_train_batch_start`` (the
  ``length_key`` tensor of a dict batch, else the first tensor: ``(batch, length, ...)``) and
  the cards are read at ``on_train_batch_end`` (``every`` as the monitor's).
- The figures (``memory/rank0/card0/reserved_bytes.all.peak`` and the like, bytes) go to the
  trainer's loggers every ``log_every_n_steps`` (Lightning's loggers write on rank 0 only;
  every rank's files are merged by ``dptune show``). No collective runs.
- Out of memory: ``on_exception`` records the forensics; Lightning raises the same error on.
- Without a CUDA card the monitor warns once and nothing else happens.

Needs ``lightning`` (or the older ``pytorch_lightning``): ``pip install 'dptune[lightning]'``.
"""

from __future__ import annotations

import os
from typing import Any, Optional

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - the older package name
    try:
        import pytorch_lightning as pl  # type: ignore[no-redef]
    except ImportError as err:
        raise ImportError("dptune.integrations.lightning needs the lightning package: "
                          "pip install 'dptune[lightning]'") from err

from dptune.monitor import MemoryMonitor as _Monitor

__all__ = ["MemoryMonitor"]


def _shape(batch: Any, key: str) -> tuple[Optional[int], Optional[int]]:
    x = batch.get(key) if isinstance(batch, dict) else None
    if x is None:
        items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
        x = next((t for t in items if hasattr(t, "shape") and len(t.shape) >= 1), None)
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 1:
        return None, None
    return int(shape[0]), (int(shape[1]) if len(shape) > 1 else None)


class MemoryMonitor(pl.Callback):
    """A :class:`dptune.MemoryMonitor` run by Lightning (see the module docstring).

    ``plan``, ``every``, ``run_dir`` and every other keyword are the monitor's;
    ``length_key``: the key of a dict batch whose tensor is ``(batch, length)``.
    """

    def __init__(self, plan: Any = None, *, run_dir: "str | os.PathLike[str] | None" = None,
                 length_key: str = "input_ids", **monitor_options: Any) -> None:
        super().__init__()
        self.plan = plan
        self.run_dir = run_dir
        self.length_key = length_key
        self.options = monitor_options
        self.monitor: Optional[_Monitor] = None
        self._shape: tuple[Optional[int], Optional[int]] = (None, None)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        options = dict(self.options)
        device = trainer.strategy.root_device
        if "devices" not in options and device.type == "cuda" and device.index is not None:
            options["devices"] = [device.index]
        options.setdefault("rank", int(trainer.global_rank))
        run_dir = self.run_dir if self.run_dir is not None else os.path.join(trainer.default_root_dir,
                                                                               "dptune-monitor")
        self.monitor = _Monitor(self.plan, run_dir=run_dir, **options)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.monitor is not None and self.monitor.active:
            self._shape = _shape(batch, self.length_key)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        mon = self.monitor
        if mon is None or not mon.active:
            return
        mon.observe(*self._shape)
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        if mon.steps % every == 0:
            figures = mon.figures()
            if figures:
                for logger in trainer.loggers:
                    logger.log_metrics(figures, step=trainer.global_step)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        mon = self.monitor
        if mon is not None and mon.active:
            from dptune.monitor.forensics import is_oom

            if is_oom(exception):
                mon.record_oom(exception, *self._shape)
            mon.close()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
