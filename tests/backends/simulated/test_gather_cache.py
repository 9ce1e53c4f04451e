"""A HF DynamicCache gathered onto card 0 costs what torch's own gather makes it cost (issue 25).

torch's ``scatter_gather.gather`` rebuilds a cache as ``type(out)(map(gather_map, ...))``: the
map is lazy, and ``DynamicCache``'s constructor copies each layer's gathered keys and values
(``torch.cat`` onto an empty tensor), so one layer's gathered parts are freed before the next
layer is gathered. The oracle runs torch's own ``gather`` (its traversal, its containers), with
only the per-tensor ``Gather`` standing on the simulator's copy onto the output card.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.parallel.scatter_gather as sg

import dptune.backends.simulated.dataparallel as dp_module
from dptune.backends.simulated import SimulatedBackend, estimate_memory
from dptune.examples.hf import gpt2_batch, tiny_gpt2

VOCAB, SEQ = 100, 256


@contextlib.contextmanager
def torchs_own_gather():
    """The simulator's gather of the outputs replaced by torch.nn.parallel.gather, whose
    per-tensor Gather is the simulator's copy onto the output card."""
    state: dict = {}

    class PerTensor:
        @staticmethod
        def apply(target, dim, *tensors):
            return dp_module._Gather.apply(state["ledger"], state["cards"], dim, target,
                                               None, *tensors)   # no owners: every card ran

    def gather(ledger, cards, outputs, dim=0, out=0, run=None):
        # every replica runs (the reference is the full simulation): one output per card
        assert run is None or tuple(run) == tuple(cards)
        state.update(ledger=ledger, cards=cards)
        return sg.gather(outputs, out, dim)

    saved = dp_module._gather, sg.Gather, SimulatedBackend._share_replicas
    dp_module._gather, sg.Gather = gather, PerTensor
    SimulatedBackend._share_replicas = False
    try:
        yield
    finally:
        dp_module._gather, sg.Gather, SimulatedBackend._share_replicas = saved


def peaks(split, use_cache=True):
    model = tiny_gpt2(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                      use_cache=use_cache)
    return estimate_memory(model, lambda n: gpt2_batch(n, SEQ, VOCAB), split, "4x24GB",
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("split", [[4, 4, 4, 4], [1, 5, 5, 5]])
def test_gathered_dynamic_cache_matches_torchs_gather(split):
    ours = peaks(split)
    with torchs_own_gather():
        reference = peaks(split)
    for card, (a, b) in enumerate(zip(ours, reference)):
        assert a == pytest.approx(b, rel=0.005), (card, ours, reference)
    # the gathered cache is part of card 0's peak (so the case tests the cache): the cache is
    # 4 layers x 2 x (16 x 4 heads x 256 x 16) fp32 = 8 MiB; the old eager rebuild held all
    # of its gathered parts at once, 6 MiB over the reference on card 0
    assert ours[0] - peaks(split, use_cache=False)[0] >= 2 * 2**20
