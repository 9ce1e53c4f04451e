"""The cases of ``benchmarks/certificate.py``: synthetic memory surfaces (the shapes of
``tests/search/test_search.py``, staircases, random mixed-card affine surfaces) and small models whose
curves are measured on the simulator (:class:`benchmarks.search.Curves`)."""

from __future__ import annotations

import itertools
import random
from typing import Optional, Sequence

from benchmarks.certificate_surface import GiB, MiB, Surface, _valid

HEAD = 1 * GiB


def _budgets(totals: Sequence[int], used: Optional[Sequence[int]] = None) -> list[int]:
    used = used or [0] * len(totals)
    return [t - u - HEAD for t, u in zip(totals, used)]


def _affine(name: str, family: str, n: int, w: int, a: int, extra0: int, per_batch: int,
            totals: Optional[Sequence[int]] = None, used: Optional[Sequence[int]] = None,
            m: int = 1) -> Surface:
    return Surface(name, family, _budgets(totals or [24 * GiB] * n, used),
                   f=lambda i, c: w + a * c,
                   g=lambda c0, b: w + extra0 + a * c0 + per_batch * b, m=m)


def synthetic() -> list[Surface]:
    """The shapes of ``tests/search/test_search.py`` (typical and hard), at 2-4 cards."""
    w, a = 2 * GiB, 30 * MiB
    out = [_affine(f"mlp{n}", "typical", n, w, a, 4 * GiB, 4096) for n in (2, 3, 4)]
    out.append(_affine("mlp4-mixed", "typical", 4, w, a, 4 * GiB, 4096,
                       totals=[80 * GiB, 80 * GiB, 40 * GiB, 40 * GiB]))
    out.append(_affine("mlp4-used", "typical", 4, w, a, 4 * GiB, 4096, used=[6 * GiB, 0, 0, 0]))
    out.append(_affine("big-output", "typical", 4, GiB, 40 * MiB, 2 * GiB, 3 * MiB // 2))
    out.append(_affine("batchnorm", "typical", 4, GiB, 200 * MiB, 2 * GiB, 100_000, m=2))

    def drop(i: int, c: int) -> int:
        return w + max(int(0.85 * a * c), a * c - 40 * a)
    out.append(Surface("slope-drop", "hard", _budgets([24 * GiB] * 4), f=drop,
                       g=lambda c0, b: drop(1, c0) + 4 * GiB + 8192 * b))
    for n in (2, 4):
        out.append(Surface(f"sheds{n}", "hard", _budgets([24 * GiB] * n),
                           f=lambda i, c: 3 * GiB + 50 * MiB * c,
                           g=lambda c0, b: 20 * GiB + 2048 * b + (3 * GiB + 50 * MiB * c0 if c0 else 0)))
    out.append(Surface("plateau", "hard", _budgets([24 * GiB] * 4), f=lambda i, c: w + a * c,
                       g=lambda c0, b: max(10 * GiB, w + 2 * GiB + a * c0) + 6000 * b))
    out.append(Surface("workspace-jump", "hard", _budgets([24 * GiB] * 4, [6 * GiB, 0, 0, 0]),
                       f=lambda i, c: GiB + 10 * MiB * c,
                       g=lambda c0, b: 3 * GiB + 10 * MiB * c0 + (256 * MiB if b > 1000 else 0),
                       m=2))
    for s in out:
        s.hint = 64 * s.n
    return out


def staircase(seed: int) -> Surface:
    """Monotone staircases (as in ``tests/search/test_search.py``): nothing affine to fit."""
    rng = random.Random(seed)
    n = rng.choice([2, 3, 4])
    steps = [[rng.randint(1, 9) * 37 * MiB for _ in range(400)] for _ in range(n)]
    width = [rng.randint(1, 7) for _ in range(n)]
    base = [rng.randint(1, 4) * GiB for _ in range(n)]
    cum = [list(itertools.accumulate(st)) for st in steps]

    def level(i: int, c: int) -> int:
        return base[i] + cum[i][min(c // width[i], 399)]
    return Surface(f"stairs{seed}", "stairs", _budgets([24 * GiB] * n), f=level,
                   g=lambda c0, b: level(0, c0) + 2 * GiB + 3 * MiB * b, hint=8 * n)


def random_affine(seed: int) -> Surface:
    """Mixed cards, random per-sample costs and output sizes, a start from 1/50 to 2x the
    optimum."""
    rng = random.Random(1000 + seed)
    n = rng.choice([2, 3, 4])
    totals = [rng.choice([12, 16, 24, 40, 80]) * GiB for _ in range(n)]
    used = [rng.choice([0, 0, 2 * GiB]) for _ in range(n)]
    w, a = rng.randint(1, 6) * GiB // 2, rng.randint(2, 200) * MiB
    extra0, per_b = rng.randint(0, 8) * GiB // 2, rng.choice([0, 4096, 512 * 1024, 3 * MiB])
    m = 2 if rng.random() < 0.25 else 1
    s = _affine(f"affine{seed}", "random", n, w, a, extra0, per_b, totals, used, m)
    s.hint = max(m * n, int(rng.choice([0.02, 0.2, 0.9, 1.5]) * sum(totals) // (a + per_b)))
    return s


#: Small models on the simulator (2 cards: the brute force is cheap there; two on 4 cards),
#: 8 samples per card to start, as in ``tests/search/test_search_models.py``.
MODELS = {
    "causal-lm": ("TinyGPT", dict(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32), "2x1GB"),
    "encoder": ("BertClassifier", dict(vocab_size=1000, d_model=64, n_layers=1, n_heads=2, seq_len=32), "2x1GB"),
    "vit": ("ViT", dict(image_size=32, patch=8, d_model=64, n_layers=1, n_heads=2), "2x1GB"),
    "bn-cnn": ("SmallResNet", dict(widths=(8, 16), blocks=1, num_classes=10, image_size=32), "2x1GB"),
    "big-output": ("SegNet", dict(num_classes=21, width=4, image_size=64), "2x2GB"),
    "mlp-tiny-output": ("MLP", dict(in_features=512, hidden=2048, depth=2, num_classes=2), "2x1GB"),
    # 4 cards from the same 2-card curves (card 0's peak depends on its chunk and the batch,
    # not on how the rest is split): the first probe spreads the cards there
    "causal-lm/4": ("TinyGPT", dict(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32), "4x1GB"),
    "encoder/4": ("BertClassifier", dict(vocab_size=1000, d_model=64, n_layers=1, n_heads=2, seq_len=32), "4x1GB"),
}
HEADROOM = 64 * MiB


def model_surface(name: str) -> Surface:
    import torch

    from benchmarks.search import Curves
    from dptune.backends.simulated import SimulatedBackend, parse_cluster
    from dptune.examples import models
    from dptune.step.workload import Workload, has_batchnorm

    cls, kw, spec = MODELS[name]
    model = getattr(models, cls)(**kw)
    wl = Workload(model, model.sample, None, lambda p: torch.optim.AdamW(p, lr=1e-4))
    m = 2 if has_batchnorm(model) else 1
    curves = Curves(wl, m)
    devices = SimulatedBackend(wl, parse_cluster(spec)).devices
    budgets = [d.budget_bytes(HEADROOM) for d in devices]
    def g(c0: int, b: int) -> int:
        # the curves are measured on 2 cards: a rest of 1 under BatchNorm (or no batch at
        # all) is taken at the next batch, an upper bound on the monotone surface
        while not cert_valid([c0, b - c0], m):
            b += 1
        return curves.g(c0, b)
    return Surface(f"{name} {spec}", "models", budgets, f=lambda i, c: curves.f(max(c, m)),
                   g=g, m=m, hint=8 * len(budgets))


def cert_valid(split: Sequence[int], m: int) -> bool:
    return _valid(split, m)
