"""``dptune.ddp.plan(objective="throughput")``: per-rank batches with the shortest step that fits."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from dptune import ddp
from dptune.errors import UsageError
from dptune.step.presets import adamw


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def vectors(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


def test_equal_cards_where_memory_does_not_bind_get_equal_batches():
    # the case: 'balance' gives [44, 45, 1] (shares of budget); the cards are the same
    # speed (both assumed) and the tiny MLP binds no memory, so equal batches are fastest
    balance = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90, simulate="2x24GB,12GB",
                       objective="balance")
    assert balance.batch_sizes[2] < 5
    # every offline plan gives its estimated speed beside equal batches
    assert any(n.startswith("speed (estimated): this plan") and "equal batches [30, 30, 30]" in n
               for n in balance.notes)
    fast = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90, simulate="2x24GB,12GB",
                    objective="throughput")
    assert fast.objective == "throughput"
    assert fast.batch_sizes == [30, 30, 30]
    assert all(r.measured_peak_bytes is not None and r.measured_peak_bytes <= r.budget_bytes
               for r in fast.ranks)
    assert sum(n.startswith("rank ") for n in fast.notes) == 3


def test_a_faster_card_gets_more_and_each_rank_says_why():
    fast = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=400,
                    simulate="24GB,24GB,tflops=0:100,bandwidth=0:1000GB/s,tflops=1:10,"
                             "bandwidth=1:100GB/s", objective="throughput")
    b0, b1 = fast.batch_sizes
    assert b0 + b1 == 400 and b0 > 2 * b1
    reasons = [n for n in fast.notes if n.startswith("rank ")]
    assert len(reasons) == 2 and any("sets the step time" in n for n in reasons)
    speed = next(n for n in fast.notes if n.startswith("speed (estimated)"))
    this, equal = (float(x) for x in re.findall(r"([0-9.]+) ms", speed)[::-1][:2])
    assert this <= equal                      # never slower than equal batches


def test_a_memory_cap_binds_and_is_named():
    # a card with little room left: its batch is capped by memory, the others take the rest
    wide = nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10))
    spec = "2x24GB,24GB,used=2:23.5GB"
    fast = ddp.plan(wide, vectors, optimizer=adamw, global_batch=9000, simulate=spec,
                    objective="throughput", headroom=0, budget_level="allocated")  # 0.5 GB: no NCCL
    b = fast.batch_sizes
    assert sum(b) == 9000 and b[2] < b[0]
    rank2 = next(n for n in fast.notes if n.startswith("rank 2"))
    assert "memory cap" in rank2
    assert fast.ranks[2].measured_peak_bytes <= fast.ranks[2].budget_bytes


def test_throughput_needs_a_global_batch():
    with pytest.raises(UsageError, match="global_batch"):
        ddp.plan(mlp(), vectors, objective="throughput", simulate="2x24GB")


def test_a_rank_worth_leaving_out_is_named():
    # a 16M-parameter layer: the slow card's optimizer step and the all-reduce over PCIe 3
    # cost more than its samples save
    wide = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 8192))
    fast = ddp.plan(wide, vectors, optimizer=adamw, global_batch=256,
                    simulate="RTX4090,RTX2080Ti", objective="throughput")
    assert sum(fast.batch_sizes) == 256 and fast.batch_sizes[0] > fast.batch_sizes[1]
    note = next(n for n in fast.notes if n.startswith("faster without rank(s) 1"))
    speed = next(n for n in fast.notes if n.startswith("speed (estimated)"))
    plan_ms = float(re.findall(r"this plan ([0-9.]+) ms", speed)[0])
    alone_ms = float(re.findall(r"takes ([0-9.]+) ms", note)[0])
    assert alone_ms < plan_ms


def test_a_tiny_model_is_host_bound_on_every_rank_and_the_plan_says_so():
    # each rank is a process of its own: its host's time to issue the step (its ops x the
    # host's cost per op, dptune.hardware.speeds) floors its step; the tiny MLP's card work is far less
    fast = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90, simulate="2x24GB,12GB",
                    objective="throughput")
    note = next(n for n in fast.notes if n.startswith("the ranks' hosts set the step"))
    host_ms, card_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", note))
    assert host_ms > card_ms
    # the estimated step is the host's time plus the all-reduce, not less
    this = float(re.findall(r"this plan ([0-9.]+) ms", next(
        n for n in fast.notes if n.startswith("speed (estimated)")))[0])
    assert this >= host_ms
    # a host 1000 times faster: the cards set the step again
    quick = ddp.plan(mlp(), vectors, optimizer=adamw, global_batch=90,
                     simulate="2x24GB,12GB,host=22ns", objective="throughput")
    assert not any(n.startswith("the ranks' hosts set the step") for n in quick.notes)
