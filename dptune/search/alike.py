"""Identical cards: the cards ``i >= 1`` that run the same replica against the same budget.

Two cards are alike when the caller says they are the same card (the same spec, the same
memory held by others: one key per card) and their budgets are equal. Card 0 is never alike
another card (it also pays for the whole batch). Alike cards have one memory curve, so

- a point measured on one of them holds for all of them (the observations pool them, see
  :class:`dptune.search.observations.Observations`): one probe at chunks ``c`` and ``c + 1``
  on two alike cards shows each of them at both chunks;
- spreading a group's samples evenly over it never raises its largest peak (each chunk is at
  most the group's largest one and the curve is non-decreasing), so the search gives alike
  cards chunks within one sample of each other (:func:`spread`).

A group said to be alike but measured at one chunk with different peaks is not treated as
alike: the claim is tested on every probe, never trusted blind.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

__all__ = ["Groups", "groups_of", "spread", "device_keys"]

#: Alike cards as tuples of card indices (each of at least two cards ``>= 1``).
Groups = tuple[tuple[int, ...], ...]


def groups_of(keys: Optional[Sequence[Hashable]], budgets: Sequence[int]) -> Groups:
    """The groups of alike cards: cards ``i >= 1`` with the same key and the same budget
    (none without keys)."""
    if keys is None:
        return ()
    if len(keys) != len(budgets):
        raise ValueError(f"need one key per card: {len(keys)} keys for {len(budgets)} cards")
    by: dict[tuple[Hashable, int], list[int]] = {}
    for i in range(1, len(budgets)):
        by.setdefault((keys[i], int(budgets[i])), []).append(i)
    return tuple(tuple(g) for g in by.values() if len(g) > 1)


def device_keys(devices: Sequence[object]) -> list[Hashable]:
    """One key per card from its description: the same card (name, memory) with the same
    memory held by others and by the CUDA context."""
    return [(getattr(d, "name", None), getattr(d, "total_bytes", None),
             getattr(d, "used_bytes", None), getattr(d, "context_bytes", None)) for d in devices]


def spread(split: Sequence[int], groups: Groups, min_chunk: int = 1) -> tuple[int, ...]:
    """``split`` with each group's samples spread evenly over its cards (the lower-numbered
    cards of a group take the odd samples); under BatchNorm (``min_chunk=2``) over as many
    of them as can take ``min_chunk`` each. The total per group, so the batch, is kept."""
    out = list(split)
    m = max(1, min_chunk)
    for g in groups:
        total = sum(out[i] for i in g)
        k = min(len(g), total // m)
        if k == 0:
            continue
        for j, i in enumerate(g):
            out[i] = total // k + (1 if j < total % k else 0) if j < k else 0
    return tuple(out)
