"""One replica simulated per class of like cards (dptune.backends.simulated.sharing) gives,
card by card, what the simulation of every replica gives: peaks, breakdowns, notes, the
allocator model's figures and its traces (up to the events' global ids)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptune.backends.simulated.reserved import ReservedModel
from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.sharing import plan_replicas, with_card0_mirrored
from dptune.examples.models import TinyGPT
from dptune.step.workload import Workload


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
MIRRORS: list = []               # the last shared run: each probe's card that stood for card 0


def _both(wl: Workload, cluster: str, splits: list, **kw: Any) -> tuple[list, list, list]:
    """The probes of ``splits`` in turn, shared and in full, with each step's trace."""
    got: dict[bool, tuple[list, list]] = {}
    for share in (True, False):
        b = SimulatedBackend(wl, cluster, reserved=ReservedModel(), **kw)
        b._share_replicas = share
        probes, traces = [], []
        if share:
            MIRRORS.clear()
        for split, out in splits:
            probes.append(b.probe(split, output_device=out))
            traces.append(_normalized(b._step_trace))
            if share:
                MIRRORS.append(b.last_mirror)
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


def _squares(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out.pow(2).mean()     # the output's gradient is a tensor of its own (not expanded)


def test_like_cards_run_one_replica_and_match_every_replica():
    m = Counted()
    wl = Workload(m, lambda n: torch.randn(n, 3, 8, 8), _squares, optimizer=_adamw)
    splits = [([4, 4, 4, 4, 4, 4], 0), ([2, 3, 3, 0, 3, 3], 0)]
    shared, full, traces = _both(wl, "6x24GB", splits)
    _assert_same(shared, full, traces)
    assert MIRRORS == [1, None]
    # shared: 1 replica (card 1's, for cards 1-5 and for card 0's own), then 2 (card 0 and
    # one for the cards of 3 samples), where the full simulation runs 6, then 5
    b = SimulatedBackend(Workload(Counted(), lambda n: torch.randn(n, 3, 8, 8), _squares), "6x24GB")
    runs = CALLS[0]
    b.probe([4] * 6)
    assert CALLS[0] - runs == 1
    b.probe([2, 3, 3, 0, 3, 3])
    assert CALLS[0] - runs == 1 + 2


def test_an_expanded_gradient_runs_card_0_on_its_own():
    """The default loss (the output's sum) hands card 0's replica a stride-0 view of the
    gathered output's gradient where the others get a copy: card 0 is simulated again on its
    own, and from then on, with the same figures."""
    wl = Workload(Counted(), lambda n: torch.randn(n, 3, 8, 8), optimizer=_adamw)
    _assert_same(*_both(wl, "4x24GB", [([4, 4, 4, 4], 0), ([4, 4, 4, 4], 0)]))
    assert MIRRORS == [None, None] and STILL_SHARING[0]
    b = SimulatedBackend(Workload(Counted(), lambda n: torch.randn(n, 3, 8, 8)), "4x24GB")
    runs = CALLS[0]
    b.probe([4] * 4)
    assert CALLS[0] - runs == 1 + 2          # mirrored, refused at the backward, run again
    b.probe([4] * 4)
    assert CALLS[0] - runs == 3 + 2 and b.last_mirror is None


def _ce(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), batch.flatten().to(out.device))


# (cluster, [(split, output card)], the card whose replica stands for card 0's in each probe):
# card 0's chunk equal to a class card's of its spec (mirrored) or not (card 0 runs its own)
MIRROR_CASES = [
    ("4x24GB", [([4, 4, 4, 4], 0), ([3, 5, 5, 5], 0), ([4, 4, 4, 4], 2), ([4, 4, 4, 4], 1),
                ([5, 3, 5, 5], 0)], [1, None, 1, 2, 2]),
    # cards given by size differ in memory only, which the replica does not see
    ("2x24GB,2x40GB", [([4, 4, 4, 4], 0), ([3, 3, 4, 4], 3), ([4, 6, 4, 4], 0), ([4, 6, 5, 5], 0)],
     [1, 1, 2, None]),
    ("1x80GB,3x24GB", [([4, 4, 4, 4], 0), ([0, 4, 4, 4], 0)], [1, None]),
    ("1xH100,3x24GB", [([4, 4, 4, 4], 0)], [None]),      # another capability and workspace
    ("2x24GB", [([4, 4], 0), ([4, 4], 1), ([2, 4], 0)], [1, None, None]),
    ("2xH100,3x24GB", [([2, 2, 2, 2, 2], 0), ([3, 3, 3, 3, 3], 4)], [1, 1]),
]


# two cheap cases, one per kind of output, stay in `make test` (card 0 mirrored and not, from
# card 1 and onto another output card); the other ten (several seconds each) are slow
FAST_MIRROR_CASES = {("losses", "1x80GB,3x24GB"), ("logits", "2x24GB")}


@pytest.mark.parametrize("outputs,cluster,splits,mirrors", [
    pytest.param(outputs, *case, id=f"{outputs}-{case[0]}",
                 marks=() if (outputs, case[0]) in FAST_MIRROR_CASES else pytest.mark.slow)
    for outputs in ("losses", "logits") for case in MIRROR_CASES])
def test_card_0_taken_from_a_like_card_is_exact_on_mixed_clusters(cluster, splits, mirrors, outputs):
    """Card 0 runs no replica where a class card has its chunk and spec: its figures (peak,
    breakdown, allocator trace, kernel notes) are those of every replica simulated, with each
    replica's loss gathered (0-dim outputs) or the logits (a cross-entropy on card 0)."""
    m = _gpt()
    if outputs == "losses":
        wl = Workload(m, m.sample_with_targets, loss_fn=lambda out, batch: out.mean(),
                      optimizer=_adamw, amp="bf16")
    else:
        wl = Workload(m, m.sample, loss_fn=_ce, optimizer=_adamw, amp="bf16")
    _assert_same(*_both(wl, cluster, splits))
    assert MIRRORS == mirrors and STILL_SHARING[0]


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


def test_card_0_is_mirrored_from_an_unpinned_class_card_of_its_chunk_and_spec():
    keys = ["a", "a", "a", "a"]
    spec = ["s", "s", "s", "s"]
    # the output card (1) is pinned: card 2 stands for card 0's replica
    p = with_card0_mirrored(plan_replicas([4, 4, 4, 4], keys, (0, 1)), spec, (0, 1))
    assert p.mirror == 2 and not p.runs(0) and p.runs(2) and not p.runs(3)
    assert p.replica_of(0) == 2 and p.replica_of(3) == 2 and p.replicas_for(2) == 3
    assert p.rep[0] == 0 and p.weight == (1, 1, 2, 0)       # card 0 keeps its own figures
    assert with_card0_mirrored(plan_replicas([3, 4, 4, 4], keys, (0,)), spec, (0,)).mirror is None
    assert with_card0_mirrored(plan_replicas([4, 4, 4, 4], keys, (0,)), ["x", "s", "s", "s"],
                               (0,)).mirror is None
    assert with_card0_mirrored(plan_replicas([4, 4, 4, 4], ["a", "b", "a", "a"], (0,)),
                               ["s", "t", "s", "s"], (0,)).mirror == 2
    assert with_card0_mirrored(plan_replicas([0, 4, 4, 4], keys, (0,)), spec, (0,)).mirror is None


@pytest.mark.slow
def test_scalar_outputs_micro_batches_and_clipping():
    # forward(idx, targets) returns each replica's loss: 0-dim outputs, stacked by the gather
    m = _gpt()
    wl = Workload(m, m.sample_with_targets, loss_fn=lambda out, batch: out.mean(),
                  optimizer=_adamw, accumulate=2, clip_grad_norm=1.0, amp="fp16")
    _assert_same(*_both(wl, "5x24GB", [([3, 3, 3, 3, 3], 0), ([2, 4, 4, 0, 4], 1)]))
    assert STILL_SHARING[0]


TIME_CASES = [("4x24GB", [2, 5, 5, 5]), ("2x24GB,2x40GB", [3, 4, 4, 6]),
              ("RTX4090,3xRTX3090", [4, 3, 3, 0]), ("4x24GB", [4, 4, 4, 4]),
              ("2x24GB,2x40GB", [3, 3, 3, 3])]
# in `make test`: card 0 mirrored (a cross-entropy on like cards) and card 0 refused at the
# backward and run again (the sum) with a class shared on mixed cards; the other eight are slow
FAST_TIME_CASES = {("cross-entropy", 3), ("sum", 4)}


@pytest.mark.parametrize("loss,spec,split", [
    pytest.param(loss, spec, split, id=f"{loss}-{spec}-{'-'.join(map(str, split))}",
                 marks=() if (loss, i) in FAST_TIME_CASES else pytest.mark.slow)
    for loss in ("sum", "cross-entropy") for i, (spec, split) in enumerate(TIME_CASES)])
def test_the_time_estimate_is_the_same_with_one_replica_per_class(spec, split, loss):
    """The estimated step time (per card and in all) does not depend on whether like cards were
    simulated once, card 0's replica included (a cross-entropy: mirrored; the sum: refused
    at the backward and run again): the full simulation is the reference. The host's part may
    miss the views the scatter and the gather make for a card not simulated (one each, 45 us
    of a 35 ms step): the whole step within 0.5%."""
    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.simulated.timing import TimedBackend
    from dptune.examples.models import TinyGPT
    from dptune.step.workload import Workload

    model = TinyGPT()
    times, steps = [], []
    for share in (True, False):
        backend = SimulatedBackend(Workload(model, model.sample, _ce if loss != "sum" else None,
                                            optimizer=lambda p: torch.optim.AdamW(p)), spec)
        backend._share_replicas = share
        r = TimedBackend(backend).probe(split)
        times.append((r.peak_bytes, r.time.card_seconds, r.time.device_seconds, r.time.flops,
                      r.time.card_host_seconds[1:]))      # card 0 makes the views
        steps.append(r.time.step_seconds)
        if share and split.count(split[1]) > 1:
            assert len(set(backend.last_replicas)) < len(split)      # a class was shared
        if share:
            assert (backend.last_mirror == 1) == (loss != "sum" and split[0] == split[1])
    assert times[0] == times[1]
    assert steps[0] == pytest.approx(steps[1], rel=0.005)


class Unused(nn.Module):
    """A layer no forward uses (the reduction fills its gradients with zeros on every
    replica's card) and a buffer read in the forward."""

    def __init__(self, ckpt: bool = False):
        super().__init__()
        self.ckpt = ckpt
        self.a, self.unused, self.b = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)
        self.register_buffer("scale", torch.ones(64))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False) if self.ckpt else self._body(x)


@pytest.mark.parametrize("ckpt", [False, True])
def test_card_0_mirrored_with_an_unused_layer_and_checkpointing(ckpt):
    wl = Workload(Unused(ckpt), lambda n: torch.randn(n, 32), _squares, optimizer=_adamw,
                  amp="fp16" if ckpt else None)
    _assert_same(*_both(wl, "4x24GB", [([4, 4, 4, 4], 0), ([4, 4, 4, 4], 3), ([4, 2, 2, 4], 0)]))
    assert MIRRORS == [1, 1, 3] and STILL_SHARING[0]
