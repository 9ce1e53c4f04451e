"""DDP and FSDP2 plans at the reserved level: each certified rank's cap looked past on the
allocator model (a rank's step one more sample at a time, until its allocated peak alone is
over), checked here against every batch of the window probed for real by a rank of the same
card; and a rank found to fit again above its cap leaves the plan uncertified."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from dptune import ddp
from dptune.backends.simulated import parse_cluster
from dptune.backends.simulated.ddp_memory import DDPOptions
from dptune.settings import Budget
from dptune.ddp.probers import SimulatedProber
from dptune.examples.models import BertClassifier
from dptune.step.presets import adamw
from dptune.step.workload import Workload
from dptune.types import CardWindow


def net() -> nn.Module:
    return BertClassifier(vocab_size=1000, d_model=128, n_layers=2, n_heads=4, seq_len=256)


def vectors(n: int) -> dict:
    return {"input_ids": torch.randint(0, 1000, (n, 128)),
            "attention_mask": torch.ones(n, 128, dtype=torch.long),
            "labels": torch.randint(0, 2, (n,))}


CLUSTER = "2x4GB,3GB"


def windows(note: str) -> dict[int, tuple[int, int]]:
    """rank -> (first batch looked at, first whose allocated peak alone is over) of the note."""
    return {int(r): (int(a), int(b) + 1) for r, a, b in re.findall(
        r"rank (\d+): over from batch (\d+) to batch (\d+)", note)}


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_each_certified_cap_is_looked_past_and_over_throughout(strategy: str) -> None:
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER,
                    strategy=strategy)
    assert plan.certified
    note = next(n for n in plan.notes if n.startswith("looked past each rank's cap"))
    seen = windows(note)
    assert sorted(seen) == [0, 1, 2]
    for r, (start, end) in seen.items():
        assert start == plan.batch_sizes[r] + 1 and end > start


@pytest.mark.slow
def test_the_ddp_window_agrees_with_every_batch_probed() -> None:
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    seen = windows(next(n for n in plan.notes if n.startswith("looked past")))
    budget = Budget.at("reserved")
    cluster = parse_cluster(CLUSTER)
    wl = Workload(net, vectors, None, adamw)
    for r in (0, 2):       # a 4 GB card and the 3 GB one
        prober = SimulatedProber(wl, cluster, r, DDPOptions(), budget.headroom_bytes, None, {},
                                 budget.reserved)
        cap = prober.device.budget_bytes(budget.headroom_bytes)
        start, end = seen[r]
        # every batch of the window over, each a real simulated step of the rank
        assert all((prober.probe(b) or 0) > cap for b in range(start, end))
        # and at its end the allocated peak alone (+ NCCL's buffers) is over
        stats = prober.backend.probe([end]).memory_stats
        nccl = prober.backend.reserved.fixed.nccl_for(1)
        assert stats is not None and stats[0]["allocated_bytes.all.peak"] + nccl > cap
        prober.close()


def test_a_rank_that_fits_again_above_its_cap_leaves_the_plan_uncertified(monkeypatch) -> None:
    def fits_again(self, b: int) -> CardWindow:  # type: ignore[no-untyped-def]
        return CardWindow(0, b + 1, None, fits=b + 3, fits_bytes=1)
    monkeypatch.setattr(SimulatedProber, "look_past", fits_again)
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    assert not plan.certified
    b0 = plan.batch_sizes[0]
    assert any(f"rank 0 is over at batch {b0 + 1} and fits again at batch {b0 + 3}" in n
               and "not certified" in n for n in plan.notes)


def test_no_look_at_the_allocated_level() -> None:
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER,
                    budget_level="allocated")
    assert plan.certified and not any("looked past" in n for n in plan.notes)


def test_a_rank_that_fits_again_above_its_cap_is_taken_past_the_fall(monkeypatch) -> None:
    """The look (here a stand-in) finds each rank within budget again from its cap + 3 to its
    cap + 5, over from there to its window's end; each rank raised to cap + 5 is probed in one
    round (here measured within budget) and the plan is certified on the model there."""
    plain = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    raised: set[tuple[int, int]] = set()
    real_probe = SimulatedProber.probe

    def fits_again(self, b: int) -> CardWindow:  # type: ignore[no-untyped-def]
        raised.add((self.device.index, b + 5))
        return CardWindow(0, b + 1, b + 9, fits=b + 3, fits_bytes=1, last_fits=b + 5)

    def probe(self, b: int):  # type: ignore[no-untyped-def]
        if (self.device.index, b) in raised:
            return self.device.budget_bytes(self.headroom) - 1
        return real_probe(self, b)
    monkeypatch.setattr(SimulatedProber, "look_past", fits_again)
    monkeypatch.setattr(SimulatedProber, "probe", probe)
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    assert plan.certified and plan.rounds == plain.rounds + 1
    assert list(plan.batch_sizes) == [b + 5 for b in plain.batch_sizes]
    assert [r.max_batch_size for r in plan.ranks] == list(plan.batch_sizes)
    # equal local batches stop where the first rank fails: at the caps before the raise
    assert plan.even_batch_size == plain.even_batch_size == 3 * min(plain.batch_sizes)
    note = next(n for n in plan.notes if n.startswith("past the caps the ranks' figures fall"))
    assert "certified on the allocator model" in note
    for r, b in enumerate(plain.batch_sizes):
        assert f"rank {r}: over at batch {b + 1}, within budget again at batch {b + 3} and " \
               f"last at batch {b + 5} (measured)" in note


def test_a_raised_rank_measured_over_keeps_its_cap_and_the_others_keep_theirs(monkeypatch) -> None:
    """Only the 3 GB card's rank fits at its raised batch: it takes it, the 4 GB ranks keep
    their caps (their raised probes over), and the plan is not certified."""
    plain = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    real_probe = SimulatedProber.probe

    def fits_again(self, b: int) -> CardWindow:  # type: ignore[no-untyped-def]
        return CardWindow(0, b + 1, b + 9, fits=b + 3, fits_bytes=1, last_fits=b + 5)

    def probe(self, b: int):  # type: ignore[no-untyped-def]
        if self.device.index == 2 and b == plain.batch_sizes[2] + 5:
            return self.device.budget_bytes(self.headroom) - 1
        return real_probe(self, b)
    monkeypatch.setattr(SimulatedProber, "look_past", fits_again)
    monkeypatch.setattr(SimulatedProber, "probe", probe)
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    assert not plan.certified
    assert list(plan.batch_sizes) == [*plain.batch_sizes[:2], plain.batch_sizes[2] + 5]
    assert [r.max_batch_size for r in plan.ranks] == list(plan.batch_sizes)
    assert any("rank 2: over at batch" in n and "certified on the allocator model" in n
               for n in plan.notes)
    assert any("rank 0 is over at batch" in n and "not certified" in n for n in plan.notes)


def test_a_raised_rank_measured_over_leaves_the_plan_uncertified(monkeypatch) -> None:
    def fits_again(self, b: int) -> CardWindow:  # type: ignore[no-untyped-def]
        return CardWindow(0, b + 1, b + 9, fits=b + 3, fits_bytes=1, last_fits=b + 5)
    monkeypatch.setattr(SimulatedProber, "look_past", fits_again)
    plan = ddp.plan(net, vectors, optimizer=adamw, objective="max_batch", simulate=CLUSTER)
    assert not plan.certified
    assert any("fits again" in n and "not certified" in n for n in plan.notes)
