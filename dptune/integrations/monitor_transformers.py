"""The training monitor in the Hugging Face ``Trainer``: :class:`MemoryMonitorCallback`.

::

    from dptune.integrations.transformers import MemoryMonitorCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    MemoryMonitorCallback(plan="reports/mymodel").attach(trainer)
    trainer.train()            # then: dptune show out/dptune-monitor

- The monitor (:class:`dptune.MemoryMonitor`) starts at ``on_train_begin`` (under ``torchrun``
  on each rank's own card, ``args.device``) and writes ``args.output_dir/dptune-monitor``
  unless ``run_dir`` says otherwise; it reads the cards at ``on_step_end`` (each optimizer
  step; ``every`` as the monitor's) and closes at ``on_train_end``.
- The step's shape: a forward pre-hook on the model reads the batch size and length of the
  ``length_key`` input (``input_ids`` by default, else the first tensor argument) and only
  reads them; the step's shape is its largest micro-batch's. Under ``nn.DataParallel`` the
  replicas see their chunks, so only the length is taken there. The hook is removed at the end.
- The Trainer's logs: ``on_log`` adds each card's last figures (``memory/rank0/card1/
  reserved_bytes.all.peak`` and the like, bytes) to the logs and to ``state.log_history``.
  The reporting callbacks (TensorBoard, W&B) run before one added by ``Trainer(callbacks=)``
  or ``add_callback``; :meth:`MemoryMonitorCallback.attach` puts this one first so that they
  log the figures too. Under DDP each rank's logs carry its own card, and rank 0 is the one
  that reports: the other ranks' figures are in their own files, merged by ``dptune show``.
- Out of memory: the Trainer gives callbacks no hook for an error; ``with callback.guard():
  trainer.train()`` records the forensics (the shape of the forward that ran out) and lets
  the same exception go on.
- Without a CUDA card the monitor warns once and nothing else happens (no hook either).
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

import transformers

from dptune.monitor import MemoryMonitor

__all__ = ["MemoryMonitorCallback"]


class _Guard:
    def __init__(self, callback: "MemoryMonitorCallback") -> None:
        self.callback = callback

    def __enter__(self) -> "MemoryMonitorCallback":
        return self.callback

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> Literal[False]:
        mon = self.callback.monitor
        if exc is not None and mon is not None and mon.active:
            from dptune.monitor.forensics import is_oom

            if is_oom(exc):
                b, n = self.callback._shape
                mon.record_oom(exc, b, n, step=self.callback._step + 1)
        return False


class MemoryMonitorCallback(transformers.TrainerCallback):
    """A :class:`dptune.MemoryMonitor` run by the Trainer (see the module docstring).

    ``plan``, ``every``, ``run_dir`` and every other keyword are the monitor's
    (``monitor_options``); ``length_key``: the input whose shape is ``(batch, length)``.
    """

    def __init__(self, plan: Any = None, *, run_dir: "str | os.PathLike[str] | None" = None,
                 length_key: str = "input_ids", **monitor_options: Any) -> None:
        self.plan = plan
        self.run_dir = run_dir
        self.length_key = length_key
        self.options = monitor_options
        self.monitor: Optional[MemoryMonitor] = None
        self._hook: Any = None
        self._model: Any = None
        self._shape: tuple[Optional[int], Optional[int]] = (None, None)
        self._step = 0

    def attach(self, trainer: Any) -> "MemoryMonitorCallback":
        """Add this callback to ``trainer`` first, before the reporting callbacks, so that
        the figures it adds to the logs reach TensorBoard, W&B and the like."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def guard(self) -> _Guard:
        """``with callback.guard(): trainer.train()``: out-of-memory forensics."""
        return _Guard(self)

    # ---- the shape of each step ------------------------------------------------------------
    def _see(self, module: Any, args: tuple, kwargs: dict) -> None:
        x = kwargs.get(self.length_key)
        if x is None:
            x = next((a for a in args if hasattr(a, "shape")), None)
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < 1:
            return
        top = module is self._model       # a DataParallel replica sees its chunk only
        b = int(shape[0]) if top else None
        n = int(shape[1]) if len(shape) > 1 else None
        old_b, old_n = self._shape
        self._shape = (b if old_b is None or (b is not None and b > old_b) else old_b,
                       n if old_n is None or (n is not None and n > old_n) else old_n)

    # ---- the Trainer's events ----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.monitor is not None:          # a second train() on the same callback
            self.monitor.close()
        options = dict(self.options)
        device: Any = getattr(args, "device", None)
        index = getattr(device, "index", None)
        if "devices" not in options and getattr(device, "type", None) == "cuda" and \
                getattr(args, "world_size", 1) > 1 and index is not None:
            options["devices"] = [index]
        run_dir = self.run_dir if self.run_dir is not None else os.path.join(args.output_dir, "dptune-monitor")
        self.monitor = MemoryMonitor(self.plan, run_dir=run_dir, **options)
        self._step = int(getattr(state, "global_step", 0) or 0)
        if self.monitor.active and model is not None:
            self._model = model
            self._hook = model.register_forward_pre_hook(self._see, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is None:
            return
        self._step = int(state.global_step)
        b, n = self._shape
        self._shape = (None, None)
        self.monitor.observe(b, n, step=self._step)

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict] = None, **kwargs: Any) -> None:
        if self.monitor is None or logs is None:
            return
        figures = self.monitor.figures()
        logs.update(figures)
        history = getattr(state, "log_history", None)
        if figures and history and history[-1].get("step") == state.global_step:
            history[-1].update(figures)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = self._model = None
        if self.monitor is not None:
            self.monitor.close()
