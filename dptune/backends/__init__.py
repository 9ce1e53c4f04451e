"""Backends that run probes: ``cuda`` (real GPUs) and ``simulated`` (virtual GPUs)."""

from dptune.backends.base import CATEGORIES, Backend, Device, ProbeResult

__all__ = ["Backend", "Device", "ProbeResult", "CATEGORIES"]
