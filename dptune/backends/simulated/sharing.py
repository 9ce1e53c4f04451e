"""One replica simulated for every card that would run the same one.

- :class:`ReplicaPlan`: Which cards a step simulates, and whose results each card takes.
- :func:`plan_replicas`: The plan for a step with ``sizes`` where card ``c`` behaves as ``card_keys[c]`` says (workspace, capability, what it holds) and the cards ...
- :func:`with_card0_mirrored`: ``plan`` with card 0's replica taken from the first class card (not ``pinned``) whose chunk and spec (``spec_keys[c]``: workspace, capability, ...

Design notes: docs/concepts/design-notes.md, "dptune/backends/simulated/sharing.py".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

__all__ = ["ReplicaPlan", "plan_replicas", "with_card0_mirrored"]


@dataclass
class ReplicaPlan:
    """Which cards a step simulates, and whose results each card takes.

    ``rep[c]`` is the simulated card whose figures card ``c`` takes (``c`` itself for a
    simulated card); ``weight[c]`` how many cards the simulated card ``c`` stands for (0 for
    one that is not simulated). ``diverged`` is set by the step where sharing is not exact.

    ``mirror``: the card whose replica also stands for card 0's (card 0 runs no replica of
    its own; the ledger charges what that replica makes to card 0 as well, in the same
    order: :func:`with_card0_mirrored`), or ``None``. ``unmirrored`` is set by the step where
    card 0's replica would not run as that card's (the step is simulated again without it).
    """

    sizes: tuple[int, ...]
    rep: tuple[int, ...]
    weight: tuple[int, ...]
    diverged: list[str] = field(default_factory=list)
    mirror: Optional[int] = None
    unmirrored: list[str] = field(default_factory=list)

    @property
    def simulated(self) -> frozenset[int]:
        return frozenset(c for c, w in enumerate(self.weight) if w)

    @property
    def shares(self) -> bool:
        """Whether any card is left out (else the plan changes nothing)."""
        return any(r != c for c, r in enumerate(self.rep))

    def diverge(self, why: str) -> None:
        if why not in self.diverged:
            self.diverged.append(why)

    def refuse_mirror(self, why: str) -> None:
        if why not in self.unmirrored:
            self.unmirrored.append(why)

    def runs(self, card: int) -> bool:
        """Whether ``card``'s replica is run (one per class, card 0's unless mirrored)."""
        return bool(self.weight[card]) and not (card == 0 and self.mirror is not None)

    def replica_of(self, card: int) -> int:
        """The card whose replica runs for ``card``."""
        return self.mirror if card == 0 and self.mirror is not None else self.rep[card]

    def replicas_for(self, card: int) -> int:
        """How many cards' replicas the replica run on ``card`` stands for."""
        return self.weight[card] + (card == self.mirror)

    def expand(self, per_card: Sequence[Any]) -> list:
        """A per-card list with every card's entry taken from its representative."""
        return [per_card[r] for r in self.rep]


def plan_replicas(sizes: Sequence[int], card_keys: Sequence[Hashable], pinned: Sequence[int]
                  ) -> ReplicaPlan:
    """The plan for a step with ``sizes`` where card ``c`` behaves as ``card_keys[c]`` says
    (workspace, capability, what it holds) and the cards ``pinned`` (card 0, the output card,
    the batch's card) are simulated on their own. The representative of a class is its
    first card."""
    n = len(sizes)
    first: dict[Hashable, int] = {}
    rep = list(range(n))
    keep: set[int] = set(pinned)
    for c in range(n):
        if c in keep or sizes[c] == 0:
            continue
        key = (card_keys[c], sizes[c])
        r = first.setdefault(key, c)
        rep[c] = r
    weight = [0] * n
    for r in rep:
        weight[r] += 1
    return ReplicaPlan(tuple(sizes), tuple(rep), tuple(weight))



def with_card0_mirrored(plan: ReplicaPlan, spec_keys: Sequence[Hashable], pinned: Sequence[int]
                        ) -> ReplicaPlan:
    """``plan`` with card 0's replica taken from the first class card (not ``pinned``) whose
    chunk and spec (``spec_keys[c]``: workspace, capability, speed; not what the card holds)
    are card 0's, if there is one (module docstring)."""
    sizes = plan.sizes
    if not sizes[0]:
        return plan
    for c in range(1, len(sizes)):
        if c not in pinned and plan.weight[c] and sizes[c] == sizes[0] and spec_keys[c] == spec_keys[0]:
            return ReplicaPlan(plan.sizes, plan.rep, plan.weight, mirror=c)
    return plan
