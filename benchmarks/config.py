"""What the benchmarks run: models, simulated clusters, headroom, full-size configurations.

Model sizes keep one simulated probe well under a second on a 2-core machine (a probe's cost
grows with the number of layers and replicas, not with the batch, since no values are
computed). The full-size configurations are factories, built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from dptune.examples import models as M

__all__ = ["HEADROOM", "LEVELS", "add_level_options", "level_budget", "ModelSpec", "MODELS", "SCENARIOS", "QUICK_MODELS", "QUICK_SCENARIOS",
           "REALISTIC", "FullSpec", "FULL_SIZE", "optimizer"]

#: Memory left free on every card; a card's budget is its memory - used by others - this.
HEADROOM = "1GiB"

#: The budget levels the benchmarks of the planners (``ddp``, ``fsdp``, ``lengths``) run at:
#: dptune's default (:data:`dptune.budget.DEFAULT_LEVEL`) first.
LEVELS = ("reserved", "allocated")


def add_level_options(parser: Any) -> None:
    """``--level`` (default: dptune's default level) and ``--headroom`` (default: the level's
    own, :data:`dptune.budget.DEFAULT_HEADROOM`: 1 GiB at ``allocated``, 256 MiB at
    ``reserved``), as a user of ``dptune plan`` or ``plan_lengths`` gets them."""
    parser.add_argument("--level", choices=LEVELS, default=LEVELS[0],
                        help="budget level the cards are checked at (default: %(default)s, dptune's)")
    parser.add_argument("--headroom", default=None,
                        help="memory kept free per card (default: the level's own: 256MiB at "
                             "reserved, 1GiB at allocated)")


def level_budget(level: str, headroom: Optional[str] = None) -> Any:
    """The :class:`dptune.settings.Budget` a user gets at ``level`` (its headroom, and at
    ``reserved`` the allocator model with NCCL's published figures)."""
    from dptune.settings import Budget

    return Budget.at(level, headroom)


def optimizer(params: Any) -> torch.optim.Optimizer:
    """AdamW, as most users train: two state tensors per parameter on card 0."""
    return torch.optim.AdamW(params, lr=1e-4)


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build it, and the batch a user would start from."""

    name: str
    build: Callable[[], nn.Module]
    family: str
    hint_per_card: int          # the starting batch of dptune's max_batch search, per card
    amp: Optional[str] = None   # the step's autocast ("bf16"), as Tuner(amp=...) takes it
    #: also run max_batch with ``output_device="auto"`` (models with large gathered outputs)
    output_auto: bool = False

    def workload_args(self) -> tuple[nn.Module, Callable[[int], Any]]:
        model = self.build()
        return model, model.sample


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("MLP", lambda: M.MLP(in_features=4096, hidden=8192, depth=6), "MLP, 377M params", 4096),
    ModelSpec("ResNet", lambda: M.SmallResNet(blocks=1), "ResNet-style CNN with BatchNorm", 64),
    ModelSpec("GPT", lambda: M.TinyGPT(n_layers=2), "GPT-style LM, vocab 32000, tied, returns logits", 32,
              output_auto=True),
    ModelSpec("BERT", lambda: M.BertClassifier(n_layers=2), "BERT-style encoder + classifier", 64),
    ModelSpec("SegNet", lambda: M.SegNet(), "segmentation, 21x128x128 logits per sample", 32),
)}

#: Realistic configurations, each on one cluster (run after the grid; not with --quick).
REALISTIC: tuple[tuple[ModelSpec, str], ...] = (
    (ModelSpec("GPT-2 small (seq 1024, bf16)", M.gpt2_small,
               "GPT-2 small, 124M params, seq 1024, bf16 autocast, returns logits", 8, amp="bf16",
               output_auto=True),
     "4x24GB"),
    (ModelSpec("ViT-B/16 (224 px)", M.vit_base, "ViT-B/16, 86M params, 224 px, 1000 classes", 64),
     "2x80GB,2x40GB"),
)

#: Simulated clusters (GB in a spec is GiB, as GPU vendors mean it).
SCENARIOS: tuple[str, ...] = (
    "2x24GB", "4x24GB", "8x24GB", "4x80GB", "2x80GB,2x40GB", "4x24GB,used=0:6GB",
)

QUICK_MODELS = ("MLP", "GPT")
QUICK_SCENARIOS = ("4x24GB", "2x80GB,2x40GB", "4x24GB,used=0:6GB")


@dataclass(frozen=True)
class FullSpec:
    """A full-size configuration: one estimate of its cost (time, this process's memory)."""

    name: str
    factory: str                  # name of a factory in dptune.examples.models
    sample: Callable[[int], Any]  # builds a batch without an instance of the model
    chunk_sizes: tuple[int, ...]
    cluster: str


def _tokens(vocab: int, seq: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randint(0, vocab, (b, seq))


def _bert_batch(b: int) -> dict:
    return {"input_ids": torch.randint(0, 30522, (b, 512)),
            "attention_mask": torch.ones(b, 512, dtype=torch.long),
            "labels": torch.randint(0, 2, (b,))}


def _images(size: int) -> Callable[[int], torch.Tensor]:
    return lambda b: torch.randn(b, 3, size, size)


FULL_SIZE: tuple[FullSpec, ...] = (
    FullSpec("GPT-2 small (seq 1024)", "gpt2_small", _tokens(50257, 1024), (4, 4, 4, 4), "4x24GB"),
    FullSpec("7B decoder (seq 2048)", "gpt_7b", _tokens(32000, 2048), (1, 1, 1, 1), "4x80GB"),
    FullSpec("ResNet-50-like (224px)", "resnet50_like", _images(224), (32, 32, 32, 32), "4x24GB"),
    FullSpec("BERT-base (seq 512)", "bert_base", _bert_batch, (16, 16, 16, 16), "4x24GB"),
    FullSpec("SegNet full (512px, 150 classes)", "segnet_full", _images(512), (4, 4, 4, 4), "4x24GB"),
)
