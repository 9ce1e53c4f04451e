"""Which CUDA cards a run uses: :func:`check_devices`, the one check of ``device_ids`` against
what torch sees (for the tuner's choice of backend and for a backend built directly)."""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from dptune.backends.cuda.runtime import CudaRuntime
from dptune.errors import BackendUnavailableError, UsageError



def _ids_text(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in ids)


def check_devices(device_ids: Optional[Sequence[int]], runtime: Any = None) -> list[int]:
    """The CUDA cards to use: ``device_ids`` checked against what torch sees, or every
    visible card. Raises :class:`UsageError` for a malformed list and
    :class:`BackendUnavailableError` (saying why: no CUDA build, ``CUDA_VISIBLE_DEVICES``,
    how torch numbers the cards) when they are not all visible. The one check, for the tuner's
    choice of backend and for a backend built directly."""
    rt = runtime if runtime is not None else CudaRuntime()
    if device_ids is not None:
        ids = list(device_ids)
        if not ids:
            raise UsageError("device_ids is empty; give at least one CUDA device index, e.g. [0, 1]")
        for d in ids:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise UsageError(f"device_ids must be non-negative ints (torch device indices), got {ids!r}")
        if len(set(ids)) != len(ids):
            raise UsageError(f"device_ids {ids} names a card twice")
    else:
        ids = None
    asked = f"GPUs {_ids_text(ids)} were" if ids else "real GPUs (all visible ones) were"
    hint = ("; to tune without GPUs, simulate a cluster: Tuner(..., simulate='4x24GB') or "
            "`dptune search ... --simulate 4x24GB`")
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    cvd_text = f"CUDA_VISIBLE_DEVICES={cvd}" if cvd is not None else "CUDA_VISIBLE_DEVICES is not set"
    if not rt.is_available():
        why = "torch.cuda.is_available() is False"
        if isinstance(rt, CudaRuntime):
            import torch

            if getattr(torch.version, "cuda", None) is None:
                why += f"; this torch build has no CUDA support: torch {torch.__version__}"
        why += f"; {cvd_text}"
        raise BackendUnavailableError(f"{asked} asked for but torch sees none ({why}){hint}")
    count = rt.device_count()
    if ids is None:
        if count < 1:
            raise BackendUnavailableError(f"{asked} asked for but torch sees none ({cvd_text}){hint}")
        return list(range(count))
    missing = [d for d in ids if d >= count]
    if missing:
        raise BackendUnavailableError(
            f"GPU{'s' if len(missing) > 1 else ''} {_ids_text(missing)} "
            f"{'were' if len(missing) > 1 else 'was'} asked for but only {count} "
            f"{'is' if count == 1 else 'are'} visible ({cvd_text}); torch numbers the visible "
            f"cards 0..{count - 1}{hint}")
    return ids
