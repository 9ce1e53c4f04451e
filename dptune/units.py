"""Byte quantities: ``int`` bytes inside dptune, human strings only at the edges."""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["parse_bytes", "format_bytes", "GiB", "MiB", "KiB"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": KiB,
    "m": 1000**2, "mb": 1000**2, "mib": MiB,
    "g": 1000**3, "gb": 1000**3, "gib": GiB,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, gb_is_gib: bool = False) -> int:
    """Parse ``"1.5GiB"``, ``"512MB"``, ``"2G"`` or a number of bytes into ``int`` bytes.

    SI units (kB, MB, GB) are powers of 1000 and IEC units (KiB, MiB, GiB) powers of 1024,
    unless ``gb_is_gib`` is true: GPU vendors' "24GB" cards hold 24 GiB, so cluster specs
    read GB as GiB. The figure is read exactly (``"0.1GB"`` is 100000000 bytes, and a
    30-digit count stays that count), rounded to whole bytes only at the end.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a byte size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"byte size must be >= 0, got {value!r}")
        return int(value)
    m = _RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(
            f"not a byte size: {value!r}; use a number with an optional unit, e.g. 512MiB, 1.5GiB, 2GB")
    factor = _UNITS[unit]
    if gb_is_gib and unit in ("k", "kb", "m", "mb", "g", "gb", "t", "tb"):
        factor = _UNITS[unit.rstrip("b") + "ib"] if unit.endswith("b") else _UNITS[unit + "ib"]
    return round(Fraction(m.group(1)) * factor)


def format_bytes(n: int | float | None, *, precision: int = 1) -> str:
    """Format bytes with binary units: ``format_bytes(3 * 2**30) == '3.0 GiB'``."""
    if n is None:
        return "n/a"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.{precision}f} {unit}"
    return f"{sign}{int(n)} B"
