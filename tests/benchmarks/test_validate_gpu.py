"""benchmarks/validate_gpu.py runs on the CPU as far as it can: it says there is no GPU, and
every row's model and batch can be built (on the meta device) as the GPU run will build them."""

from __future__ import annotations

import torch

from benchmarks import validate_gpu


def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert validate_gpu.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out


def test_rows_cover_the_constructs_and_build():
    cases = validate_gpu._cases()
    labels = [c.label for c in cases]
    for needed in ("GPT2-drop-fp32", "GPT2-drop-bf16", "GPT2-ckpt", "BERT-mask", "MoE-top1",
                   "Llama-GQA-fp32", "Llama-GQA-bf16", "Mixtral-grouped"):
        assert needed in labels
    amps = {c.label: c.step.get("amp") for c in cases}
    assert amps["GPT2-drop-bf16"] == "bf16" and amps["GPT2-drop-fp32"] is None
    for case in cases:
        label, batches, opt_factory = case.label, case.batches, case.optimizer
        with torch.device("meta"):
            model = case.factory()
        batch = case.sample(model, 2)
        first = batch if isinstance(batch, torch.Tensor) else next(
            iter(batch.values()) if isinstance(batch, dict) else iter(batch))
        assert first.shape[0] == 2, label
        assert batches == sorted(batches) and callable(opt_factory)
    ckpt = next(c for c in cases if c.label == "GPT2-ckpt")
    with torch.device("meta"):
        assert ckpt.factory().is_gradient_checkpointing
