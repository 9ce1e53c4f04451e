"""The certified search on the simulated cluster with real (small) models, against the
exhaustive optimum of ``benchmarks/search.py`` (per-card curves measured on the simulator)."""

from __future__ import annotations

import warnings

import pytest
import torch

from benchmarks import search as brute
from dptune.backends.simulated import SimulatedBackend, parse_cluster
from dptune.examples.models import MLP, BertClassifier, SegNet, SmallResNet, TinyGPT, ViT
from dptune.split import even_split
from dptune.tuner import Tuner
from dptune.step.workload import Workload, has_batchnorm

HEADROOM = 64 * 2**20


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


# 1033.125 MiB: 1 GiB and the 9.125 MiB that the workspaces of a card grew by when the
# backward's cuBLAS workspace and cuBLASLt's were charged (the same room for the step as before)
MODELS = {
    "mlp-tiny-output": (lambda: MLP(in_features=512, hidden=2048, depth=2, num_classes=2), "4x1033.125MB"),
    "mlp-mixed-cards": (lambda: MLP(in_features=512, hidden=2048, depth=2, num_classes=2),
                        "2x2GB,2x1GB,used=0:256MiB"),
    "causal-lm": (lambda: TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32),
                  "2x1GB"),
    "encoder": (lambda: BertClassifier(vocab_size=1000, d_model=64, n_layers=1, n_heads=2,
                                       seq_len=32), "2x1GB"),
    "vit": (lambda: ViT(image_size=32, patch=8, d_model=64, n_layers=1, n_heads=2), "2x1033.125MB"),
    "bn-cnn": (lambda: SmallResNet(widths=(8, 16), blocks=1, num_classes=10, image_size=32), "2x1GB"),
    "big-output": (lambda: SegNet(num_classes=21, width=4, image_size=64), "2x2GB"),
}


def measured(model, optimizer, cluster):
    wl = Workload(model, model.sample, None, optimizer)
    return SimulatedBackend(wl, cluster), wl


#: The issue's targets, the even-split baseline counted: <= 6 probes on the typical shapes,
#: <= 8 on the hard ones (the shapes that show the old search's causes: a tiny-output MLP
#: started thousands of times below its optimum, mixed cards with card 0 partly taken, an
#: LM's and a segmentation net's large gathered outputs; on 2 cards nothing can ride along
#: on card 0's questions, see dptune/search/max_batch.py; a small ViT, whose patch convolution's
#: cuDNN workspace, 14 MiB whatever the batch, is most of a step at 8 samples, so that the
#: first guess in proportion to one probe falls far short).
HARD = {"mlp-tiny-output", "mlp-mixed-cards", "causal-lm", "big-output", "vit"}

#: (model, optimizer, start batch per card): 8 per card is 2000x below the tiny-output MLP's
#: optimum (65137 on 4 cards); 814 per card is 20x below it.
CASES = [(name, adamw, 8) for name in MODELS] + [("mlp-tiny-output", sgd, 8),
                                                  ("causal-lm", sgd, 8),
                                                  ("mlp-tiny-output", adamw, 814)]
#: the one case of `make test` (a hard shape: 4 mixed cards, card 0 partly taken); the other
#: models' searches run in `make test-slow` (each is seconds of exhaustive optimum)
FAST_CASE = ("mlp-mixed-cards", adamw, 8)


@pytest.mark.parametrize("name,optimizer,start",
                         [pytest.param(*c, marks=() if c == FAST_CASE else pytest.mark.slow)
                          for c in CASES],
                         ids=[f"{n}-{o.__name__}-start{s}" for n, o, s in CASES])
def test_largest_batch_is_the_exhaustive_optimum(name, optimizer, start):
    build, cluster = MODELS[name]
    model = build()
    backend, wl = measured(model, optimizer, cluster)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = Tuner(model, model.sample, batch_size=start * len(backend.devices),
                  optimizer=optimizer, objective="max_batch", headroom=HEADROOM, verbose=False,
                  backend=backend, budget_level="allocated").fit()   # the oracle's level
    m = 2 if has_batchnorm(model) else 1
    curves = brute.Curves(wl, m)
    budgets = r.budget_bytes
    best, split = brute.max_batch_optimum(curves, budgets, guess=r.batch_size,
                                          guess_split=r.chunk_sizes)
    assert r.batch_size == best, (r.chunk_sizes, split)
    assert best >= 20 * r.requested_batch_size     # the start is at least 20x below
    assert r.certified
    assert all(p <= b for p, b in zip(r.peak_bytes, budgets))
    assert any(list(p.chunk_sizes) == r.chunk_sizes for p in r.probes)
    # the even split's largest batch, measured: fits at E, not at E + 1
    n = len(budgets)
    e = r.even.batch_size
    assert curves.fits(even_split(e, n), budgets) and not curves.fits(even_split(e + 1, n), budgets)
    assert r.batch_size >= e
    assert r.num_probes <= (8 if name in HARD else 6), [p.purpose for p in r.probes]
    if m == 2:
        assert all(1 not in p.chunk_sizes for p in r.probes)


@pytest.mark.parametrize("name", [pytest.param("causal-lm", marks=pytest.mark.slow),
                                  pytest.param("bn-cnn", marks=pytest.mark.slow),
                                  "mlp-mixed-cards"])
def test_balance_is_optimal_and_certified(name):
    build, cluster = MODELS[name]
    model = build()
    backend, wl = measured(model, adamw, cluster)
    n = len(parse_cluster(cluster))
    batch = 12 * n
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = Tuner(model, model.sample, batch_size=batch, optimizer=adamw, headroom=HEADROOM,
                  verbose=False, backend=backend, budget_level="allocated").fit()
    curves = brute.Curves(wl, 2 if has_batchnorm(model) else 1)
    opt = brute.balance_optimum(curves, r.budget_bytes, batch, r.chunk_sizes)
    share = brute.max_share(r.peak_bytes, r.budget_bytes)
    if r.chunk_sizes == even_split(batch, n):
        # the even split kept: within the tolerance (2%, relative) of the optimum, said so
        assert opt.max_share <= share <= 1.02 * opt.max_share
        assert any(note.startswith("the even split is kept") for note in r.notes)
    else:
        assert share == pytest.approx(opt.max_share, rel=1e-9)
    assert r.certified and r.num_probes <= 6


def test_simulator_gathers_on_the_output_device():
    model = TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)
    backend, _ = measured(model, adamw, "2x1GB")
    on0 = backend.estimate([4, 4]).breakdown
    on1 = backend.estimate([4, 4], output_device=1).breakdown
    logits = 8 * 32 * 2000 * 4          # the whole batch's logits, fp32
    assert on0[0]["outputs"] >= logits and on0[1].get("outputs", 0) == 0
    assert on1[1]["outputs"] >= logits and on1[0].get("outputs", 0) == 0


@pytest.mark.slow
def test_output_device_auto_keeps_a_card_that_raises_the_largest_batch():
    model = TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)
    backend, _ = measured(model, adamw, "3x1GB")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = Tuner(model, model.sample, batch_size=32, optimizer=adamw, objective="max_batch",
                  headroom=HEADROOM, verbose=False, backend=backend, output_device="auto",
                  budget_level="allocated").fit()
    assert r.output_device == 1 and r.card0_output_batch_size is not None
    assert r.output_device_gain == r.batch_size - r.card0_output_batch_size > 0
    assert any("come back on card 1" in a and "targets.to(output.device)" in a for a in r.advice)
    assert r.certified and all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))
    # the split returned was measured with the outputs on card 1
    assert any(list(p.chunk_sizes) == r.chunk_sizes and p.purpose.startswith("output 1:")
               for p in r.probes)
    from dptune.report import render_table

    assert "outputs gathered on card 1" in render_table(r)
