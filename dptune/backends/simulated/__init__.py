"""The simulated cluster: per-card memory of a DataParallel (or DDP) training step, without GPUs.

The user's real model runs under ``FakeTensorMode`` on the CPU and every new storage is charged
to the virtual card that makes it; what is modelled and what is not is said in
:mod:`dptune.backends.simulated.ledger`. The modules, bottom to top:

- :mod:`~dptune.backends.simulated.device_rules`, :mod:`~dptune.backends.simulated.autocast`,
  :mod:`~dptune.backends.simulated.sdpa`: CUDA's device rules, autocast rules and attention
  kernel choice, as the simulated step applies them;
- :mod:`~dptune.backends.simulated.errors`: the user's exceptions mapped to dptune's;
- :mod:`~dptune.backends.simulated.sharing`: one replica simulated per class of like cards;
- :mod:`~dptune.backends.simulated.ledger`: the ledger (which card holds each storage, live
  bytes and peaks per card and category);
- :mod:`~dptune.backends.simulated.dispatch`: the dispatch mode that charges every op's new
  storages to a card under CUDA's rules;
- :mod:`~dptune.backends.simulated.dataparallel`: DataParallel's scatter, broadcast and gather
  between the virtual cards, and the wrapper a step gets as its model;
- :mod:`~dptune.backends.simulated.fake_model`: the fake copy of the user's model;
- :mod:`~dptune.backends.simulated.backend`: :class:`SimulatedBackend` and
  :func:`estimate_memory`;
- :mod:`~dptune.backends.simulated.ddp`: one DDP rank per card (``SimulatedDDPRank``);
- :mod:`~dptune.backends.simulated.fsdp`: one FSDP2 rank per card (``SimulatedFSDPRank``).

The cluster spec and the card table are in :mod:`dptune.hardware.cluster` (no torch); they
are re-exported here. Every name is imported on first use: the allocator replay and the
reserved-level model below need no torch.
"""

from __future__ import annotations

from dptune._lazy import lazy_names

__all__ = ["Cluster", "CARD_TYPES", "CARD_CAPABILITY", "DEFAULT_CAPABILITY", "DEFAULT_CLUSTER",
           "DEFAULT_CONTEXT_BYTES", "parse_cluster", "SimulatedBackend", "MemoryEstimate",
           "estimate_memory"]

_HOME = {**{n: "dptune.hardware.cluster" for n in __all__[:7]},
         "SimulatedBackend": "dptune.backends.simulated.backend",
         "MemoryEstimate": "dptune.backends.simulated.backend",
         "estimate_memory": "dptune.backends.simulated.backend",
         "_Ledger": "dptune.backends.simulated.ledger"}     # tests reach the ledger here


__getattr__, __dir__ = lazy_names(__name__, _HOME, globals(), __all__)
