"""How fast each card is: the speed table, the link between cards, and what a step's time is.

- :class:`Link`: The link DataParallel's copies and DDP's all-reduce use (bytes/s, effective).
- :class:`ClusterSpeed`: The speeds of a cluster's cards and their link, as the time estimate uses them.
- :class:`Calibration`: The constants of the estimate (the model: docs/concepts/design-notes.md): what kernels reach of the peaks, a kernel's fixed time, the host's time per op, and ...
- :func:`check_speed_option`: Check one speed option of a cluster spec (raises ``ValueError`` with what is wrong).
- :func:`cluster_speeds`: Each card's speed: the table's (or :data:`ASSUMED_SPEED`), with the spec's ``tflops=``/``bandwidth=`` overrides (raises ``ValueError`` for a card ...
- :func:`cluster_link`: The link between the cards: the spec's ``link=``, else the slowest card's PCIe.

Design notes: docs/concepts/design-notes.md, "dptune/hardware/speeds.py".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from dptune.hardware.cards import ASSUMED_SPEED, CARDS, GBPS, TFLOPS, CardSpeed

__all__ = ["CardSpeed", "CARD_SPEEDS", "ASSUMED_SPEED", "LINKS",
           "Link", "ClusterSpeed", "KERNEL_SECONDS", "LAUNCH_SECONDS", "HOST_SECONDS_PER_OP",
           "COMPUTE_EFFICIENCY", "MEMORY_EFFICIENCY", "Calibration", "CALIBRATION", "ROOFLINE",
           "SPEED_OPTIONS", "check_speed_option",
           "cluster_speeds", "cluster_link", "parse_rate", "parse_seconds"]

CARD_SPEEDS: dict[str, CardSpeed] = {name: card.speed for name, card in CARDS.items()}
# The four constants below were fitted on one H200 (torch 2.11, 2026-11-27; the facts in
# benchmarks/measured/h200-2026-11-27/time.json.gz, 15 steps of an MLP, a ResNet and a GPT at
# batches 1 to 2048) by `python -m benchmarks.validate_time --cpu --fit`, which also gives
# each model's error with the constants fitted on the other two models.
#: The host's time per aten op the step dispatches (views and allocations included: the
#: Python, autograd and dispatcher work around each op): a step's host time over the ops
#: the simulator counts for it was 16-29 us (median per model 21-23) on that machine's CPU.
HOST_SECONDS_PER_OP = 22.5e-6
#: A kernel's fixed time on the card (the real step runs about twice as many kernels as the
#: simulator's ops, each at least a few microseconds): the reason a small chunk is inefficient.
KERNEL_SECONDS = 12e-6
#: The older name of :data:`KERNEL_SECONDS` (the host's launch cost is now in the host time).
LAUNCH_SECONDS = KERNEL_SECONDS
#: The fraction of a card's peak FLOP/s its kernels reach, per dtype class: FP32 (CUDA-core
#: matmuls: MLP, GPT) fitted; tensor cores (TF32 convolutions of a small ResNet, the only
#: tensor-core work measured) fitted, and taken for half precision too (not measured).
COMPUTE_EFFICIENCY: Mapping[str, float] = {"fp32": 0.73, "tf32": 0.24, "fp16": 0.24, "bf16": 0.24}
#: The fraction of the memory bandwidth an op's counted bytes (inputs and outputs once) move
#: at: real kernels read and write more than that count (several passes, in-place writes,
#: multi-tensor optimizer kernels) and below the datasheet's bandwidth.
MEMORY_EFFICIENCY = 0.31


@dataclass(frozen=True)
class Calibration:
    """The constants of the estimate (the model: docs/concepts/design-notes.md): what kernels reach of the
    peaks, a kernel's fixed time, the host's time per op, and where they come from."""

    compute: Mapping[str, float]        # fraction of the peak FLOP/s, per dtype class
    memory: float                       # fraction of the memory bandwidth
    kernel_seconds: float
    host_seconds_per_op: float
    source: str = ""

    def efficiency(self, kind: str) -> float:
        return float(self.compute.get(kind, self.compute.get("fp32", 1.0)))


#: The estimate's constants (fitted on an H200, see above).
CALIBRATION = Calibration(COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, KERNEL_SECONDS, HOST_SECONDS_PER_OP,
                          "fitted on an NVIDIA H200, torch 2.11, 2026-11-27 "
                          "(benchmarks/measured/h200-2026-11-27/time.json.gz)")
#: The first estimate's, for comparison (benchmarks/validate_time.py): the datasheet's peaks,
#: 5 us per kernel, no host time.
ROOFLINE = Calibration({"fp32": 1.0, "tf32": 1.0, "fp16": 1.0, "bf16": 1.0}, 1.0, 5e-6, 0.0,
                       "datasheet peaks, 5 us per kernel, no host (before 2026-11-27)")


@dataclass(frozen=True)
class Link:
    """The link DataParallel's copies and DDP's all-reduce use (bytes/s, effective)."""

    name: str
    bandwidth: float
    host_bandwidth: float         # host -> card (the batch's scatter): PCIe
    source: str = ""


# Effective PCIe x16 throughput, one direction: about 80% of the 15.75 / 31.5 / 63 GB/s raw
# rate of gen 3 / 4 / 5 (PCI-SIG base specifications; the rest is protocol overhead).
LINKS: dict[str, float] = {"pcie3": 12 * GBPS, "pcie4": 25 * GBPS, "pcie5": 50 * GBPS}
NVLINK_EFFICIENCY = 0.8          # of the per-direction NVLink peak, as NCCL's bus bandwidth reaches

SPEED_OPTIONS = ("tflops", "bandwidth", "link", "host")
_SECONDS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|µs|ms|ns|s)?\s*$")
_SECONDS_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)[bB]?(?:/s|ps)?\s*$")
_RATE_UNITS = {"": GBPS, "k": 1e3, "m": 1e6, "g": GBPS, "t": 1e12}


def parse_rate(text: str) -> float:
    """``'900GB/s'``, ``'2TB/s'`` or ``'900'`` (GB/s) -> bytes per second (decimal units)."""
    m = _RATE.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a bandwidth: {text!r}; use e.g. 900GB/s or 2TB/s")
    return float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]


def parse_seconds(text: str) -> float:
    """``'21us'``, ``'0.02ms'`` or ``'2e-5'`` (seconds) -> seconds (> 0)."""
    m = _SECONDS.match(text)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"not a time: {text!r}; use e.g. 20us or 0.02ms")
    return float(m.group(1)) * _SECONDS_UNITS[m.group(2) or ""]


def _per_card(value: str) -> tuple[Optional[int], str]:
    card, colon, rest = value.partition(":")
    if not colon:
        return None, value
    return int(card), rest


def check_speed_option(key: str, value: str) -> None:
    """Check one speed option of a cluster spec (raises ``ValueError`` with what is wrong).

    ``tflops=150`` or ``tflops=1:150``: the peak of every card (or card 1) for every dtype;
    ``bandwidth=900GB/s`` or ``bandwidth=0:2TB/s``: memory bandwidth; ``link=pcie3|pcie4|pcie5|
    nvlink|25GB/s``: the link between cards (default: the slowest card's PCIe); ``host=20us``:
    the host's time per aten op (default :data:`HOST_SECONDS_PER_OP`).
    """
    if key == "link":
        if value.strip().lower() not in (*LINKS, "nvlink"):
            parse_rate(value)
        return
    if key == "host":
        parse_seconds(value)
        return
    card, rest = _per_card(value)
    if card is not None and card < 0:
        raise ValueError(f"card index must be >= 0, got {card}")
    if key == "tflops":
        try:
            x = float(rest)
        except ValueError:
            raise ValueError(f"not a number of TFLOPS: {rest!r}") from None
        if x <= 0:
            raise ValueError("tflops must be > 0")
    elif key == "bandwidth":
        parse_rate(rest)
    else:
        raise ValueError(f"unknown speed option {key!r}")


def _options(spec: str) -> list[tuple[str, str]]:
    out = []
    for item in spec.split(","):
        key, eq, value = item.partition("=")
        if eq and key.strip().lower() in SPEED_OPTIONS:
            out.append((key.strip().lower(), value.strip()))
    return out


def cluster_speeds(names: Sequence[str], spec: str = "") -> list[CardSpeed]:
    """Each card's speed: the table's (or :data:`ASSUMED_SPEED`), with the spec's
    ``tflops=``/``bandwidth=`` overrides (raises ``ValueError`` for a card out of range)."""
    speeds = [CARD_SPEEDS.get(n, ASSUMED_SPEED) for n in names]
    for key, value in _options(spec):
        if key in ("link", "host"):
            continue
        card, rest = _per_card(value)
        if card is not None and card >= len(names):
            raise ValueError(f"{key}={value} names card {card}, but the cluster has cards "
                             f"0..{len(names) - 1}")
        for i in range(len(names)) if card is None else [card]:
            s = speeds[i]
            if key == "tflops":
                f = float(rest) * TFLOPS
                s = CardSpeed(f, f, f, f, s.bandwidth, s.pcie, s.nvlink,
                              source=f"tflops={rest} (spec)", assumed=False)
            else:
                s = CardSpeed(s.fp32, s.tf32, s.fp16, s.bf16, parse_rate(rest), s.pcie, s.nvlink,
                              source=(s.source + "; " if not s.assumed else "") + f"bandwidth={rest} (spec)",
                              assumed=s.assumed)
            speeds[i] = s
    return speeds


def cluster_link(speeds: Sequence[CardSpeed], spec: str = "") -> Link:
    """The link between the cards: the spec's ``link=``, else the slowest card's PCIe."""
    host = min(LINKS[f"pcie{min(max(s.pcie, 3), 5)}"] for s in speeds)
    given = [v for k, v in _options(spec) if k == "link"]
    if not given:
        gen = min(min(max(s.pcie, 3), 5) for s in speeds)
        return Link(f"pcie{gen}", LINKS[f"pcie{gen}"], host, "default: the slowest card's PCIe")
    value = given[-1].lower()
    if value in LINKS:
        return Link(value, LINKS[value], host, "link= (spec)")
    if value == "nvlink":
        nv = min(s.nvlink for s in speeds)
        if nv <= 0:
            raise ValueError("link=nvlink, but some card has no NVLink in the table; give its "
                             "rate instead, e.g. link=100GB/s")
        return Link("nvlink", nv * NVLINK_EFFICIENCY, host, "NVLink per direction x 0.8")
    return Link(value, parse_rate(value), host, "link= (spec)")


@dataclass(frozen=True)
class ClusterSpeed:
    """The speeds of a cluster's cards and their link, as the time estimate uses them."""

    cards: tuple[CardSpeed, ...]
    link: Link
    notes: tuple[str, ...] = field(default=())
    host_seconds_per_op: float = HOST_SECONDS_PER_OP     # the spec's host= sets it

    @classmethod
    def of(cls, names: Sequence[str], spec: str = "") -> "ClusterSpeed":
        cards = cluster_speeds(names, spec)
        notes = []
        if any(c.assumed for c in cards):
            notes.append("card speed assumed for cards given by size (set tflops= and bandwidth= "
                         "in the spec): the estimate compares splits, not cards")
        host = [parse_seconds(v) for k, v in _options(spec) if k == "host"]
        return cls(tuple(cards), cluster_link(cards, spec), tuple(notes),
                   host[-1] if host else HOST_SECONDS_PER_OP)
