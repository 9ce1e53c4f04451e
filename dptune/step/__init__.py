"""The user's training step, described once: the workload and its settings
(:mod:`~dptune.step.workload`), the same by import strings (:mod:`~dptune.step.spec`,
:mod:`~dptune.step.importer`, :mod:`~dptune.step.presets`), what a probe leaves untouched
(:mod:`~dptune.step.state`), torch's container rules (:mod:`~dptune.step.tree`), out-of-memory
recognition (:mod:`~dptune.step.oom`) and advice from what a probe saw
(:mod:`~dptune.step.advice`).
"""
