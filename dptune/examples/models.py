"""Example models, one per family, each with a ``sample(batch_size)`` that builds a batch.

The CLI uses ``Model.sample`` when no ``--sample``/``--input-shape`` is given, e.g.
``dptune search --model dptune.examples.models:TinyGPT``. Default sizes keep a simulated
probe short on a 2-core machine; the ``*_full`` factories give full-size configurations.

- :class:`MLP`: plain multilayer perceptron (classification logits).
- :class:`SmallResNet`: ResNet-style CNN with BatchNorm.
- :class:`TinyGPT`: GPT-style decoder with tied embeddings and a large vocabulary; returns
  logits (heavy on card 0 when gathered), or only the loss when ``targets`` are given.
- :class:`BertClassifier`: BERT-style encoder with a classification head; returns a dict.
- :class:`SegNet`: encoder-decoder whose output (per-pixel class logits) is large per sample.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "SmallResNet", "TinyGPT", "BertClassifier", "SegNet", "ViT",
           "gpt2_small", "gpt_7b", "resnet50_like", "bert_base", "segnet_full", "vit_base"]


class MLP(nn.Module):
    def __init__(self, in_features: int = 1024, hidden: int = 4096, depth: int = 4,
                 num_classes: int = 1000):
        super().__init__()
        self.in_features = in_features
        layers: list[nn.Module] = []
        d = in_features
        for _ in range(depth):
            layers += [nn.Linear(d, hidden), nn.ReLU()]
            d = hidden
        layers.append(nn.Linear(d, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def sample(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, self.in_features)


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class SmallResNet(nn.Module):
    def __init__(self, widths: tuple = (64, 128, 256, 512), blocks: int = 2,
                 num_classes: int = 1000, image_size: int = 128):
        super().__init__()
        self.image_size = image_size
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        layers, cin = [], widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                layers.append(_Block(cin, w, 2 if (b == 0 and i > 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def sample(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn_mask = None if mask is None else mask[:, None, None, :].bool()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           is_causal=self.causal and mask is None)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class _TransformerBlock(nn.Module):
    def __init__(self, d: int, heads: int, causal: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = _Attention(d, heads, causal)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style decoder with tied input/output embeddings.

    ``forward(idx)`` returns logits of shape (B, T, vocab): gathered on card 0 by
    DataParallel, they make card 0 heavy. ``forward(idx, targets)`` returns only the loss.
    """

    def __init__(self, vocab_size: int = 32000, d_model: int = 256, n_layers: int = 4,
                 n_heads: int = 4, seq_len: int = 256):
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_TransformerBlock(d_model, n_heads, True) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def sample(self, batch_size: int) -> torch.Tensor:
        return torch.randint(0, self.vocab_size, (batch_size, self.seq_len))

    def sample_with_targets(self, batch_size: int) -> tuple:
        idx = self.sample(batch_size)
        return idx, torch.roll(idx, -1, dims=1)


class BertClassifier(nn.Module):
    """BERT-style encoder with a classification head; takes kwargs, returns a dict."""

    def __init__(self, vocab_size: int = 30522, d_model: int = 256, n_layers: int = 4,
                 n_heads: int = 4, seq_len: int = 128, num_labels: int = 2):
        super().__init__()
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln = nn.LayerNorm(d_model)
        self.blocks = nn.ModuleList(_TransformerBlock(d_model, n_heads, False) for _ in range(n_layers))
        self.pool = nn.Linear(d_model, d_model)
        self.cls = nn.Linear(d_model, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None) -> dict:
        t = input_ids.shape[1]
        x = self.ln(self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device)))
        for blk in self.blocks:
            x = blk(x, attention_mask)
        logits = self.cls(torch.tanh(self.pool(x[:, 0])))
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out

    def sample(self, batch_size: int) -> dict:
        return {"input_ids": torch.randint(0, self.vocab_size, (batch_size, self.seq_len)),
                "attention_mask": torch.ones(batch_size, self.seq_len, dtype=torch.long),
                "labels": torch.randint(0, self.cls.out_features, (batch_size,))}


class SegNet(nn.Module):
    """Encoder-decoder for segmentation: output (B, classes, H, W) is large per sample."""

    def __init__(self, num_classes: int = 21, width: int = 32, image_size: int = 128):
        super().__init__()
        self.image_size = image_size
        w = width

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                                 nn.BatchNorm2d(cout), nn.ReLU())

        self.enc1, self.enc2, self.enc3 = conv(3, w), conv(w, 2 * w), conv(2 * w, 4 * w)
        self.dec2, self.dec1 = conv(4 * w + 2 * w, 2 * w), conv(2 * w + w, w)
        self.out = nn.Conv2d(w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(e3, scale_factor=2.0), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], 1))
        return self.out(d1)

    def sample(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


class ViT(nn.Module):
    """Vision Transformer: 16x16 patches, a class token, an encoder, a linear head (logits)."""

    def __init__(self, image_size: int = 64, patch: int = 16, d_model: int = 128,
                 n_layers: int = 2, n_heads: int = 4, num_classes: int = 10):
        super().__init__()
        self.image_size = image_size
        tokens = (image_size // patch) ** 2 + 1
        self.patch = nn.Conv2d(3, d_model, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos = nn.Parameter(torch.zeros(1, tokens, d_model))
        self.blocks = nn.ModuleList(_TransformerBlock(d_model, n_heads, False) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x[:, 0]))

    def sample(self, batch_size: int) -> torch.Tensor:
        return torch.randn(batch_size, 3, self.image_size, self.image_size)


# ---- full-size configurations (for the scale figures in benchmarks/) --------------------
def gpt2_small() -> TinyGPT:
    """GPT-2 small: 124M parameters, sequence 1024, vocabulary 50257."""
    return TinyGPT(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, seq_len=1024)


def gpt_7b() -> TinyGPT:
    """A 7B-parameter decoder (LLaMA-7B-like widths: d=4096, 32 layers, vocab 32000)."""
    return TinyGPT(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, seq_len=2048)


def resnet50_like() -> SmallResNet:
    return SmallResNet(widths=(256, 512, 1024, 2048), blocks=3, image_size=224)


def bert_base() -> BertClassifier:
    return BertClassifier(d_model=768, n_layers=12, n_heads=12, seq_len=512)


def segnet_full() -> SegNet:
    return SegNet(num_classes=150, width=64, image_size=512)


def vit_base() -> ViT:
    """ViT-B/16: 86M parameters, 224 px, 1000 classes."""
    return ViT(image_size=224, patch=16, d_model=768, n_layers=12, n_heads=12, num_classes=1000)


def n_params(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
