"""The training step's settings: each knob's effect on each card, counted by hand."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

from dptune import Tuner
from dptune.backends.simulated import estimate_memory, parse_cluster
from dptune.errors import UsageError
from dptune.report import plot_result, render_table, write_report
from dptune.result.model import TuneResult
from dptune.step.workload import StepSettings, Workload
from tiny_models import HID, IN, OUT, mlp, sample  # the hand-counted MLP (tests/support)

R = 512  # the caching allocator's rounding


def rnd(n: int) -> int:
    return -(-n // R) * R


W = rnd(HID * IN * 4) + rnd(OUT * HID * 4)          # fp32 weights, per copy
# the workspaces a busy card keeps (torch's CublasHandlePool.cpp): a cuBLAS workspace per
# thread's handle (the forward's thread and the autograd engine's), and cuBLASLt's 1 MiB
WS = 2 * parse_cluster("1x24GB").workspace_bytes(0) + 2**20
SCALAR = R



# ---- settings ------------------------------------------------------------------------------
def test_settings_describe_and_round_trip():
    s = StepSettings(amp="bf16", accumulate=2, clip_grad_norm=1.0)
    assert s.describe() == "bf16 autocast, accumulate 2, clip 1"
    assert StepSettings().describe() == "fp32"
    assert StepSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert StepSettings.from_dict(None) == StepSettings()
    assert StepSettings(step="m:f").describe() == "step m:f"


@pytest.mark.parametrize("kw,msg", [({"amp": "fp8"}, "amp must be"), ({"accumulate": 0}, "accumulate"),
                                    ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
                                    ({"step": 3}, "step must be a function"),
                                    ({"step": lambda m, b, o: None, "amp": "bf16"}, "replaces the built-in")])
def test_bad_settings_are_usage_errors(kw, msg):
    with pytest.raises(UsageError, match=msg):
        Workload(mlp(), sample, **kw)


def test_workload_settings_name_the_step_function():
    def my_step(model, batch, optimizer):
        pass

    s = Workload(mlp(), sample, step=my_step).settings
    assert s.step == f"{__name__}:test_workload_settings_name_the_step_function.<locals>.my_step"


# ---- each knob, counted by hand ---------------------------------------------------------------
def test_bf16_autocast_stores_linear_activations_in_two_bytes():
    c = 32
    fp32 = estimate_memory(mlp(), sample, [c, c], "2x24GB")
    bf16 = estimate_memory(mlp(), sample, [c, c], "2x24GB", amp="bf16")
    # card 1 peaks in the forward. fp32: the weight copy, the input chunk, the hidden layer
    # and its ReLU (4 bytes each)
    assert fp32.peak_bytes[1] == W + WS + rnd(c * IN * 4) + 2 * rnd(c * HID * 4)
    # bf16: the input chunk (fp32) and its bf16 copy, layer 1's bf16 weight copy and the
    # hidden layer in 2 bytes (the weight copy is not saved, so it is gone before the ReLU)
    assert bf16.peak_bytes[1] == (W + WS + rnd(c * IN * 4) + rnd(c * IN * 2)
                                  + rnd(HID * IN * 2) + rnd(c * HID * 2))
    # per sample, the stored activations are 2-byte: doubling the chunk adds the input in
    # 4 + 2 bytes and the hidden layer in 2 bytes
    bigger = estimate_memory(mlp(), sample, [c, 2 * c], "2x24GB", amp="bf16")
    assert bigger.peak_bytes[1] - bf16.peak_bytes[1] == c * (IN * 4 + IN * 2 + HID * 2)


def test_accumulate_two_holds_the_first_micro_batch_gradients_through_the_second():
    one = estimate_memory(mlp(), sample, [64], "1x24GB")
    two = estimate_memory(mlp(), sample, [64], "1x24GB", accumulate=2)
    # in the second backward, layer 1's new gradient (fp32, HID x IN) sits beside the
    # gradients accumulated from the first micro-batch, before it is added into them
    assert two.peak_bytes[0] - one.peak_bytes[0] == rnd(HID * IN * 4)
    assert two.breakdown[0]["gradients"] == W + rnd(HID * IN * 4)
    assert one.breakdown[0]["gradients"] == W


class Deep(nn.Module):
    """K tiny layers: gradients are small, so clipping's per-parameter norms show."""

    K, D = 40, 16

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(self.D, self.D, bias=False) for _ in range(self.K)])

    def forward(self, x):
        return self.layers(x)


def test_clip_grad_norm_adds_its_temporaries():
    k, d = Deep.K, Deep.D
    plain = estimate_memory(Deep(), lambda b: torch.randn(b, d), [1], "1x24GB")
    clipped = estimate_memory(Deep(), lambda b: torch.randn(b, d), [1], "1x24GB", clip_grad_norm=1.0)
    weights = k * rnd(d * d * 4)
    # at the total norm: weights, gradients, the output and the loss (kept alive), the
    # workspace, one 0-dim norm per gradient, their stack and the total norm
    assert clipped.peak_bytes == [2 * weights + rnd(d * 4) + SCALAR + WS
                                  + k * SCALAR + rnd(k * 4) + SCALAR]
    assert clipped.peak_bytes[0] > plain.peak_bytes[0]
    assert clipped.breakdown[0]["other"] == WS + k * SCALAR + rnd(k * 4) + SCALAR


def test_default_step_keeps_the_output_alive_through_the_backward():
    seen = {}

    def drop_early(model, batch, optimizer):
        out = model(batch)
        loss = out.sum()
        del out
        loss.backward()
        seen["ran"] = True

    default = estimate_memory(mlp(), sample, [64], "1x24GB")
    early = estimate_memory(mlp(), sample, [64], "1x24GB", step=drop_early)
    assert seen == {"ran": True}
    # the output (64 x OUT fp32) is the only difference
    assert default.peak_bytes[0] - early.peak_bytes[0] == rnd(64 * OUT * 4)


def test_a_step_function_is_what_runs_and_its_allocations_appear():
    extra = 64 * 2**20
    calls = []

    def step(model, batch, optimizer):
        calls.append((type(model).__name__, tuple(batch.shape), type(optimizer).__name__))
        keep = torch.empty(extra, dtype=torch.uint8, device="cuda")   # card 0, as on a GPU
        out = model(batch)
        out.sum().backward()
        optimizer.step()
        del keep

    e = estimate_memory(mlp(), sample, [16, 16], "2x24GB", step=step,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    # run twice: first with card 0's replica taken from card 1's, again with its own (the
    # output's sum hands card 0 an expanded gradient: dptune.backends.simulated.sharing)
    assert calls == [("_SimulatedDataParallel", (32, IN), "SGD")] * 2
    base = estimate_memory(mlp(), sample, [16, 16], "2x24GB",
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    # the step's buffer is alive through the whole step, so card 0's peak grows by it
    # exactly; card 1 is untouched
    assert e.peak_bytes[0] - base.peak_bytes[0] == extra
    assert e.peak_bytes[1] == base.peak_bytes[1]


def test_autocast_cuda_in_the_users_code_takes_effect_with_cuda_rules():
    seen = {}

    def step(model, batch, optimizer):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(batch)
            probs = torch.softmax(out, -1)
            normed = nn.functional.layer_norm(out, (OUT,))
            seen.update(out=out.dtype, probs=probs.dtype, normed=normed.dtype,
                        ce=nn.functional.cross_entropy(out, torch.zeros(len(out), dtype=torch.long,
                                                                    device=out.device)).dtype)
        seen["after"] = model(batch).dtype
        (probs.sum() + normed.sum()).backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")     # no "CUDA is not available. Disabling autocast"
        estimate_memory(mlp(), sample, [4, 4], "2x24GB", step=step)
    # CUDA's lists: Linear in bf16; softmax, layer_norm and the losses in fp32 (the CPU
    # autocast rules would keep softmax and layer_norm in bf16)
    assert seen == {"out": torch.bfloat16, "probs": torch.float32, "normed": torch.float32,
                    "ce": torch.float32, "after": torch.float32}
    # outside a simulated step, autocast("cuda") is as torch leaves it on this machine
    x = torch.randn(2, IN)
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                assert nn.Linear(IN, 2)(x).dtype == torch.float32


def test_fp16_with_a_grad_scaler_and_clipping_runs_and_steps():
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    fp16 = estimate_memory(mlp(), sample, [16, 16], "2x24GB", amp="fp16", clip_grad_norm=1.0,
                           optimizer=adam)
    bf16 = estimate_memory(mlp(), sample, [16, 16], "2x24GB", amp="bf16", clip_grad_norm=1.0,
                           optimizer=adam)
    # the same casts; the scaler adds its scale, inverse scale and found-inf scalars on card 0
    assert fp16.peak_bytes[1] == bf16.peak_bytes[1]
    assert fp16.peak_bytes[0] >= bf16.peak_bytes[0]


# ---- settings reach the result and the report ---------------------------------------------------
def test_tuner_records_settings_in_result_report_and_plots(tmp_path):
    res = Tuner(mlp(), sample, batch_size=64, simulate="2x24GB", amp="bf16", accumulate=2,
                verbose=False).fit()
    assert res.settings == StepSettings(amp="bf16", accumulate=2)
    write_report(res, str(tmp_path))
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["settings"]["amp"] == "bf16" and data["settings"]["accumulate"] == 2
    assert TuneResult.load(str(tmp_path)).settings == res.settings
    assert "bf16 autocast, accumulate 2" in (tmp_path / "summary.md").read_text()
    assert "bf16 autocast, accumulate 2" in render_table(res).splitlines()[0]
    fig = plot_result(res, "peaks")
    assert "bf16 autocast, accumulate 2" in fig.axes[0].get_title()


def test_attention_under_autocast_is_chosen_on_the_cast_inputs():
    class Att(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(64, 192)

        def forward(self, x):
            # fp32 q, k, v: CUDA autocast casts them to bf16 before choosing the kernel
            q, k, v = self.qkv(x).float().view(x.shape[0], 16, 3, 4, 16).permute(2, 0, 3, 1, 4)
            return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def kernels(amp):
        e = estimate_memory(Att(), lambda b: torch.randn(b, 16, 64), [2, 2], "2x24GB", amp=amp)
        return next(n for n in e.notes if n.startswith("attention"))

    assert "efficient x2" in kernels(None)      # fp32 cannot run flash
    assert "flash x2" in kernels("bf16")


# ---- the same step on the real-GPU backend (against the fake CUDA runtime) ---------------------
def _cuda_probe(wl, sizes=(4, 4)):
    from tests.backends.cuda.test_cuda_backend import FakeRuntime

    from dptune.backends.cuda import CudaBackend

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # BalancedDataParallel passes through without CUDA
        with CudaBackend(wl, [0, 1], runtime=FakeRuntime()) as b:
            return b.probe(list(sizes))


@pytest.mark.parametrize("amp,dtype", [(None, torch.float32), ("bf16", torch.bfloat16),
                                       ("fp16", torch.float16)])
def test_cuda_backend_runs_autocast_accumulation_and_clipping(monkeypatch, amp, dtype):
    seen, clipped, steps = [], [], []
    real_clip = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, *a, **k):
        clipped.append(max_norm)
        return real_clip(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)

    def loss_fn(out, batch):
        seen.append(out.dtype)
        return out.float().pow(2).mean()

    def opt(p):
        o = torch.optim.SGD(p, lr=0.1)
        o.register_step_post_hook(lambda *a: steps.append(1))
        return o

    wl = Workload(nn.Linear(6, 3), lambda b: torch.randn(b, 6), loss_fn, opt, amp=amp,
                  accumulate=2, clip_grad_norm=0.5)
    r = _cuda_probe(wl)
    # warm-up and two measured steps, two micro-batches each, one clip and one optimizer step
    # per step (the fake runtime's cards are the CPU, so autocast runs on the CPU there)
    assert r.feasible and seen == [dtype] * 6
    assert clipped == [0.5] * 3 and len(steps) == 3


def test_cuda_backend_runs_the_users_step_function_on_the_wrapped_model():
    from dptune.parallel import BalancedDataParallel

    calls = []

    def step(model, batch, optimizer):
        calls.append((type(model), tuple(batch.shape), type(optimizer).__name__))
        model(batch).sum().backward()
        optimizer.step()

    wl = Workload(nn.Linear(6, 3), lambda b: torch.randn(b, 6),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), step=step)
    assert _cuda_probe(wl, (3, 5)).feasible
    assert calls == [(BalancedDataParallel, (8, 6), "SGD")] * 3


# ---- gathered outputs the loss never reads ------------------------------------------------------
def test_unread_gathered_outputs_are_named_with_their_bytes_and_advised():
    from dptune.step.advice import CACHE_MARK, unread_outputs_advice
    from dptune.examples.hf import SEQ_LEN, VOCAB_SIZE, gpt2_batch, tiny_gpt2

    b, d, layers = 8, 64, 2
    with_cache = estimate_memory(lambda: tiny_gpt2(), gpt2_batch, [4, 4], "2x24GB")
    # the model computes its loss per replica; its logits and its cache (a key and a value
    # of (B, heads, T, d/heads) fp32 per layer) are gathered onto card 0 and never read
    # the cache's field is named by the installed transformers (past_key_values, or cache since
    # 5.24); the entry is recognised by its value, a transformers Cache
    cache_entry = next(e for e, _ in with_cache.unread_outputs if e.endswith(CACHE_MARK))
    assert cache_entry in (f"output['{f}']{CACHE_MARK}" for f in ("past_key_values", "cache"))
    assert dict(with_cache.unread_outputs) == {
        "output['logits']": b * SEQ_LEN * VOCAB_SIZE * 4,
        cache_entry: layers * 2 * b * SEQ_LEN * d * 4}
    text = unread_outputs_advice(with_cache.unread_outputs, with_cache.peak_bytes[0])
    assert cache_entry in text and "use_cache=False" in text
    no_cache = estimate_memory(lambda: tiny_gpt2(use_cache=False), gpt2_batch, [4, 4], "2x24GB")
    assert dict(no_cache.unread_outputs) == {"output['logits']": b * SEQ_LEN * VOCAB_SIZE * 4}
    assert no_cache.peak_bytes[0] < with_cache.peak_bytes[0]
    # one card holding samples of two: DataParallel still gathers (a copy onto card 0)
    alone = estimate_memory(lambda: tiny_gpt2(), gpt2_batch, [8, 0], "2x24GB")
    assert dict(alone.unread_outputs) == dict(with_cache.unread_outputs)
    assert unread_outputs_advice(alone.unread_outputs, alone.peak_bytes[0]) is not None
    # one card: nothing is gathered, nothing to advise
    assert estimate_memory(lambda: tiny_gpt2(), gpt2_batch, [8], "1x24GB").unread_outputs is None


@pytest.mark.parametrize("sizes", [(4, 4), (8, 0), (0, 8)])
def test_cuda_backend_names_unread_outputs_whichever_cards_hold_samples(sizes):
    def sample(b):
        return torch.randn(b, 6)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.side = nn.Linear(6, 3), nn.Linear(6, 3)

        def forward(self, x):      # "hidden" feeds nothing the loss reads
            return {"loss": self.lin(x).pow(2).mean(), "hidden": self.side(x)}

    r = _cuda_probe(Workload(Net(), sample, loss_fn=lambda out, batch: out["loss"].sum()), sizes)
    assert r.unread_outputs is not None
    assert dict(r.unread_outputs) == {"output['hidden']": 8 * 3 * 4}


@pytest.mark.slow
def test_gpt2_through_the_cli_with_bf16_and_accumulation(tmp_path, capsys):
    from dptune.cli import main

    out = tmp_path / "rep"
    rc = main(["search", "--model", "dptune.examples.hf:tiny_gpt2", "--sample",
               "dptune.examples.hf:gpt2_batch", "--batch-size", "16", "--simulate", "2x24GB",
               "--amp", "bf16", "--accumulate", "2", "--clip-grad-norm", "1", "--out", str(out),
               "--quiet"])
    assert rc == 0
    data = json.loads((out / "report.json").read_text())
    assert data["settings"] == {"amp": "bf16", "accumulate": 2, "clip_grad_norm": 1.0, "step": None,
                                "gradient_checkpointing": False}
    summary = (out / "summary.md").read_text()
    assert "training step: bf16 autocast, accumulate 2, clip 1" in summary
    assert "use_cache=False" in summary                          # the advice on the cache
    assert (out / "peaks.png").exists()


def test_from_report_warns_when_the_step_differs(tmp_path):
    from dptune.errors import DptuneWarning
    from dptune.result.model import load_result

    res = Tuner(mlp(), sample, batch_size=32, simulate="2x24GB", amp="bf16", accumulate=2,
                verbose=False).fit()
    write_report(res, str(tmp_path))

    def warnings_for(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            load_result(str(tmp_path)).wrap(mlp(), **kw)
        return [str(w.message) for w in caught if "another training step" in str(w.message)]

    assert warnings_for() == []                                  # nothing given, nothing to compare
    assert warnings_for(amp="bf16", accumulate=2, clip_grad_norm=None) == []
    [msg] = warnings_for(amp=None, accumulate=2)
    assert "amp='bf16' in the report, None here" in msg and "accumulate=" not in msg
    [msg] = warnings_for(amp="bf16", accumulate=4, clip_grad_norm=1.0)
    assert "accumulate=2 in the report, 4 here" in msg and "clip_grad_norm=None in the report, 1.0 here" in msg
    with pytest.warns(DptuneWarning, match="another training step"):
        load_result(str(tmp_path)).wrap(mlp(), step=lambda m, b, o: None)
