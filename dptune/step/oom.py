"""Is this exception an out-of-memory on a GPU, and on which card?

- :func:`is_oom`: True when ``exc`` is a GPU out-of-memory (see docs/concepts/design-notes.md for the shapes).
- :func:`oom_device`: The torch device index the OOM happened on, when the message says; else ``None``.
- :func:`oom_summary`: A one-line summary of the OOM for notes: the original message's first line.
- :func:`original_message`: The exception's own text; for a DataParallel replica re-raise, the original's text.
- :func:`replica_where`: ``(replica, torch_device)`` from "in replica R on device D", else ``None``.

Design notes: docs/concepts/design-notes.md, "dptune/step/oom.py".
"""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["is_oom", "oom_device", "oom_summary", "original_message", "replica_where"]

# Substrings (case-insensitive) that mark an allocation failure on the GPU.
_OOM_MARKERS = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_internal_error_device_allocation_failed",
    "cudnn_status_not_enough_workspace",
    "hipblas_status_alloc_failed",
    "hip out of memory",
)
# cublasCreate failing with NOT_INITIALIZED is, in practice, a full card.
_CUBLAS_INIT = re.compile(r"CUBLAS_STATUS_NOT_INITIALIZED.*cublasCreate", re.IGNORECASE | re.DOTALL)

_REPLICA = re.compile(r"in replica (\d+) on device (\d+)")
_GPU = re.compile(r"\bGPU (\d+)\b")
_CUDA_DEV = re.compile(r"\bcuda:(\d+)\b")
_ON_DEVICE = re.compile(r"\bon device (\d+)\b")


def _oom_type() -> Optional[type]:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    return getattr(torch, "OutOfMemoryError", None) or getattr(
        getattr(torch, "cuda", None), "OutOfMemoryError", None)


def original_message(exc_or_msg: BaseException | str) -> str:
    """The exception's own text; for a DataParallel replica re-raise, the original's text.

    ``"Caught X in replica 1 on device 1.\\nOriginal Traceback ...\\nX: msg"`` gives ``"msg"``
    (the lines after the last quoted frame, with the ``module.Type:`` prefix dropped).
    """
    msg = exc_or_msg if isinstance(exc_or_msg, str) else str(exc_or_msg)
    if not (msg.startswith("Caught ") and "Original Traceback" in msg):
        return msg
    lines = msg.splitlines()
    # Frames are indented ("  File ...", "    code"); the exception text follows the last.
    last_frame = max((i for i, ln in enumerate(lines) if ln.startswith("  ")), default=0)
    tail = "\n".join(lines[last_frame + 1:]).strip()
    m = re.match(r"^[A-Za-z_][\w.]*(?:Error|Exception|Warning|Exit|Interrupt)?: ", tail)
    if m:
        tail = tail[m.end():]
    return tail or msg


def replica_where(exc_or_msg: BaseException | str) -> Optional[tuple[int, int]]:
    """``(replica, torch_device)`` from "in replica R on device D", else ``None``."""
    msg = exc_or_msg if isinstance(exc_or_msg, str) else str(exc_or_msg)
    m = _REPLICA.search(msg.split("\n", 1)[0])
    return (int(m.group(1)), int(m.group(2))) if m else None


def _matches(text: str) -> bool:
    low = text.lower()
    return any(k in low for k in _OOM_MARKERS) or bool(_CUBLAS_INIT.search(text))


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is a GPU out-of-memory (see docs/concepts/design-notes.md for the shapes).

    Follows explicit chaining (``raise X from oom``) a few levels, so a user's wrapper around
    an OOM still counts.
    """
    oom_type = _oom_type()
    seen = 0
    e: Optional[BaseException] = exc
    while e is not None and seen < 5:
        if oom_type is not None and isinstance(e, oom_type):
            return True
        if isinstance(e, (RuntimeError, MemoryError)) and _matches(original_message(e)):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def oom_device(exc_or_msg: BaseException | str) -> Optional[int]:
    """The torch device index the OOM happened on, when the message says; else ``None``.

    Preference: the allocator's "GPU N" (where the allocation failed), then "cuda:N", then
    the replica thread's "on device N".
    """
    msg = exc_or_msg if isinstance(exc_or_msg, str) else str(exc_or_msg)
    orig = original_message(msg)
    for pattern in (_GPU, _CUDA_DEV):
        m = pattern.search(orig)
        if m:
            return int(m.group(1))
    where = replica_where(msg)
    if where is not None:
        return where[1]
    m = _ON_DEVICE.search(orig)
    return int(m.group(1)) if m else None


def oom_summary(exc_or_msg: BaseException | str, limit: int = 200) -> str:
    """A one-line summary of the OOM for notes: the original message's first line."""
    first = original_message(exc_or_msg).strip().split("\n", 1)[0]
    return first if len(first) <= limit else first[: limit - 3] + "..."
