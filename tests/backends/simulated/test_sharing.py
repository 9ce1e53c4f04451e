"""One replica simulated per class of like cards (dptune.backends.simulated.sharing) gives,
card by card, what the simulation of every replica gives: peaks, breakdowns, notes, the
allocator model's figures and its traces (up to the events' global ids)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptune.backends.reserved import ReservedModel
from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.sharing import plan_replicas
from dptune.examples.models import TinyGPT
from dptune.workload import Workload


CALLS = [0]                      # forwards run (the fake copy of a model is a deep copy)


class Counted(nn.Module):
    """A conv net with BatchNorm and dropout, optionally checkpointed, that counts its
    forwards (each replica runs one)."""

    def __init__(self, ckpt: str = "none"):
        super().__init__()
        self.ckpt = ckpt
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.body = nn.Sequential(nn.Linear(16 * 8 * 8, 256), nn.GELU(), nn.Dropout(0.1),
                                  nn.Linear(256, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[0] += 1
        h = torch.relu(self.bn(self.conv(x))).flatten(1)
        if self.ckpt == "none":
            return self.body(h)
        return checkpoint(self.body, h, use_reentrant=self.ckpt == "reentrant")


def _gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(vocab_size=512, d_model=64, n_layers=2, n_heads=2, seq_len=32)


def _adamw(ps: Any) -> Any:
    return torch.optim.AdamW(ps, foreach=True)


def _normalized(trace: list) -> list:
    """Per card: (id's first-appearance number, bytes, stream) for each event."""
    out = []
    for card in trace:
        ids: dict[int, int] = {}
        out.append([(ids.setdefault(e.id, len(ids)), e.delta, e.stream) for e in card])
    return out


STILL_SHARING = [True]           # whether the last shared run kept sharing to the end


def _both(wl: Workload, cluster: str, splits: list, **kw: Any) -> tuple[list, list, list]:
    """The probes of ``splits`` in turn, shared and in full, with each step's trace."""
    got: dict[bool, tuple[list, list]] = {}
    for share in (True, False):
        b = SimulatedBackend(wl, cluster, reserved=ReservedModel(), **kw)
        b._share_replicas = share
        probes, traces = [], []
        for split, out in splits:
            probes.append(b.probe(split, output_device=out))
            traces.append(_normalized(b._step_trace))
        got[share] = (probes, traces)
        if share:
            STILL_SHARING[0] = b._share_replicas
        b.close()
    return got[True][0], got[False][0], [got[True][1], got[False][1]]


def _assert_same(shared: list, full: list, traces: list) -> None:
    for a, b in zip(shared, full):
        assert a.peak_bytes == b.peak_bytes
        assert a.breakdown == b.breakdown
        assert a.oom_device == b.oom_device
        assert a.unread_outputs == b.unread_outputs
        assert a.note == b.note                       # attention kernels counted per card
        assert a.reserved_bytes == b.reserved_bytes
        assert a.total_bytes == b.total_bytes
        assert a.alloc_retries == b.alloc_retries
        assert a.memory_stats == b.memory_stats
    assert traces[0] == traces[1]


CASES = [
    ("4x24GB", [([4, 4, 4, 4], 0), ([3, 5, 5, 5], 0), ([4, 4, 4, 4], 2)]),
    ("2x24GB,2x40GB", [([2, 4, 4, 0], 0), ([6, 2, 2, 2], 0), ([0, 3, 3, 3], 0)]),
    ("1x80GB,3x24GB", [([2, 4, 4, 6], 0), ([5, 0, 5, 5], 0), ([0, 4, 4, 4], 1)]),
    ("2xH100,3x24GB", [([2, 2, 2, 2, 2], 0), ([4, 4, 3, 3, 3], 3)]),
]


@pytest.mark.slow
@pytest.mark.parametrize("cluster,splits", CASES)
def test_a_gpt_on_mixed_clusters_is_exact_card_by_card(cluster, splits):
    m = _gpt()
    wl = Workload(m, m.sample, optimizer=_adamw, amp="bf16")
    _assert_same(*_both(wl, cluster, splits))


def test_like_cards_run_one_replica_and_match_every_replica():
    m = Counted()
    wl = Workload(m, lambda n: torch.randn(n, 3, 8, 8), optimizer=_adamw)
    splits = [([4, 4, 4, 4, 4, 4], 0), ([2, 3, 3, 0, 3, 3], 0)]
    shared, full, traces = _both(wl, "6x24GB", splits)
    _assert_same(shared, full, traces)
    # shared: 2 replicas (card 0 and one for cards 1-5), then 2 (card 0 and one for the
    # cards of 3 samples), where the full simulation runs 6, then 5
    b = SimulatedBackend(Workload(Counted(), lambda n: torch.randn(n, 3, 8, 8)), "6x24GB")
    runs = CALLS[0]
    b.probe([4] * 6)
    assert CALLS[0] - runs == 2
    b.probe([2, 3, 3, 0, 3, 3])
    assert CALLS[0] - runs == 2 + 2


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_checkpointing_is_exact_and_reentrant_falls_back(ckpt):
    m = Counted(ckpt)
    wl = Workload(m, lambda n: torch.randn(n, 3, 8, 8), optimizer=_adamw)
    _assert_same(*_both(wl, "4x24GB", [([4, 4, 4, 4], 0), ([2, 4, 4, 4], 3)]))
    # a reentrant checkpoint reduces the gradients once per segment and replica: every
    # replica is simulated (and the backend keeps to that)
    assert STILL_SHARING[0] == (ckpt != "reentrant")


def test_batch_on_card0_and_a_step_on_another_batch_size():
    m = Counted()

    def step(model: Any, batch: Any, optimizer: Any) -> None:     # calls the model twice:
        model(batch).sum().backward()                               # the probe's batch and
        model(batch[: batch.shape[0] // 2]).sum().backward()        # half of it (scaled split)

    # the second runs every replica: the half batch's split is not the probe's
    for kw, wl, shares in [
            ({"batch_on_card0": True}, Workload(m, lambda n: torch.randn(n, 3, 8, 8)), True),
            ({}, Workload(m, lambda n: torch.randn(n, 3, 8, 8), step=step), False)]:
        _assert_same(*_both(wl, "4x24GB", [([4, 4, 4, 4], 0), ([2, 6, 6, 6], 0)], **kw))
        assert STILL_SHARING[0] == shares


def test_the_plan_pins_card_0_and_the_output_card_and_groups_the_rest():
    keys = ["a", "a", "a", "b", "a", "a"]
    p = plan_replicas([4, 4, 4, 4, 0, 4], keys, (0, 2))
    assert p.rep == (0, 1, 2, 3, 4, 1)            # 0 and 2 pinned, 3 another card, 4 idle
    assert p.weight == (1, 2, 1, 1, 1, 0)
    assert sum(p.weight) == 6 and p.simulated == frozenset({0, 1, 2, 3, 4})
    assert not plan_replicas([4, 4, 5], ["a"] * 3, (0,)).shares


def test_scalar_outputs_micro_batches_and_clipping():
    # forward(idx, targets) returns each replica's loss: 0-dim outputs, stacked by the gather
    m = _gpt()
    wl = Workload(m, m.sample_with_targets, loss_fn=lambda out, batch: out.mean(),
                  optimizer=_adamw, accumulate=2, clip_grad_norm=1.0, amp="fp16")
    _assert_same(*_both(wl, "5x24GB", [([3, 3, 3, 3, 3], 0), ([2, 4, 4, 0, 4], 1)]))
    assert STILL_SHARING[0]


@pytest.mark.parametrize("spec, split", [("4x24GB", [2, 5, 5, 5]), ("2x24GB,2x40GB", [3, 4, 4, 6]),
                                         ("RTX4090,3xRTX3090", [4, 3, 3, 0])])
def test_the_time_estimate_is_the_same_with_one_replica_per_class(spec, split):
    """The estimated step time (per card and in all) does not depend on whether like cards were
    simulated once: the full simulation is the reference. The host's part may miss the views
    the scatter and the gather make for a card not simulated (one each, 45 us of a 35 ms
    step): the whole step within 0.5%."""
    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.timing import TimedBackend
    from dptune.examples.models import TinyGPT
    from dptune.workload import Workload

    model = TinyGPT()
    times, steps = [], []
    for share in (True, False):
        backend = SimulatedBackend(Workload(model, model.sample,
                                            optimizer=lambda p: torch.optim.AdamW(p)), spec)
        backend._share_replicas = share
        r = TimedBackend(backend).probe(split)
        times.append((r.peak_bytes, r.time.card_seconds, r.time.device_seconds, r.time.flops,
                      r.time.card_host_seconds[1:]))      # card 0 makes the views
        steps.append(r.time.step_seconds)
        if share and split.count(split[1]) > 1:
            assert len(set(backend.last_replicas)) < len(split)      # a class was shared
    assert times[0] == times[1]
    assert steps[0] == pytest.approx(steps[1], rel=0.005)
