"""Check the simulated estimate against a real card: ``python benchmarks/validate_gpu.py``.

For several models and batch sizes, one training step on ``cuda:0`` (forward, default loss,
backward, ``optimizer.step()``; steady state: after one warm-up step, gradients set to
``None`` before the step, cuDNN benchmark mode off) is measured three ways:

- ``real``: a plain training loop and ``torch.cuda.max_memory_allocated`` (the ground truth);
- ``probe``: dptune's real-GPU backend (:class:`dptune.backends.cuda.CudaBackend`);
- ``estimate``: :func:`dptune.estimate_memory` on a simulated cluster of one card like this
  one (same total memory and name, so the same cuBLAS workspace).

It prints a table with the relative error of the estimate and of the probe against
``real`` (target: within 5%) and writes ``reports/benchmarks/validate_gpu.csv``. Without a
GPU it says so and exits 0. ``--strict`` exits 1 when an estimate is off by more than 5%.

Besides dptune's example models, the rows cover the constructs where a CUDA card keeps other
tensors than the CPU build (README, "How close the simulator is"): GPT-2-style models with
attention and residual dropout at fp32 and under bf16 autocast (the attention kernel CUDA
picks), a BERT-style encoder with a padding mask, a decoder with activation checkpointing,
and a mixture-of-experts layer whose routing reads tensor values (``nonzero``). The
transformers rows need ``transformers`` installed. The simulated card gets this card's
compute capability.
"""

from __future__ import annotations

import argparse
import csv
import gc
import os
import sys
import time
from typing import Any, Callable

TARGET = 0.05
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CSV_PATH = os.path.join(ROOT, "reports", "benchmarks", "validate_gpu.csv")


def make_moe(vocab: int = 8192, d: int = 1024, experts: int = 8, hidden: int = 4096,
             seq_len: int = 512) -> Any:
    """Embedding, a top-1 mixture-of-experts MLP (routing by ``nonzero``), and a linear head;
    ``forward(ids, labels)`` returns the loss, ``sample(b)`` a batch."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class MoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.router = nn.Linear(d, experts)
            self.experts = nn.ModuleList(
                nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
                for _ in range(experts))
            self.head = nn.Linear(d, vocab)

        def forward(self, ids: Any, labels: Any) -> Any:
            x = self.emb(ids).flatten(0, 1)
            choice = self.router(x).argmax(-1)
            y = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                rows = (choice == i).nonzero().squeeze(-1)          # data-dependent size
                y = y.index_add(0, rows, expert(x.index_select(0, rows)))
            return F.cross_entropy(self.head(x + y), labels.flatten())

        def sample(self, batch: int) -> Any:
            ids = torch.randint(0, vocab, (batch, seq_len))
            return (ids, ids)

    return MoE()


def _hf_cases(adamw: Callable) -> list:
    """The transformers rows: GPT-2 style with dropout (fp32, bf16), checkpointed, BERT style."""
    try:
        import transformers
    except ImportError:
        print("validate_gpu: transformers is not installed; the GPT-2/BERT rows are left out")
        return []
    import torch

    def gpt2(ckpt: bool = False) -> Callable[[], Any]:
        def make() -> Any:
            cfg = transformers.GPT2Config(n_layer=6, n_embd=768, n_head=12, n_positions=1024,
                                          vocab_size=50257)   # dropout 0.1 everywhere
            model = transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")
            if ckpt:
                model.gradient_checkpointing_enable()
            return model
        return make

    def lm_batch(seq: int, vocab: int) -> Callable[[Any, int], Any]:
        def sample(_model: Any, b: int) -> Any:
            ids = torch.randint(0, vocab, (b, seq))
            return {"input_ids": ids, "labels": ids}
        return sample

    def bert() -> Any:
        cfg = transformers.BertConfig(num_hidden_layers=6, hidden_size=768, num_attention_heads=12,
                                      intermediate_size=3072, num_labels=4)
        return transformers.BertForSequenceClassification._from_config(cfg, attn_implementation="sdpa")

    def bert_batch(_model: Any, b: int) -> Any:
        ids = torch.randint(0, 30522, (b, 512))
        mask = torch.ones(b, 512, dtype=torch.long)
        mask[:, 384:] = 0                                   # padding: a real attention mask
        return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 4, (b,))}

    return [
        ("GPT2-drop-fp32", gpt2(), lm_batch(1024, 50257), [2, 4], adamw, None),
        ("GPT2-drop-bf16", gpt2(), lm_batch(1024, 50257), [2, 4], adamw, "bf16"),
        ("GPT2-ckpt", gpt2(ckpt=True), lm_batch(1024, 50257), [4, 8], adamw, None),
        ("BERT-mask", bert, bert_batch, [8, 16], adamw, None),
    ]


def _cases() -> list[tuple[str, Callable[[], Any], Callable[[Any, int], Any], list[int], Callable,
                           Any]]:
    """(label, model factory, sample(model, batch), batch sizes, optimizer factory, amp)."""
    import torch

    try:
        from dptune.examples import models as ex
    except ImportError:  # pragma: no cover - the examples ship with dptune
        ex = None
    if ex is None:
        raise SystemExit("dptune.examples.models is missing")

    def adam(p: Any) -> Any:
        return torch.optim.Adam(p, lr=1e-4)

    def adamw(p: Any) -> Any:
        return torch.optim.AdamW(p, lr=1e-4)

    def sgd(p: Any) -> Any:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    return [
        ("MLP", lambda: ex.MLP(), lambda m, b: m.sample(b), [64, 512], adam, None),
        ("MLP-wide", lambda: ex.MLP(in_features=4096, hidden=8192, depth=3), lambda m, b: m.sample(b),
         [32, 256], sgd, None),
        ("SmallResNet(BN)", lambda: ex.SmallResNet(), lambda m, b: m.sample(b), [16, 64], sgd, None),
        ("TinyGPT", lambda: ex.TinyGPT(), lambda m, b: m.sample(b), [4, 16], adamw, None),
        ("TinyGPT-768", lambda: ex.TinyGPT(d_model=768, n_layers=6, n_heads=12, seq_len=512),
         lambda m, b: m.sample(b), [2, 8], adamw, None),
        ("BertClassifier", lambda: ex.BertClassifier(), lambda m, b: m.sample(b), [16, 64], adamw, None),
        ("SegNet", lambda: ex.SegNet(), lambda m, b: m.sample(b), [4, 16], sgd, None),
        *_hf_cases(adamw),
        ("MoE-top1", make_moe, lambda m, b: m.sample(b), [4, 8], adamw, None),
    ]


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def measure_real(factory: Callable[[], Any], sample: Callable[[int], Any], batch: int,
                 opt_factory: Callable, amp: Any = None) -> int:
    """``max_memory_allocated`` of a steady-state step in a plain training loop on cuda:0."""
    import torch

    from dptune.workload import batch_to_args, default_loss

    def to_card(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.cuda(0)
        if isinstance(obj, dict):
            return {k: to_card(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_card(v) for v in obj)
        return obj

    torch.manual_seed(0)
    model = factory().cuda(0)
    opt = opt_factory(model.parameters())
    scaler = torch.amp.GradScaler("cuda") if amp == "fp16" else None
    peak = 0
    try:
        for _ in range(2):                      # warm-up, then the measured step
            model.zero_grad(set_to_none=True)
            host = sample(batch)
            _free()
            torch.cuda.reset_peak_memory_stats(0)
            batch_dev = to_card(host)
            args, kwargs = batch_to_args(batch_dev)
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "", torch.float32)
            with torch.autocast("cuda", dtype=dtype, enabled=amp is not None):
                out = model(*args, **kwargs)
                loss = default_loss(out, batch_dev)
            del out, args, kwargs
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss, batch_dev
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(0)
    finally:
        del model, opt
        _free()
    return int(peak)


def measure_probe(factory: Callable[[], Any], sample: Callable[[Any, int], Any], batch: int,
                  opt_factory: Callable, amp: Any = None) -> int:
    """dptune's real-GPU probe of the same step."""
    import torch

    from dptune.backends.cuda import CudaBackend
    from dptune.workload import Workload

    torch.manual_seed(0)
    model = factory()
    wl = Workload(model=model, sample=lambda b, m=model: sample(m, b), optimizer=opt_factory, amp=amp)
    with CudaBackend(wl, [0], repeats=2) as backend:
        result = backend.probe([batch])
    del model, wl
    _free()
    if not result.feasible:
        raise RuntimeError(f"probe ran out of memory: {result.note}")
    return int(result.peak_bytes[0])


def estimate(factory: Callable[[], Any], sample: Callable[[Any, int], Any], batch: int,
             opt_factory: Callable, cluster: Any, amp: Any = None) -> int:
    import torch

    from dptune import estimate_memory

    with torch.device("meta"):
        shape_model = factory()             # for sample(); the estimate builds its own model
    est = estimate_memory(factory, lambda b: sample(shape_model, b), [batch], cluster,
                          optimizer=opt_factory, amp=amp)
    return int(est.peak_bytes[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strict", action="store_true",
                        help=f"exit 1 when an estimate is off by more than {TARGET:.0%}")
    parser.add_argument("--csv", default=CSV_PATH, help="where to write the table")
    parser.add_argument("--quick", action="store_true", help="only the first batch size of each model")
    args = parser.parse_args(argv)

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        print("validate_gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "nothing to validate, skipping.")
        return 0
    from dptune.backends.simulated import Cluster
    from dptune.units import format_bytes

    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    cluster = Cluster.uniform(1, int(props.total_memory), name=name,
                              capability=torch.cuda.get_device_capability(0))
    torch.backends.cudnn.benchmark = False
    print(f"validate_gpu: {name}, {format_bytes(props.total_memory)}, torch {torch.__version__}")

    rows = []
    print(f"compute capability {props.major}.{props.minor}; date {time.strftime('%Y-%m-%d')}")
    header = f"{'model':<18}{'batch':>6}{'real':>12}{'probe':>12}{'estimate':>12}{'est err':>9}{'probe err':>10}  ok"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for label, factory, sample, batches, opt_factory, amp in _cases():
        for batch in batches[:1] if args.quick else batches:
            t0 = time.perf_counter()
            try:
                with torch.device("meta"):
                    shape_model = factory()
                real = measure_real(factory, lambda b, m=shape_model, s=sample: s(m, b), batch,
                                    opt_factory, amp)
                probe = measure_probe(factory, sample, batch, opt_factory, amp)
            except torch.OutOfMemoryError:
                _free()
                print(f"{label:<18}{batch:>6}  out of memory on this card, skipped")
                continue
            try:
                est = estimate(factory, sample, batch, opt_factory, cluster, amp)
            except Exception as e:   # a construct the simulator cannot run yet: say which
                print(f"{label:<18}{batch:>6}{format_bytes(real):>12}{format_bytes(probe):>12}"
                      f"  not simulated: {type(e).__name__}: {str(e)[:120]}")
                rows.append({"device": name, "model": label, "batch_size": batch, "real_bytes": real,
                             "probe_bytes": probe, "estimate_bytes": "", "estimate_rel_error": "",
                             "probe_rel_error": round((probe - real) / real, 5),
                             "within_target": False, "seconds": round(time.perf_counter() - t0, 2)})
                continue
            est_err = (est - real) / real
            probe_err = (probe - real) / real
            ok = abs(est_err) <= TARGET
            worst = max(worst, abs(est_err))
            print(f"{label:<18}{batch:>6}{format_bytes(real):>12}{format_bytes(probe):>12}"
                  f"{format_bytes(est):>12}{est_err:>+9.1%}{probe_err:>+10.1%}  {'yes' if ok else 'NO'}")
            rows.append({"device": name, "model": label, "batch_size": batch, "real_bytes": real,
                         "probe_bytes": probe, "estimate_bytes": est,
                         "estimate_rel_error": round(est_err, 5), "probe_rel_error": round(probe_err, 5),
                         "within_target": ok, "seconds": round(time.perf_counter() - t0, 2)})
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["model"])
        writer.writeheader()
        writer.writerows(rows)
    n_ok = sum(r["within_target"] for r in rows)
    print(f"\n{n_ok}/{len(rows)} estimates within {TARGET:.0%} of the real peak "
          f"(worst {worst:.1%}); table written to {os.path.relpath(args.csv)}")
    return 1 if args.strict and n_ok < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
