"""Advice about the training step, from what a probe saw (pure text, no torch)."""

from __future__ import annotations

from typing import Optional, Sequence

from dptune.units import format_bytes

__all__ = ["UNREAD_OUTPUTS_SHARE", "CACHE_MARK", "unread_outputs_advice"]

#: Share of card 0's peak taken by gathered outputs the loss never reads, above which the
#: report says which they are.
UNREAD_OUTPUTS_SHARE = 0.05

#: Appended to an output entry whose value is a ``transformers`` ``Cache`` (whatever the field is
#: called: ``past_key_values`` before transformers 5.24, ``cache`` since), so that the advice is
#: keyed on what the value is, not on its name.
CACHE_MARK = " (the model's key/value cache)"

_HINTS = (
    (CACHE_MARK, "pass use_cache=False (or set model.config.use_cache = False): a training "
                        "step does not need the cache"),
    ("hidden_states", "leave output_hidden_states off in training"),
    ("attentions", "leave output_attentions off in training"),
    ("logits", "let forward return only the loss when the model computes it (e.g. a wrapper "
               "module whose forward returns model(**batch).loss)"),
)


def unread_outputs_advice(unread: Optional[Sequence[tuple[str, int]]], card0_peak_bytes: int,
                          share: float = UNREAD_OUTPUTS_SHARE) -> Optional[str]:
    """One line naming the gathered output entries the loss never read, when together they
    are more than ``share`` of card 0's peak; ``None`` otherwise."""
    if not unread or card0_peak_bytes <= 0:
        return None
    total = sum(b for _, b in unread)
    if total / card0_peak_bytes <= share:
        return None
    biggest = sorted(unread, key=lambda eb: -eb[1])
    names = ", ".join(f"{e} ({format_bytes(b)})" for e, b in biggest[:4])
    more = f" and {len(biggest) - 4} more" if len(biggest) > 4 else ""
    hints = [h for key, h in _HINTS if any(key in e for e, _ in unread)]
    what = "; ".join(hints) if hints else (
        "return only what the loss needs from forward (or compute the loss inside forward, return "
        "only it, and reduce the per-replica losses with `model.reduce(losses)`)")
    return (f"DataParallel gathers every tensor of the output onto card 0, and the loss never "
            f"reads {names}{more}: {format_bytes(total)}, {total / card0_peak_bytes:.0%} of card 0's "
            f"peak. To free it, {what}")
