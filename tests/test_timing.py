"""The time estimate: FLOP and byte counts against hand counts, the card table, the spec's
speed options, and the times a simulated DataParallel step is given."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dptune.backends.base import ProbeResult
from dptune.hardware.cluster import CARD_TYPES, parse_cluster
from dptune.backends.simulated import SimulatedBackend
from dptune.backends.simulated.timing import TimedBackend, count_ops, ddp_allreduce_seconds, op_cost
from dptune.errors import SpecError
from dptune.hardware.speeds import (CALIBRATION, CARD_SPEEDS, HOST_SECONDS_PER_OP, LINKS, ROOFLINE, ClusterSpeed,
                                    parse_rate, parse_seconds)
from dptune.types import StepTime, TimeSource
from dptune.step.workload import Workload

F32 = 4


def kernels(fn):
    return [(name, c) for name, c in count_ops(fn) if c.kernel]


def only(ops, name):
    found = [c for n, c in ops if n.startswith(name)]
    assert len(found) == 1, ops
    return found[0]


# ---- counts against hand counts ------------------------------------------------------------

def test_linear_flops_and_bytes_by_hand():
    B, n_in, n_out = 8, 32, 16
    x, w, b = torch.randn(B, n_in), torch.randn(n_out, n_in), torch.randn(n_out)
    ops = kernels(lambda: F.linear(x, w, b))
    assert [n for n, _ in ops] == ["aten.addmm.default"]         # the transpose is a view
    c = only(ops, "aten.addmm")
    assert c.flops == 2 * B * n_in * n_out
    assert c.bytes == F32 * (n_out + B * n_in + n_in * n_out + B * n_out)           # bias, x, w^T read; y written
    assert c.kind == "fp32"
    # torch's own FlopCounterMode agrees
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        F.linear(x, w, b)
    assert fc.get_total_flops() == c.flops


def test_convolution_flops_and_bytes_by_hand():
    N, C, H, W, K, kh, kw = 2, 3, 10, 12, 5, 3, 3
    x, w = torch.randn(N, C, H, W), torch.randn(K, C, kh, kw)
    c = only(kernels(lambda: F.conv2d(x, w, padding=1)), "aten.convolution")
    Ho, Wo = H, W                                                 # padding 1 keeps the size
    assert c.flops == 2 * N * K * Ho * Wo * C * kh * kw
    assert c.bytes == F32 * (N * C * H * W + K * C * kh * kw + N * K * Ho * Wo)
    assert c.kind == "tf32"                                       # cuDNN's TF32 is on by default


def test_attention_block_flops_and_bytes_by_hand():
    B, H, S, D = 2, 4, 16, 8
    q, k, v = (torch.randn(B, H, S, D) for _ in range(3))

    def block():
        p = ((q @ k.transpose(-2, -1)) * D ** -0.5).softmax(-1)
        return p @ v

    ops = kernels(block)
    assert [n.split(".")[1] for n, _ in ops] == ["bmm", "mul", "_softmax", "bmm"]
    qkv, scores = B * H * S * D, B * H * S * S
    assert sum(c.flops for _, c in ops) == 2 * (2 * B * H * S * S * D)
    assert [c.bytes for _, c in ops] == [F32 * (2 * qkv + scores), F32 * 2 * scores,
                                         F32 * 2 * scores, F32 * (scores + 2 * qkv)]
    # the fused kernel CUDA runs (as the simulator picks it): 4 B H S^2 D, q k v read, out written
    half = [t.half() for t in (q, k, v)]
    flash = only(kernels(lambda: torch.ops.aten._scaled_dot_product_flash_attention(
        *half, 0.0, False, False, scale=0.3)), "aten._scaled_dot_product_flash_attention")
    assert flash.flops == 4 * B * H * S * S * D
    assert flash.kind == "fp16"
    assert flash.bytes >= 2 * 4 * qkv                               # q, k, v in, out


def test_roofline_takes_the_longer_of_compute_and_memory():
    speed = CARD_SPEEDS["A100-80GB"]
    x, w = torch.randn(4096, 4096), torch.randn(4096, 4096)
    mm = only(kernels(lambda: x @ w), "aten.mm")
    assert mm.flops == 2 * 4096 ** 3
    # at the datasheet's peaks (the first estimate): 5 us per kernel
    assert mm.seconds(speed, ROOFLINE) == pytest.approx(mm.flops / speed.fp32 + 5e-6)
    # at the fitted fractions of the peaks, plus the kernel's fixed time
    cal = CALIBRATION
    assert mm.seconds(speed) == pytest.approx(mm.flops / (speed.fp32 * cal.compute["fp32"]) + cal.kernel_seconds)
    add = only(kernels(lambda: x + w), "aten.add")
    assert add.flops == 0
    assert add.seconds(speed, ROOFLINE) == pytest.approx(3 * 4096 * 4096 * F32 / speed.bandwidth + 5e-6)
    assert add.seconds(speed) == pytest.approx(3 * 4096 * 4096 * F32 / (speed.bandwidth * cal.memory)
                                               + cal.kernel_seconds)
    # a half-precision matmul on the tensor cores, at their fraction of the peak
    h = only(kernels(lambda: x.half() @ w.half()), "aten.mm")
    assert h.kind == "fp16" and h.seconds(speed) == pytest.approx(
        h.flops / (speed.fp16 * cal.compute["fp16"]) + cal.kernel_seconds)


# ---- the card table and the spec ---------------------------------------------------------

def test_every_card_of_the_cluster_table_has_a_speed():
    assert set(CARD_TYPES) <= set(CARD_SPEEDS)
    for name, s in CARD_SPEEDS.items():
        assert s.fp32 <= s.tf32 <= s.fp16 and s.bandwidth > 0 and s.source, name
    # a few datasheet figures (dense, no sparsity)
    assert CARD_SPEEDS["H100-80GB"].bf16 == pytest.approx(989.4e12)
    assert CARD_SPEEDS["A100-40GB"].tf32 == pytest.approx(156e12)
    assert CARD_SPEEDS["RTX4090"].fp16 == pytest.approx(165.2e12)


def test_speed_options_in_the_spec():
    c = parse_cluster("RTX4090,2080Ti,24GB,tflops=2:50,bandwidth=2:500GB/s,link=pcie3")
    s = ClusterSpeed.of(c.names, c.spec)
    assert s.cards[0] == CARD_SPEEDS["RTX4090"] and s.cards[1] == CARD_SPEEDS["RTX2080Ti"]
    assert s.cards[2].fp16 == s.cards[2].fp32 == pytest.approx(50e12)
    assert s.cards[2].bandwidth == pytest.approx(500e9)
    assert s.link.bandwidth == LINKS["pcie3"]
    assert ClusterSpeed.of(("A100-80GB",) * 2, "link=nvlink").link.bandwidth == pytest.approx(0.8 * 300e9)
    plain = ClusterSpeed.of(("24GB",), "24GB")
    assert plain.cards[0].assumed and plain.notes
    assert parse_rate("2TB/s") == pytest.approx(2e12) and parse_rate("900") == pytest.approx(900e9)
    assert plain.host_seconds_per_op == HOST_SECONDS_PER_OP
    assert ClusterSpeed.of(("H200",), "H200,host=40us").host_seconds_per_op == pytest.approx(40e-6)
    assert parse_seconds("0.02ms") == pytest.approx(20e-6) and parse_seconds("3e-5") == pytest.approx(3e-5)


@pytest.mark.parametrize("spec", ["4x24GB,tflops=x", "4x24GB,tflops=9:3", "4x24GB,link=fast",
                                  "2xA100,2xT4,link=nvlink", "4x24GB,bandwidth=-3GB/s",
                                  "4x24GB,host=fast", "4x24GB,host=0us"])
def test_bad_speed_options_are_spec_errors(spec):
    with pytest.raises(SpecError):
        parse_cluster(spec)


def test_step_time_survives_json():
    t = StepTime(card_seconds=(0.5, 0.25), step_seconds=0.75, source=TimeSource.ESTIMATED,
                 serial_seconds=0.1, transfer_seconds=0.15, flops=(10, 20), bytes_moved=(3, 4),
                 host_seconds=0.7, card_host_seconds=(0.3, 0.2))
    r = ProbeResult(chunk_sizes=(2, 1), peak_bytes=(5, 6), time=t)
    back = ProbeResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r
    assert t.samples_per_second(3) == pytest.approx(4.0)
    assert t.device_seconds == pytest.approx(0.75) and not t.host_bound
    # a report written before the host's part: no host time
    old = {k: v for k, v in t.to_dict().items() if "host" not in k}
    assert StepTime.from_dict(old).host_seconds == 0.0 and StepTime.from_dict(old).card_host_seconds == ()


# ---- a simulated DataParallel step --------------------------------------------------------

def _linear_workload(n_in=256, n_out=128):
    model = nn.Linear(n_in, n_out, bias=False)
    return Workload(model=model, sample=lambda n: torch.randn(n, n_in), optimizer=None)


def test_simulated_step_counts_flops_per_card_and_the_copies_by_hand():
    n_in, n_out = 256, 128
    b = TimedBackend(SimulatedBackend(_linear_workload(n_in, n_out), "2xRTX4090"))
    r = b.probe([6, 2])
    t = r.time
    assert t.source is TimeSource.ESTIMATED
    # forward 2cIO, weight gradient 2cIO (the batch needs no gradient)
    assert t.flops == (4 * 6 * n_in * n_out, 4 * 2 * n_in * n_out)
    link = b.speed.link
    # the weights broadcast to card 1 and its gradient reduced onto card 0: one copy each
    assert t.transfer_seconds == pytest.approx(2 * n_in * n_out * F32 / link.bandwidth)
    assert t.card_seconds[0] > t.card_seconds[1] > 0
    assert t.device_seconds == pytest.approx(max(t.card_seconds) + t.serial_seconds + t.transfer_seconds)
    assert t.step_seconds == pytest.approx(max(t.device_seconds, t.host_seconds))
    # the host issues both replicas one after the other, and card 0's own part
    h0, h1 = t.card_host_seconds
    assert h0 >= h1 > 0 and t.host_seconds > h0 + h1
    assert t.host_bound                       # a tiny layer: the host sets the step
    # a card with no samples does no work, no copies go to it, the host issues nothing for it
    solo = b.probe([8, 0]).time
    assert solo.card_seconds[1] == 0.0 and solo.transfer_seconds == 0.0
    assert solo.flops == (4 * 8 * n_in * n_out, 0)
    assert solo.card_host_seconds[1] == 0.0
    assert solo.host_seconds < t.host_seconds          # one replica fewer to issue
    # the spec's host= sets the host's cost per op: the counts stay, the times scale
    fast = TimedBackend(SimulatedBackend(_linear_workload(n_in, n_out), "2xRTX4090,host=1ns")).probe([6, 2]).time
    assert fast.host_seconds == pytest.approx(t.host_seconds * 1e-9 / HOST_SECONDS_PER_OP)
    assert fast.step_seconds == pytest.approx(fast.device_seconds)


def test_a_faster_card_gets_a_shorter_time_for_the_same_chunk():
    b = TimedBackend(SimulatedBackend(_linear_workload(1024, 1024), "RTX4090,RTX2080Ti"))
    t = b.probe([512, 512]).time
    assert t.card_seconds[0] < t.card_seconds[1]


def test_ring_allreduce_by_hand():
    assert ddp_allreduce_seconds(10**9, 1, 1e9) == 0.0
    assert ddp_allreduce_seconds(10**9, 4, 1e9) == pytest.approx(2 * 3 / 4)


def test_op_cost_of_a_view_is_nothing():
    x = torch.randn(3, 4)
    assert op_cost(torch.ops.aten.view.default, (x, [12]), {}, x.view(12)).kernel is False


def test_the_counter_changes_no_memory_figure():
    from dptune.examples.models import TinyGPT

    model = TinyGPT(vocab_size=512, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    wl = Workload(model=model, sample=model.sample, optimizer=lambda p: torch.optim.AdamW(p))
    plain = SimulatedBackend(wl, "RTX4090,RTX3090").probe([3, 5])
    timed = TimedBackend(SimulatedBackend(wl, "RTX4090,RTX3090")).probe([3, 5])
    assert timed.peak_bytes == plain.peak_bytes and timed.breakdown == plain.breakdown
    assert plain.time is None and timed.time is not None
