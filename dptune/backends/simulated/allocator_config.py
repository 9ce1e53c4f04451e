"""The caching allocator's options, parsed from ``PYTORCH_CUDA_ALLOC_CONF`` syntax.

Follows ``c10/core/AllocatorConfig.cpp`` (``parseArgs`` and its ``parse*`` helpers, torch 2.x
with ``large_segment_size_mb``, as in the torch 2.13 this project runs): ``key:value`` items
separated by commas, ``roundup_power2_divisions`` as one number or a per-interval list
``[64:8,256:4,>:1]`` (interval keys in MB, powers of 2; the first value also fills the
intervals below it, ``>`` the intervals above the last one given; 16 intervals from 1 MB to
64 GB). Options that do not change device memory (``release_lock_on_cudamalloc``, the
``pinned_*`` ones, ``backend:native``) are accepted and ignored; an unknown key is an error,
as in torch; ``backend:cudaMallocAsync`` (another allocator) is refused: not modelled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

from dptune.errors import SpecError

__all__ = ["AllocatorConfig", "kLargeBuffer"]

_MiB = 1048576
kLargeBuffer = 20971520           # "large" allocations may be packed in 20 MiB blocks
_INTERVALS = 16                   # kRoundUpPowerOfTwoIntervals: 1 MB .. 64 GB
_NO_LIMIT = 2 ** 64 - 1           # max_split_size's default (SIZE_MAX)
_IGNORED = {"release_lock_on_cudamalloc", "pinned_use_cuda_host_register",
            "pinned_num_register_threads", "pinned_use_background_threads",
            "pinned_max_cached_size_mb", "pinned_max_round_threshold_mb",
            "graph_capture_record_stream_reuse"}
_HELP = ("e.g. 'expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:4'")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator options that change device memory (bytes where sizes)."""

    max_split_size: Optional[int] = None          # None: no limit (the default)
    #: per interval of 1 MB .. 64 GB (16 entries); 0 or 1: plain 512-byte rounding
    roundup_power2_divisions: tuple[int, ...] = (0,) * _INTERVALS
    garbage_collection_threshold: float = 0.0     # 0: off
    expandable_segments: bool = False
    max_non_split_rounding: int = kLargeBuffer
    large_segment_size: int = kLargeBuffer
    memory_fraction: Optional[float] = None       # set_per_process_memory_fraction (not a key)

    @property
    def max_split(self) -> int:
        return _NO_LIMIT if self.max_split_size is None else self.max_split_size

    def divisions(self, size: int) -> int:
        """``roundup_power2_divisions(size)``: the divisions of ``size``'s interval."""
        index = max(0, min(size.bit_length() - 1 - 20, _INTERVALS - 1))
        return self.roundup_power2_divisions[index]

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """Parse ``PYTORCH_CUDA_ALLOC_CONF`` syntax; a bad item raises :class:`SpecError`."""
        kw: dict = {}
        for key, value in _items(text):
            try:
                _apply(kw, key, value)
            except ValueError as e:
                raise SpecError(f"allocator option {key}:{value}: {e} ({_HELP})") from None
        cfg = cls(**kw)
        if cfg.max_split_size is not None and cfg.max_split_size < cfg.large_segment_size:
            raise SpecError("allocator option max_split_size_mb must be >= large_segment_size_mb "
                            f"({cfg.large_segment_size // _MiB}) ({_HELP})")
        return cfg

    @classmethod
    def from_env(cls) -> "AllocatorConfig":
        """From ``PYTORCH_ALLOC_CONF`` or, as torch also reads it, ``PYTORCH_CUDA_ALLOC_CONF``;
        options the model cannot follow raise :class:`SpecError` naming the variable and the
        two ways on (the options to model given explicitly, or the allocated level)."""
        name = "PYTORCH_ALLOC_CONF" if os.environ.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
        try:
            return cls.parse(os.environ.get(name) or "")
        except SpecError as e:
            raise SpecError(f"{name}: {e}; the reserved budget level (the default) models the "
                            "allocator from it: give the options to model with allocator= "
                            "(--allocator), or check the allocated peak with "
                            "budget_level='allocated' (--budget-level allocated)") from None

    def to_conf(self) -> str:
        """Back to ``PYTORCH_CUDA_ALLOC_CONF`` syntax (defaults left out)."""
        items = []
        if self.max_split_size is not None:
            items.append(f"max_split_size_mb:{self.max_split_size // _MiB}")
        if self.max_non_split_rounding != kLargeBuffer:
            items.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // _MiB}")
        if self.large_segment_size != kLargeBuffer:
            items.append(f"large_segment_size_mb:{self.large_segment_size // _MiB}")
        d = self.roundup_power2_divisions
        if len(set(d)) == 1 and d[0]:
            items.append(f"roundup_power2_divisions:{d[0]}")
        elif any(d):
            items.append("roundup_power2_divisions:[" + ",".join(
                f"{1 << i}:{v}" for i, v in enumerate(d)) + "]")
        if self.garbage_collection_threshold:
            items.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.expandable_segments:
            items.append("expandable_segments:True")
        return ",".join(items)


def _items(text: str) -> list[tuple[str, str]]:
    """``key:value`` pairs; a value may be a bracketed list with commas inside."""
    out = []
    for m in re.finditer(r"([^,:\[\]]+)(?::(\[[^\]]*\]|[^,]*))?\s*(?:,|$)", text.replace(" ", "")):
        key, value = m.group(1), m.group(2)
        if not key:
            continue
        if not value:
            raise SpecError(f"allocator option {key!r}: expected key:value ({_HELP})")
        out.append((key, value))
    return out


def _mb(value: str, least: int) -> int:
    mb = int(value)
    if mb < least:
        raise ValueError(f"too small, must be >= {least}")
    return mb * _MiB


def _apply(kw: dict, key: str, value: str) -> None:
    if key == "max_split_size_mb":
        kw["max_split_size"] = _mb(value, kLargeBuffer // _MiB)
    elif key == "max_non_split_rounding_mb":
        kw["max_non_split_rounding"] = _mb(value, kLargeBuffer // _MiB)
    elif key == "large_segment_size_mb":
        kw["large_segment_size"] = _mb(value, 2)
    elif key == "garbage_collection_threshold":
        t = float(value)
        if not 0.0 < t < 1.0:
            raise ValueError("must be in (0, 1)")
        kw["garbage_collection_threshold"] = t
    elif key == "roundup_power2_divisions":
        kw["roundup_power2_divisions"] = _divisions(value)
    elif key == "expandable_segments":
        if value not in ("True", "False"):
            raise ValueError("must be True or False")
        kw["expandable_segments"] = value == "True"
    elif key == "backend":
        if value != "native":
            raise ValueError("only the native caching allocator is modelled")
    elif key not in _IGNORED:
        raise ValueError("not an option of the allocator dptune models (torch 2.13's); give "
                         "the options to model explicitly (Tuner(allocator=...))")


def _pow2(n: int, zero: bool) -> bool:
    return (zero and n == 0) or (n > 0 and n & (n - 1) == 0)


def _divisions(value: str) -> tuple[int, ...]:
    """``parseRoundUpPower2Divisions``: one number for every interval, or the list form."""
    if not value.startswith("["):
        n = int(value)
        if not _pow2(n, zero=False):
            raise ValueError("the divisions must be a power of 2")
        return (n,) * _INTERVALS
    out = [0] * _INTERVALS
    first, last = True, 0
    for item in filter(None, value[1:-1].split(",")):
        size, _, div = item.partition(":")
        n = int(div)
        if not _pow2(n, zero=True):
            raise ValueError("the divisions must be a power of 2 or 0")
        if size == ">":
            out[last + 1:] = [n] * (_INTERVALS - last - 1)
            continue
        mb = int(size)
        if not _pow2(mb, zero=False):
            raise ValueError("the intervals (MB) must be powers of 2")
        index = min(mb.bit_length() - 1, _INTERVALS - 1)
        if first:
            out[:index] = [n] * index
            first = False
        out[index] = n
        last = index
    return tuple(out)
