"""The simulated cluster: spec parsing, hand-counted figures, and model handling."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn as nn

from dptune.backends.simulated import (CARD_TYPES, DEFAULT_CONTEXT_BYTES, Cluster, SimulatedBackend,
                                       estimate_memory, parse_cluster)
from dptune.errors import SpecError, UsageError, UserCodeError
from dptune.units import GiB, MiB
from dptune.step.workload import Workload
from tiny_models import HID, IN, OUT, mlp, sample  # the hand-counted MLP (tests/support)

R = 512  # the caching allocator's rounding


def rnd(n: int) -> int:
    return -(-n // R) * R


# ---- cluster specs ------------------------------------------------------------------------
def test_uniform_spec():
    c = parse_cluster("4x24GB")
    assert len(c) == 4 and c.total_bytes == (24 * GiB,) * 4 and c.used_bytes == (0,) * 4
    assert c.context_bytes == DEFAULT_CONTEXT_BYTES
    d = c.devices[2]
    assert d.index == 2 and d.available_bytes == 24 * GiB - DEFAULT_CONTEXT_BYTES


def test_mixed_named_and_used_spec():
    c = parse_cluster("2xA100-80GB, 2x40GB, used=0:6GB, used=3:512MiB, context=300MiB")
    assert c.names[:2] == ("A100-80GB", "A100-80GB")
    assert c.total_bytes == (CARD_TYPES["A100-80GB"],) * 2 + (40 * GiB,) * 2
    assert c.used_bytes == (6 * GiB, 0, 0, 512 * MiB)
    assert c.context_bytes == 300 * MiB


@pytest.mark.parametrize("spec,name", [("8xA100-80GB", "A100-80GB"), ("4xV100-16GB", "V100-16GB"),
                                       ("2xrtx_4090", "RTX4090"), ("h200", "H200"), ("1xT4", "T4")])
def test_card_table(spec, name):
    c = parse_cluster(spec)
    assert set(c.names) == {name} and c.total_bytes[0] == CARD_TYPES[name]


@pytest.mark.parametrize("spec", ["", "4x", "4xFoo", "0x24GB", "4x24GB,used=7:1GB", "4x24GB,used=0",
                                  "4x24GB,colour=red", "4x24GB,used=0:30GB", "4x24GB,,"])
def test_bad_specs_say_what_is_accepted(spec):
    with pytest.raises(SpecError) as e:
        parse_cluster(spec)
    assert "accepted forms" in str(e.value)
    assert e.value.exit_code == 2


def test_hopper_workspace_is_larger():
    c = parse_cluster("1xH100,1xA100")
    assert c.workspace_bytes(0) == 32 * MiB and c.workspace_bytes(1) == 8 * MiB + 128 * 1024


@pytest.mark.parametrize("cc, expected", [("9.0", 32 * MiB), ("10.0", 32 * MiB), ("12.0", 32 * MiB),
                                          ("8.6", 8 * MiB + 128 * 1024), ("7.5", 8 * MiB + 128 * 1024)])
def test_the_workspace_follows_the_compute_capability_as_torch_chooses_it(cc, expected):
    """torch's CublasHandlePool.cpp picks 32 MiB for majors 9-12 from the device properties,
    whatever the card is called: a card given by its size with cc= gets the same."""
    assert parse_cluster(f"1x24GB,cc={cc}").workspace_bytes(0) == expected


# ---- hand-counted figures -------------------------------------------------------------------
W = rnd(HID * IN * 4) + rnd(OUT * HID * 4)   # weights, per copy
# the workspaces a busy card keeps (torch's CublasHandlePool.cpp): a cuBLAS workspace per
# thread's handle (the forward's thread and the autograd engine's), and cuBLASLt's 1 MiB
WS = 2 * parse_cluster("1x24GB").workspace_bytes(0) + 2**20
SCALAR = R                                    # a 0-dim float32 tensor


def x_bytes(c: int) -> int:
    return rnd(c * IN * 4)


def h_bytes(c: int) -> int:
    return rnd(c * HID * 4)


def replica_peak(c: int) -> int:
    """Cards 1..n-1 peak in the forward: weight copy, input chunk, the hidden layer and its ReLU."""
    return W + WS + x_bytes(c) + 2 * h_bytes(c)


def test_one_card_no_optimizer_exact():
    e = estimate_memory(mlp(), sample, [64], "1x24GB")
    # the peak is the backward's weight gradient of layer 1: weights, both gradients, the
    # gradient of the hidden layer, the input (saved for it), the loss and its gradient, and
    # the output, which the step keeps alive through the backward as a plain loop does
    expected = W + W + h_bytes(64) + x_bytes(64) + 2 * SCALAR + WS + rnd(64 * OUT * 4)
    assert e.peak_bytes == [expected]
    b = e.breakdown[0]
    assert b["weights"] == W and b["gradients"] == W and b["inputs"] == x_bytes(64)
    assert b["other"] == WS and b["outputs"] == rnd(64 * OUT * 4) + SCALAR
    assert sum(b.values()) == expected


def test_one_card_sgd_is_in_place_and_adam_keeps_two_moments():
    sgd = estimate_memory(mlp(), sample, [64], "1x24GB", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    plain = estimate_memory(mlp(), sample, [64], "1x24GB")
    assert sgd.peak_bytes == plain.peak_bytes
    adam = estimate_memory(mlp(), sample, [64], "1x24GB", optimizer=lambda p: torch.optim.Adam(p))
    # the step's peak: weights, gradients, exp_avg, exp_avg_sq and foreach Adam's sqrt
    # temporary, with the output and the loss still alive (a plain loop holds them)
    assert adam.peak_bytes == [W + W + 3 * W + WS + rnd(64 * OUT * 4) + SCALAR]
    assert adam.breakdown[0]["optimizer"] == 3 * W
    assert adam.baseline_bytes == [W + 2 * W]  # weights + the two moments before the step


@pytest.mark.parametrize("opt", [None, "sgd"])
def test_two_cards_even_exact(opt):
    factory = (lambda p: torch.optim.SGD(p, lr=0.1)) if opt else None
    e = estimate_memory(mlp(), sample, [32, 32], "2x24GB", optimizer=factory)
    # card 0 at the reduction: master weights, replica 0's gradients, the reduced gradients,
    # the loss and its gradient, and the gathered output, alive through the backward
    assert e.peak_bytes[0] == 3 * W + WS + 2 * SCALAR + rnd(64 * OUT * 4)
    assert e.breakdown[0]["gradients"] == 2 * W
    assert e.peak_bytes[1] == replica_peak(32)
    assert e.breakdown[1]["weights"] == W and e.breakdown[1]["inputs"] == x_bytes(32)


def test_four_cards_even_and_uneven_with_an_idle_card0():
    even = estimate_memory(mlp(), sample, [16, 16, 16, 16], "4x24GB")
    assert even.peak_bytes[1:] == [replica_peak(16)] * 3
    assert even.peak_bytes[0] == 3 * W + WS + 2 * SCALAR + rnd(64 * OUT * 4)
    uneven = estimate_memory(mlp(), sample, [0, 20, 20, 24], "4x24GB",
                             optimizer=lambda p: torch.optim.Adam(p))
    # card 0 runs no replica: no workspace, no replica gradients; it holds the weights, the
    # reduced gradients and the optimizer (moments + one foreach temporary), with the
    # gathered output and the loss still alive
    assert uneven.peak_bytes[0] == W + W + 3 * W + rnd(64 * OUT * 4) + SCALAR
    assert uneven.peak_bytes[1:] == [replica_peak(20), replica_peak(20), replica_peak(24)]


def test_unused_card_holds_nothing_and_peaks_are_per_card():
    e = estimate_memory(mlp(), sample, [32, 0, 32, 0], "4x24GB")
    assert e.peak_bytes[1] == 0 and e.peak_bytes[3] == 0
    assert e.peak_bytes[2] == replica_peak(32)


def test_gathered_output_lands_on_card0():
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4096, bias=False)

        def forward(self, x):
            return self.lin(x)

    e = estimate_memory(Wide(), lambda b: torch.randn(b, 8), [16, 16], "2x24GB",
                        loss_fn=lambda out, batch: out.square().mean())
    full = rnd(32 * 4096 * 4)
    # the gathered (32, 4096) output and the square saved for the backward sit on card 0
    assert e.breakdown[0]["outputs"] >= full
    assert e.peak_bytes[0] > e.peak_bytes[1]


# ---- language-model heads make card 0 heavy ------------------------------------------------------
class LM(nn.Module):
    def __init__(self, vocab: int = 8000, d: int = 64, t: int = 32):
        super().__init__()
        self.vocab, self.t = vocab, t
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.relu(self.mix(self.emb(idx))))

    def sample(self, b):
        return torch.randint(0, self.vocab, (b, self.t))


def ce(out, batch):
    return nn.functional.cross_entropy(out.flatten(0, 1), batch.flatten())


def test_card0_heavier_with_lm_head_and_gap_grows_with_batch():
    m = LM()
    backend = SimulatedBackend(Workload(m, m.sample, ce), "4x24GB")
    gaps = []
    for b in (8, 16, 32):
        r = backend.probe([b] * 4)
        assert r.peak_bytes[0] > max(r.peak_bytes[1:])
        gaps.append(r.peak_bytes[0] - max(r.peak_bytes[1:]))
    assert gaps[0] < gaps[1] < gaps[2]


def test_tied_weights_counted_once_and_factory_built_on_meta():
    e = estimate_memory(lambda: LM(vocab=50000, d=256), LM(vocab=50000, d=256).sample, [2, 2], "2x24GB")
    emb = rnd(50000 * 256 * 4)
    mix = rnd(256 * 256 * 4) + rnd(256 * 4)
    assert e.breakdown[0]["weights"] == emb + mix


# ---- the user's state ------------------------------------------------------------------------------
def test_model_and_rng_untouched():
    from dptune.examples.models import SmallResNet

    m = SmallResNet(widths=(8, 16), blocks=1, num_classes=10, image_size=32)
    m.eval()
    m.layers[0].bn1.running_mean.add_(1.5)
    params = {k: v.clone() for k, v in m.state_dict().items()}
    torch.manual_seed(123)
    random.seed(7)
    rng, py_rng = torch.get_rng_state(), random.getstate()
    estimate_memory(m, m.sample, [4, 4], "2x24GB", optimizer=lambda p: torch.optim.AdamW(p))
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py_rng
    assert not m.training
    for k, v in m.state_dict().items():
        assert torch.equal(v, params[k]), k
        assert not type(v).__name__.startswith("Fake")
    assert all(p.grad is None for p in m.parameters())


# ---- third-party model shapes ----------------------------------------------------------------------
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor = None


class KwModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, input_ids=None, mask=None, labels=None):
        logits = self.lin(input_ids * mask)
        return Out(logits=logits, loss=nn.functional.cross_entropy(logits, labels))


def test_kwargs_dataclass_output_and_model_loss():
    batch = lambda b: {"input_ids": torch.randn(b, 16), "mask": torch.ones(b, 16),
                       "labels": torch.zeros(b, dtype=torch.long)}
    # one card: DataParallel runs the module itself, nothing is gathered
    e = estimate_memory(KwModel(), batch, [8], "1x24GB")
    assert e.peak_bytes[0] > 0
    # two cards: torch's gather cannot combine a plain dataclass (TypeError on a GPU), and
    # the simulated cluster says so instead of gathering it anyway
    with pytest.raises(UsageError, match="Out, which DataParallel cannot gather"):
        estimate_memory(KwModel(), batch, [3, 5], "2x24GB")


@pytest.mark.slow
def test_bert_dict_output_sdpa_and_batchnorm_models():
    from dptune.examples.models import BertClassifier, SegNet

    bert = BertClassifier(vocab_size=1000, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    assert min(estimate_memory(bert, bert.sample, [2, 3], "2x24GB").peak_bytes) > 0
    seg = SegNet(num_classes=5, width=4, image_size=16)
    backend = SimulatedBackend(Workload(seg, seg.sample), "2x24GB")
    assert backend.probe([2, 2]).feasible and backend.has_batchnorm


def test_errors_in_user_code_are_wrapped_with_where():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            raise KeyError("boom")

    with pytest.raises(UserCodeError) as e:
        estimate_memory(Broken(), lambda b: torch.randn(b, 4), [1, 2], "2x24GB")
    assert "replica 0" in str(e.value) and "[1, 2]" in str(e.value)
    assert isinstance(e.value.__cause__, KeyError)


def test_data_dependent_model_gets_a_hint():
    class ReadsValues(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * float(x.sum().item())

    from dptune.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError) as e:   # a limit of the simulator, not a bug
        estimate_memory(ReadsValues(), lambda b: torch.randn(b, 4), [2], "1x24GB")
    assert "reads tensor values at test_simulated.py:" in str(e.value)
    assert "(return self.lin(x) * float(x.sum().item()))" in str(e.value)


def test_batch_of_the_wrong_size_is_a_usage_error():
    with pytest.raises(UsageError) as e:
        estimate_memory(mlp(), lambda b: torch.randn(b + 1, IN), [2, 2], "2x24GB")
    assert "sample(4)" in str(e.value)


def test_probe_reports_oom_card():
    backend = SimulatedBackend(Workload(mlp(), sample), Cluster.uniform(2, 48 * MiB, context_bytes=0))
    r = backend.probe([10, 2000])
    assert r.oom_device == 1 and not r.feasible
    assert backend.probe([2, 2]).feasible


def test_chunk_sizes_validated():
    with pytest.raises(ValueError):
        estimate_memory(mlp(), sample, [2, 2, 2], "2x24GB")
