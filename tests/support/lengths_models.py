"""Small models and batch builders for the length tests (imported by --model/--sample)."""

import torch

from dptune.examples.models import TinyGPT

V = 500


def gpt():
    return TinyGPT(vocab_size=V, d_model=32, n_layers=1, n_heads=2, seq_len=128)


def batch(batch_size, length=16):
    return torch.randint(0, V, (batch_size, length))


def ignores_length(batch_size, length=16):
    return torch.randint(0, V, (batch_size, 8))
