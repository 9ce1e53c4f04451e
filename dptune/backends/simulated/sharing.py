"""One replica simulated for every card that would run the same one.

In a DataParallel step every busy card other than card 0 goes through the same events: the
scatter's copy of its chunk, the broadcast copies of the weights, its replica's forward and
backward, its share of the output's gradient and its gradients handed to the reduction. What
a card allocates and frees, in its own order, depends only on

- the card's workspace size and compute capability (the cuBLAS workspace; the attention
  kernel CUDA picks: :mod:`dptune.backends.simulated.sdpa`), not on its total memory;
- its chunk of the batch;
- what it held before the step (live bytes by category: equal on all cards but card 0 unless
  a step function keeps tensors across steps).

Cards equal in all three form a class, and the step is simulated with one card per class
(:class:`ReplicaPlan`); each card of the class takes that card's results (peak, breakdown at
the peak, allocator trace). Card 0 (the master weights, the reduction of the gradients, the
optimizer), the output card (the gathered outputs) and the card the batch is on
(``batch_on_card0``) are always simulated on their own, with what they hold for the others
accounted in full: the gather concatenates one output per card (the class's, repeated), the
reduction makes one buffer per weight whatever the number of replicas.

Card 0's own replica goes through the same events as a class card's where the two cards have
the same chunk and spec (workspace, capability, speed): its replica differs only in using the
master weights themselves (no copies) and, when card 0 is the output card, in getting a view
of the output's gradient where the others get a copy. Such a class card's replica then stands
for card 0's too (``ReplicaPlan.mirror``, :func:`with_card0_mirrored`): card 0 runs no replica,
and the ledger charges every storage that card's replica makes to card 0 as well, at the same
moment and with the same size, category, stream and lifetime (``_Ledger.mirror``), except the
copies of the weights, the card's workspace and its copy of the gradient piece (card 0's view
keeps the whole gradient alive as long as that copy lives). Card 0's own events (the master
weights, the gathered outputs, the loss, the reduction, the optimizer) are simulated as
before, so its trace is the trace of the simulation of every replica: card 0 has no events of
its own while another replica runs, so running its replica's events at the time of another
card's changes nothing in card 0's order. The time estimate counts the replica's ops for
card 0 as well (and takes back the gather's read of card 0's output from the other card).
Card 0 runs its own replica again (for the step and from then on) where its gradient piece
is a view laid out unlike a copy (the sum of the output as the loss hands every replica an
expanded, stride-0 gradient: card 0's replica could make other copies than the class card's),
and where a user's error is raised with card 0 mirrored (raised again by card 0's replica,
as every replica's simulation raises it). Not with the batch on card 0 (its chunk is a view
there).

Exact, not approximate: the per-card peak and breakdown equal those of the simulation of
every replica, and the allocator trace equals it event for event (sizes, frees, streams, in
order); only the events' ids, the global allocation numbers, differ (the replay of
:mod:`dptune.backends.simulated.reserved` uses them only to pair a free with its malloc, so its figures
are identical too). ``tests/backends/simulated/test_sharing.py`` checks this against the full simulation on mixed
clusters.

Where the events of one card depend on the number of replicas, the step is simulated again
with every replica (the simulated step says so with ``diverged``, and the backend keeps to the
full simulation for that model from then on):

- the reduction run more than once in a step (a reentrant activation checkpoint runs the
  backward of each segment on its own, and autograd fills every other replica's missing
  gradients with zeros on its card);
- a batch that is not the probe's (a step function that calls the model on another batch
  size: its split is scaled, and the classes may differ);
- batch tensors that require grad scattered from card 0 (their gradients are copied back to
  card 0, one per replica).

What is not covered: a step function that keeps tensors alive on cards other than card 0
after the step ends leaves them on the simulated card only, so the next probe's classes see
different baselines (exact for that probe, where the cards are then simulated apart; the other
cards of the class no longer carry what they would have kept).
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
