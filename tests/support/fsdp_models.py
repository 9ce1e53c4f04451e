"""Small models for the FSDP2 tests: an MLP stack and a decoder-only transformer, each with
its repeated blocks in a ``ModuleList`` (what dptune's default sharding shards)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class MLPStack(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 4, classes: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim)) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, sdpa: bool = True):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:   # written out: the same ops on every device (no kernel choice)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            w = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
            a = w.masked_fill(~mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 128, depth: int = 3, heads: int = 4, seq: int = 64,
                 sdpa: bool = True, checkpoint: bool = False):
        super().__init__()
        self.seq, self.checkpoint = seq, checkpoint
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.layers = nn.ModuleList(Block(dim, heads, sdpa) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos[: ids.shape[1]]
        for layer in self.layers:
            if self.checkpoint:     # activation checkpointing, torch's non-reentrant variant
                x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.norm(x))
