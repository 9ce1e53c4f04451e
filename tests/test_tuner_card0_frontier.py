"""What a user gets on many cards where card 0's whole-batch term is the limit: ``Tuner``
at the defaults (budget level ``reserved``) on the example MLP on 64 simulated 24 GB cards,
max-batch. Card 0 holds no samples and fills with the gathered outputs (93% of its peak)
while the others sit at 41% of theirs; its reserved figure rises in 2 MiB segments every
few hundred samples of the batch. The search ended uncertified at the probe cap (walking
a flat step down a few samples a probe); card 0's window on the allocator model now gives
the last batch it fits, probed and looked past. Checked here by direct simulated steps:
the answer within every budget, the batch one larger over on card 0."""

from __future__ import annotations

import warnings

import pytest

from dptune.backends.simulated import SimulatedBackend, parse_cluster
from dptune.budget import at_level
from dptune.examples.models import MLP
from dptune.settings import Budget
from dptune.split import even_split
from dptune.step.workload import Workload
from dptune.tuner import Tuner


@pytest.mark.slow          # 64-card simulated steps of a small MLP: about a minute
def test_64_cards_card_0_limited_certified_and_one_more_over() -> None:
    budget = Budget.at("reserved")
    model = MLP()
    backend = SimulatedBackend(Workload(model, model.sample, None, None),
                               parse_cluster("64x24GB"), reserved=budget.reserved)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = Tuner(model, model.sample, batch_size=256, objective="max_batch", budget=budget,
                  verbose=False, backend=backend).fit()
    assert r.certified and r.num_probes <= 12, r.notes
    split = list(r.chunk_sizes)
    assert split[0] == 0 and max(split[1:]) - min(split[1:]) <= 1      # identical cards alike
    limits = [d.budget_bytes(budget.headroom_bytes) for d in backend.devices]
    assert all(p <= b for p, b in zip(r.peak_bytes, limits))
    # one more sample: card 0 over with none of it (the least card 0 can hold of the batch)
    more = [0] + even_split(sum(split) + 1, 63)
    over = at_level(backend.probe(more), backend.devices, budget.level)
    assert over.peak_bytes[0] > limits[0]
