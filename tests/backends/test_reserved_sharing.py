"""The allocator replay runs once per distinct (card capacity, trace), not once per card."""

from __future__ import annotations

import torch
import torch.nn as nn

import dptune.backends.simulated.reserved as reserved_mod
from dptune.backends.simulated.allocator import AllocatorConfig, Event, replay
from dptune.budget import NCCL_CLIQUE_BYTES, FixedCosts
from dptune.backends.simulated.reserved import ReservedModel
from dptune.backends.simulated import SimulatedBackend
from dptune.types import Device
from dptune.units import GiB, MiB
from dptune.step.workload import Workload


def _trace(base: int, sizes: list[int]) -> list[Event]:
    """Mallocs of ``sizes`` under ids base, base+1, ..., then frees of every other one."""
    out = [Event(base + k, n) for k, n in enumerate(sizes)]
    out += [Event(base + k, -n) for k, n in enumerate(sizes) if k % 2 == 0]
    return out


def _counting(monkeypatch) -> list[int]:
    calls: list[int] = []

    def counted(*args, **kwargs):
        calls.append(1)
        return replay(*args, **kwargs)

    monkeypatch.setattr(reserved_mod, "replay", counted)
    return calls


NO_NCCL = ReservedModel(fixed=FixedCosts(nccl_bytes=0))


def test_cards_alike_up_to_the_ids_share_one_replay(monkeypatch):
    sizes = [3 * MiB, 700_000, 12 * MiB, 5000, 30 * MiB]
    other = [1 * MiB, 1 * MiB, 25 * MiB]
    dev = [Device(i, "card", 24 * GiB) for i in range(4)]
    # cards 0, 1 and 3: the same work under ids of their own; card 2: other work
    setup = [[Event(100 * c, 4 * MiB)] for c in range(4)]
    step = [_trace(100 * c + 1, other if c == 2 else sizes) for c in range(4)]
    calls = _counting(monkeypatch)
    fig = NO_NCCL.predict(setup, step, dev)
    assert len(calls) == 2 == fig.replays
    # each card's figures are those of its own replay, run alone
    for c in range(4):
        alone = replay([setup[c], step[c], step[c]], 24 * GiB, AllocatorConfig(), measure_from=2)
        assert fig.stats[c] == alone


def test_like_traces_on_cards_of_other_capacity_replay_apart(monkeypatch):
    sizes = [30 * MiB, 30 * MiB, 30 * MiB]
    small = 64 * MiB      # room for two 30 MiB segments, not the six of warm-up + measured step
    dev = [Device(0, "big", 1 * GiB), Device(1, "small", small)]
    setup: list[list[Event]] = [[], []]
    step = [[Event(k, n) for k, n in enumerate(sizes)] for _ in range(2)]
    calls = _counting(monkeypatch)
    fig = NO_NCCL.predict(setup, step, dev)
    assert fig.replays == 2
    assert len(calls) == 3              # the small card ran out: its "what it would need" replay
    assert fig.stats[0].num_ooms == 0 and fig.stats[1].num_ooms == 1
    assert fig.oom_card == 1


def test_simulated_replicas_share_replays_and_keep_their_figures(monkeypatch):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    wl = Workload(m, lambda b: torch.randn(b, 256), optimizer=lambda p: torch.optim.Adam(p))
    b = SimulatedBackend(wl, "4x24GB", reserved=ReservedModel())
    r = b.probe([3, 3, 3, 3])
    assert b._recorder is not None
    # replayed one card at a time, without the sharing: the same figures
    per_card = [replay([b._recorder.events[c], b._step_trace[c], b._step_trace[c]],
                       b.devices[c].available_bytes - NCCL_CLIQUE_BYTES[3], AllocatorConfig(),
                       measure_from=2)
                for c in range(4)]
    assert r.reserved_bytes == tuple(s.reserved_peak for s in per_card)
    calls = _counting(monkeypatch)
    fig = ReservedModel().predict(b._recorder.events, b._step_trace, b.devices)
    # card 0 holds the model and gathers the outputs; cards 1-3 are replicas given alike chunks
    assert fig.replays == len(calls) < 4
    assert fig.stats[1] == fig.stats[2] == fig.stats[3]
    b.close()
