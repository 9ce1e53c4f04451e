"""The search's messages to the user (prose lives here, not in the solver)."""

from __future__ import annotations

import math
from typing import Optional

from dptune.errors import NoFeasibleSplitError
from dptune.units import format_bytes

__all__ = ["infeasible_error"]


def infeasible_error(card: Optional[int], shortfall_bytes: Optional[float], batch_size: int,
                     detail: str = "") -> NoFeasibleSplitError:
    """The error for "no split fits", saying where, by how much, and what to try."""
    short = None if shortfall_bytes is None else max(0, int(math.ceil(shortfall_bytes)))
    where = ""
    if card is not None and short is not None:
        where = f": at best, card {card} is {format_bytes(short)} over its budget"
    elif card is not None:
        where = f": card {card} runs out of memory"
    msg = (f"no split of batch size {batch_size} fits every card's budget{where}"
           f"{'; ' + detail if detail else ''}. Try a smaller batch_size, a smaller headroom, "
           "more or larger cards, or gradient accumulation (several smaller batches per step).")
    return NoFeasibleSplitError(msg, shortfall_bytes=short)
