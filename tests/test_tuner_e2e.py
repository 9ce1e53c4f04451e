"""The tuner end to end on the simulated cluster, with dptune's example models."""

from __future__ import annotations

import pytest
import torch

from dptune import Tuner
from dptune.backends.simulated import SimulatedBackend
from dptune.examples.models import SmallResNet, TinyGPT
from dptune.result.model import TuneResult, shares
from dptune.step.workload import Workload

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # BalancedDataParallel on CPU


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def small_cnn() -> SmallResNet:
    return SmallResNet(widths=(32, 64, 128, 256), blocks=1, num_classes=10, image_size=64)


def small_lm() -> TinyGPT:
    return TinyGPT(vocab_size=8000, d_model=128, n_layers=2, n_heads=2, seq_len=64)


def snapshot(model: torch.nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_state(model: torch.nn.Module, before: dict) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].device == v.device
        assert torch.equal(after[k], v), k
    assert all(p.grad is None for p in model.parameters())


def balanced_or_no_move_helps(r: TuneResult, workload: Workload, cluster: str) -> None:
    """Imbalance <= 1.05, or moving one sample off the heaviest card makes things no better."""
    if r.imbalance <= 1.05:
        return
    s = r.shares
    heavy = max(range(len(s)), key=lambda i: s[i])
    if r.chunk_sizes[heavy] == 0:  # card 0 with no samples: nothing to move
        assert any("no split can balance" in a for a in r.advice)
        return
    backend = SimulatedBackend(workload, cluster)
    try:
        for j in range(len(s)):
            moved = list(r.chunk_sizes)
            moved[heavy] -= 1
            moved[j] += 1
            if j == heavy or 1 in moved and any(a.startswith("the model has BatchNorm")
                                                for a in r.notes):
                continue
            p = backend.probe(moved)
            if p.feasible:
                assert max(shares(p.peak_bytes, r.budget_bytes)) >= max(s) * (1 - 1e-9), moved
    finally:
        backend.close()


@pytest.mark.slow
def test_small_cnn_balances_and_card0_gets_less():
    torch.manual_seed(0)
    model = small_cnn()
    before = snapshot(model)
    r = Tuner(model, model.sample, batch_size=128, optimizer=adamw, simulate="4x2GB",
              headroom="256MiB", budget_level="allocated", verbose=False).fit()
    assert r.backend == "simulated" and sum(r.chunk_sizes) == 128
    assert r.chunk_sizes[0] < min(r.chunk_sizes[1:])  # identical cards: card 0 pays more
    assert r.imbalance < r.even.imbalance
    assert r.num_probes <= 12 and 1 not in r.chunk_sizes
    balanced_or_no_move_helps(r, Workload(model, model.sample, optimizer=adamw), "4x2GB")
    assert_same_state(model, before)
    assert type(r.model).__name__ == "BalancedDataParallel"


def test_small_lm_balances_or_says_why_not():
    torch.manual_seed(0)
    model = small_lm()
    before = snapshot(model)
    r = Tuner(model, model.sample, batch_size=64, simulate="4x2GB", headroom="256MiB",
              budget_level="allocated", verbose=False).fit()   # 2 GB cards: no room for NCCL
    assert r.chunk_sizes[0] < min(r.chunk_sizes[1:])
    assert max(r.shares) < max(shares(r.even.peak_bytes, r.budget_bytes))
    # logits gathered on card 0 dominate it: the report says so
    assert any("model.reduce(losses)" in a for a in r.advice)
    balanced_or_no_move_helps(r, Workload(model, model.sample), "4x2GB")
    assert_same_state(model, before)


@pytest.mark.slow
def test_max_batch_with_adamw_and_loss_in_forward_beats_even():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=16000, d_model=256, n_layers=2, n_heads=2, seq_len=64)
    before = snapshot(model)
    r = Tuner(model, model.sample_with_targets, batch_size=64, optimizer=adamw,
              loss_fn=lambda out, batch: out.mean(), simulate="4x2GB", headroom="256MiB",
              budget_level="allocated",
              objective="max_batch", verbose=False).fit()
    assert r.objective == "max_batch"
    assert r.even.feasible and r.batch_size > r.even.batch_size
    assert any(p.purpose == "even-max" for p in r.probes)
    verified = [p for p in r.probes if list(p.chunk_sizes) == r.chunk_sizes]
    assert verified and verified[0].feasible
    assert all(p <= b for p, b in zip(r.peak_bytes, r.budget_bytes))
    assert_same_state(model, before)


def test_factory_model_on_a_mixed_cluster():
    r = Tuner(small_lm, lambda n: torch.randint(0, 8000, (n, 64)), batch_size=48,
              simulate="1x4GB,3x2GB", headroom="256MiB", verbose=False).fit()
    assert r.model_name == "small_lm" and len(r.chunk_sizes) == 4
    assert r.chunk_sizes[0] > 0
    # a factory may describe a model larger than this machine: it is not built for real
    assert r.model is None and any(".wrap(model)" in n for n in r.notes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA GPUs")
def test_no_gpu_falls_back_to_the_default_simulated_cluster(capsys):
    model = TinyGPT(vocab_size=2000, d_model=64, n_layers=1, n_heads=2, seq_len=32)
    r = Tuner(model, model.sample, batch_size=16, verbose=True).fit()
    err = capsys.readouterr().err
    assert err.count("no GPU is visible: simulating 4x24GB") == 1 and "simulate=" in err
    assert r.backend == "simulated" and any("4x24GB" in n for n in r.notes)
