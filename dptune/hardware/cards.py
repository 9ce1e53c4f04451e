"""The one card table: per known card its total memory (as ``torch.cuda.get_device_properties``
reports it), its compute capability (which decides the attention kernel CUDA runs) and its
speeds (dense peaks per dtype class, memory bandwidth, links), each row with its source.
No torch: the cluster spec parser (:mod:`dptune.hardware.cluster`) and the time model
(:mod:`dptune.hardware.speeds`) read it; their ``CARD_TYPES``, ``CARD_CAPABILITY`` and
``CARD_SPEEDS`` are views of :data:`CARDS`.

Speeds are dense peaks (no 2:4 sparsity) from the vendors' datasheets and architecture
whitepapers: ``fp32`` (CUDA-core FP32: what a float32 matmul runs at, TF32 being off for
matmuls by default), ``tf32`` (TF32 tensor cores: float32 convolutions), ``fp16``/``bf16``
(half-precision tensor cores with FP32 accumulation; a card without BF16 tensor cores runs
bfloat16 at its FP32 rate), ``bandwidth`` (bytes/s), ``pcie`` (the generation of the host
link), ``nvlink`` (bytes/s per direction, 0: none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dptune.units import GiB

__all__ = ["CardSpeed", "CardType", "CARDS", "ALIASES", "ASSUMED_SPEED", "DEFAULT_CAPABILITY",
           "TFLOPS", "GBPS"]

TFLOPS = 1e12
GBPS = 1e9


@dataclass(frozen=True)
class CardSpeed:
    """One card's peaks (FLOP/s per dtype class, bytes/s) and its links."""

    fp32: float
    tf32: float
    fp16: float
    bf16: float
    bandwidth: float
    pcie: int = 4
    nvlink: float = 0.0
    source: str = ""
    assumed: bool = False        # not from the table: a card given by size only

    def peak(self, kind: str) -> float:
        """FLOP/s for ``kind`` (``fp32``, ``tf32``, ``fp16``, ``bf16``; else fp32)."""
        return float(getattr(self, kind, self.fp32)) if kind in ("fp32", "tf32", "fp16", "bf16") \
            else self.fp32


def _card(fp32: float, tf32: float, fp16: float, bf16: Optional[float], bw_gbs: float, pcie: int,
          nvlink_gbs: float, source: str) -> CardSpeed:
    return CardSpeed(fp32=fp32 * TFLOPS, tf32=tf32 * TFLOPS, fp16=fp16 * TFLOPS,
                     bf16=(bf16 if bf16 is not None else fp32) * TFLOPS, bandwidth=bw_gbs * GBPS,
                     pcie=pcie, nvlink=nvlink_gbs * GBPS, source=source)


@dataclass(frozen=True)
class CardType:
    """One known card: its name, total memory (bytes), compute capability and speeds."""

    name: str
    total_memory: int
    capability: tuple[int, int]
    speed: CardSpeed


def _row(name: str, gib: float, capability: tuple[int, int], speed: CardSpeed) -> tuple[str, CardType]:
    return name, CardType(name, int(gib * GiB), capability, speed)


# name, total memory (GiB as torch reports it), compute capability, then the speeds: dense
# peaks (TFLOPS: fp32, tf32, fp16, bf16), memory GB/s, PCIe generation, NVLink GB/s per
# direction, and their source.
CARDS: dict[str, CardType] = dict([
    # NVIDIA Tesla V100 datasheet (SXM2): 15.7 FP32, 125 tensor (FP16); 900 GB/s; NVLink 300 GB/s
    # total (150 per direction); no TF32/BF16 tensor cores.
    _row("V100-16GB", 15.77, (7, 0),
         _card(15.7, 15.7, 125, None, 900, 3, 150, "V100 SXM2 datasheet")),
    _row("V100-32GB", 31.74, (7, 0),
         _card(15.7, 15.7, 125, None, 900, 3, 150, "V100 SXM2 datasheet")),
    # NVIDIA T4 datasheet: 8.1 FP32, 65 FP16 mixed precision; 320 GB/s.
    _row("T4", 14.75, (7, 5),
         _card(8.1, 8.1, 65, None, 320, 3, 0, "T4 datasheet")),
    # NVIDIA A10 datasheet: 31.2 FP32, 62.5 TF32, 125 BF16/FP16 (dense); 600 GB/s.
    _row("A10", 22.06, (8, 6),
         _card(31.2, 62.5, 125, 125, 600, 4, 0, "A10 datasheet")),
    # NVIDIA A30 datasheet: 10.3 FP32, 82 TF32, 165 BF16/FP16 (dense); 933 GB/s; NVLink 200 GB/s.
    _row("A30", 23.50, (8, 0),
         _card(10.3, 82, 165, 165, 933, 4, 100, "A30 datasheet")),
    # NVIDIA A100 datasheet (SXM): 19.5 FP32, 156 TF32, 312 BF16/FP16 (dense); 1,555 GB/s (40GB),
    # 2,039 GB/s (80GB); NVLink 600 GB/s total (300 per direction).
    _row("A100-40GB", 39.39, (8, 0),
         _card(19.5, 156, 312, 312, 1555, 4, 300, "A100 SXM datasheet")),
    _row("A100-80GB", 79.15, (8, 0),
         _card(19.5, 156, 312, 312, 2039, 4, 300, "A100 SXM datasheet")),
    # NVIDIA L4 datasheet: 30.3 FP32, 60 TF32, 121 BF16/FP16 (dense; 120/242 with sparsity); 300 GB/s.
    _row("L4", 22.03, (8, 9),
         _card(30.3, 60, 121, 121, 300, 4, 0, "L4 datasheet")),
    # NVIDIA L40S datasheet: 91.6 FP32, 183 TF32, 362 BF16/FP16 (dense); 864 GB/s.
    _row("L40S", 44.39, (8, 9),
         _card(91.6, 183, 362, 362, 864, 4, 0, "L40S datasheet")),
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: 35.6 FP32, 35.6 TF32, 71 FP16/BF16 with FP32
    # accumulate (dense); 936 GB/s.
    _row("RTX3090", 23.68, (8, 6),
         _card(35.6, 35.6, 71, 71, 936, 4, 0, "GA102 whitepaper")),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 82.6 FP32, 82.6 TF32, 165.2 FP16/BF16 with
    # FP32 accumulate (dense); 1,008 GB/s.
    _row("RTX4090", 23.99, (8, 9),
         _card(82.6, 82.6, 165.2, 165.2, 1008, 4, 0, "Ada whitepaper")),
    # NVIDIA RTX A6000 datasheet: 38.7 FP32, 309.7 tensor TFLOPS with sparsity (154.8 dense
    # FP16/BF16, 77.4 dense TF32); 768 GB/s; NVLink bridge 112.5 GB/s total.
    _row("A6000", 47.53, (8, 6),
         _card(38.7, 77.4, 154.8, 154.8, 768, 4, 56, "RTX A6000 datasheet")),
    # NVIDIA H100 datasheet (SXM): 67 FP32, 494.7 TF32, 989.4 BF16/FP16 (dense); 3.35 TB/s;
    # NVLink 900 GB/s total (450 per direction).
    _row("H100-80GB", 79.10, (9, 0),
         _card(67, 494.7, 989.4, 989.4, 3350, 5, 450, "H100 SXM datasheet")),
    # NVIDIA H200 datasheet (SXM): compute as H100 SXM; 4.8 TB/s; NVLink 900 GB/s total.
    _row("H200", 139.80, (9, 0),
         _card(67, 494.7, 989.4, 989.4, 4800, 5, 450, "H200 SXM datasheet")),
    # NVIDIA Turing whitepaper, RTX 2080 Ti (reference): 13.4 FP32, 53.8 FP16 tensor with
    # FP32 accumulate; 616 GB/s; no TF32/BF16 tensor cores.
    _row("RTX2080Ti", 10.76, (7, 5),
         _card(13.4, 13.4, 53.8, None, 616, 3, 0, "Turing whitepaper")),
])

#: Other names a spec may use for the cards above.
ALIASES = {"V100": "V100-16GB", "A100": "A100-80GB", "H100": "H100-80GB", "H200-141GB": "H200",
           "RTXA6000": "A6000", "3090": "RTX3090", "4090": "RTX4090", "2080Ti": "RTX2080Ti"}
DEFAULT_CAPABILITY = (8, 0)           # for a card given by its size only ('24GB'), unless cc=

#: A card given by its size only ('24GB'): assumed, the same for every such card (so the
#: estimate compares splits but not cards); set the real figures with tflops= and bandwidth=.
ASSUMED_SPEED = CardSpeed(fp32=20 * TFLOPS, tf32=80 * TFLOPS, fp16=160 * TFLOPS, bf16=160 * TFLOPS,
                          bandwidth=1000 * GBPS, pcie=4, source="assumed (card given by size)",
                          assumed=True)


