"""A stand-in for the README's ``mymodels.py`` (the user's own models, in the working
directory), small enough for the CPU: tests/test_readme.py copies it into the folder where the
README's blocks run, so a command such as ``dptune plan --model mymodels:Net ...`` runs as
printed. ``Net`` and ``GPT`` bring their own ``sample`` (the README's commands without
``--input-shape`` rely on it); ``Net`` takes the ``depth`` the README passes."""

from __future__ import annotations

import torch
from torch import nn

from dptune.examples.models import SmallResNet, TinyGPT


class Net(SmallResNet):
    """An image classifier on 3 x 224 x 224 images; ``depth`` blocks per stage."""

    def __init__(self, depth: int = 1):
        super().__init__(widths=(16, 32), blocks=depth, num_classes=10, image_size=224)


class GPT(TinyGPT):
    """A GPT-style decoder over the README's vocabulary of 32,000 and sequences of up to 2,048
    tokens (its own sample is that long); ``layers`` names its blocks, as the README's
    ``shard`` function reads them."""

    def __init__(self):
        super().__init__(vocab_size=32000, d_model=64, n_layers=2, n_heads=2, seq_len=2048)

    @property
    def layers(self) -> nn.ModuleList:
        return self.blocks


def make_batch(n: int) -> torch.Tensor:
    return torch.randn(n, 3, 224, 224)
