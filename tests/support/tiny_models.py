"""Small models that several test files build, defined once here.

``SmallMLP``: 4 inputs, 8 tanh units, 3 outputs, the same weights every time (seed 0); the
wrapper tests (test_parallel.py, test_result_wrap.py) run it on the CPU and compare outputs.

The hand-counted MLP: two bias-free Linear layers with a ReLU between them, IN x HID and
HID x OUT fp32 weights; test_step.py, backends/simulated/test_simulated.py and
backends/test_ddp_memory.py write their byte counts for it (weights, gradients, activations
of a chunk of ``c`` samples in terms of IN, HID and OUT)."""

from __future__ import annotations

import torch
from torch import nn

IN, HID, OUT = 1000, 2000, 10


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID, bias=False), nn.ReLU(), nn.Linear(HID, OUT, bias=False))


def sample(b: int) -> torch.Tensor:
    return torch.randn(b, IN)


class SmallMLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x, mask=None, scale=1.0):
        y = self.net(x) * scale
        if mask is not None:
            y = y * mask
        return y
