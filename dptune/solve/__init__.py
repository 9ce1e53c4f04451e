"""Pure arithmetic, no torch: per-card memory fits and the integer splits they imply
(:mod:`~dptune.solve.memory`); time fits and the fastest split (:mod:`~dptune.solve.time`).
"""
