"""NCCL's fixed cost per strategy, and small cards at the default (reserved) budget level: a
plan, or a one-line reason naming the fixed cost and its flags."""

from __future__ import annotations

import pytest

from dptune import Tuner
from dptune.budget import (NCCL_CLIQUE_BYTES, NCCL_COMMUNICATOR_BYTES, Collectives,
                                         FixedCosts)
from dptune.errors import NoFeasibleSplitError
from dptune.examples.models import TinyGPT
from dptune.units import MiB

GPT = dict(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)


def test_nccl_figure_per_strategy():
    f = FixedCosts()
    # DataParallel: torch.cuda.comm's one clique (nccl #964: 544 MB on 2 devices, 688 MB on 3+)
    assert f.nccl_for(2) == NCCL_CLIQUE_BYTES[2] == 544 * 10**6
    assert f.nccl_for(8) == NCCL_CLIQUE_BYTES[3] == 688 * 10**6
    # DDP and FSDP2: the process group's communicator (nccl #864: about 1.6 GB)
    assert f.nccl_for(4, Collectives.DDP) == f.nccl_for(4, Collectives.FSDP) == NCCL_COMMUNICATOR_BYTES
    assert all(f.nccl_for(1, c) == 0 for c in Collectives)        # one card: no communicator
    assert all(FixedCosts(5 * MiB).nccl_for(n, c) == 5 * MiB for n in (1, 4) for c in Collectives)


def _tune(spec: str, **kw: object):
    model = TinyGPT(**GPT)
    return Tuner(model, model.sample, batch_size=24, objective="max_batch", simulate=spec,
                 verbose=False, **kw).fit()


@pytest.mark.slow
def test_3x2gb_dataparallel_plans_at_the_default_level():
    """It fits at the allocated level; at the default level (reserved + NCCL) it must too: 1.6 GB
    of NCCL used to be charged on each 2 GB card, where DataParallel sets up no process group."""
    alloc = _tune("3x2GB", budget_level="allocated")
    assert alloc.certified and alloc.batch_size > 0
    r = _tune("3x2GB")
    assert r.certified and r.batch_size > 0
    assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["max_batch", "balance"])
def test_fixed_costs_filling_a_card_say_so_and_name_the_flags(objective):
    """1 GB cards: 384 MiB of CUDA context and 256 MiB of headroom leave less than NCCL's
    buffers: the error blames the fixed cost, not the model, and names both flags."""
    model = TinyGPT(**GPT)
    with pytest.raises(NoFeasibleSplitError) as e:
        Tuner(model, model.sample, batch_size=24, objective=objective, simulate="3x1GB",
              verbose=False, max_probes=4).fit()
    msg = str(e.value)
    assert "fixed costs, not the model" in msg and "NCCL" in msg and "\n" not in msg
    assert "--nccl-bytes" in msg and "--budget-level" in msg
    # and the flag it names works: with the user's own (smaller) figure the model fits
    r = Tuner(model, model.sample, batch_size=24, objective="max_batch", simulate="3x1GB",
              verbose=False, nccl_bytes="64MiB").fit()
    assert r.batch_size > 0 and r.certified
