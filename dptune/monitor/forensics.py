"""Out-of-memory forensics: is an exception CUDA's out-of-memory error, and on which card.

The card is the one whose ``num_ooms`` rose during the step (the allocator counts every
out-of-memory it raises), else the one CUDA's message names (``GPU 3 has a total capacity
of ...``); ``None`` when neither tells.
"""

from __future__ import annotations

import re
import sys
from typing import Optional, Sequence

__all__ = ["is_oom", "oom_card"]

_GPU = re.compile(r"\bGPU (\d+)\b")


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is CUDA's out-of-memory error (``torch.OutOfMemoryError``, or on an old
    torch the ``RuntimeError`` whose message says so)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cls = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
        if cls is not None and isinstance(exc, cls):
            return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def oom_card(exc: BaseException, cards: Sequence[int], ooms_before: Sequence[int],
             ooms_after: Sequence[Optional[int]]) -> Optional[int]:
    """The card that ran out (see the module docstring)."""
    for card, before, after in zip(cards, ooms_before, ooms_after):
        if after is not None and after > before:
            return card
    m = _GPU.search(str(exc))
    if m is not None and int(m.group(1)) in cards:
        return int(m.group(1))
    return None
