"""The cards: the card table and the cluster spec (:mod:`~dptune.hardware.cluster`), their
speeds and links (:mod:`~dptune.hardware.speeds`), NVML (:mod:`~dptune.hardware.nvml`), the
visible CUDA cards (:mod:`~dptune.hardware.devices`) and the CUDA runtime readers
(:mod:`~dptune.hardware.runtime`), shared by the CUDA backend and the training-time monitor.
"""
