"""Check the simulated estimate against a real card: ``python benchmarks/validate_gpu.py``.

For several models, training steps and batch sizes, one training step on ``cuda:0`` (forward
and default loss, kept alive through the backward as a plain loop keeps them, backward,
``optimizer.step()``; steady state: after one warm-up step, gradients set to ``None`` before
the step, cuDNN benchmark mode off) is measured three ways. The steps: fp32; bf16 autocast
(``amp="bf16"``); two micro-batches of gradient accumulation; and a GPT-2-style Hugging Face
model (``dptune.examples.hf``, built from its config) that returns its cache
(``past_key_values``), in fp32 and in bf16 with accumulation.

- ``real``: a plain training loop written out here, with ``torch.autocast`` and accumulation
  as the step says, and ``torch.cuda.max_memory_allocated`` (the ground truth);
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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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


def _hf_cases(adamw: Callable) -> list["Case"]:
    """The transformers rows: Llama style (grouped-query attention, fp32 and bf16), a Mixtral-style
    MoE (grouped expert layers, bf16 autocast over fp32 weights), GPT-2 style with dropout (fp32,
    bf16), checkpointed, BERT style."""
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

    def llama() -> Any:      # grouped-query attention: fp32 runs the math path on CUDA
        cfg = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=1024, intermediate_size=2816,
                                       num_attention_heads=16, num_key_value_heads=4,
                                       vocab_size=32000, max_position_embeddings=1024)
        return transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")

    def mixtral() -> Any:    # transformers' grouped expert layers (torch._grouped_mm)
        cfg = transformers.MixtralConfig(num_hidden_layers=2, hidden_size=1024, intermediate_size=2048,
                                         num_attention_heads=16, num_key_value_heads=4,
                                         num_local_experts=8, num_experts_per_tok=2,
                                         vocab_size=32000, max_position_embeddings=1024)
        return transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="sdpa")

    return [
        Case("Llama-GQA-fp32", llama, lm_batch(512, 32000), [2, 4], adamw),
        Case("Llama-GQA-bf16", llama, lm_batch(512, 32000), [2, 4], adamw, {"amp": "bf16"}),
        Case("Mixtral-grouped", mixtral, lm_batch(512, 32000), [2, 4], adamw, {"amp": "bf16"}),
        Case("GPT2-drop-fp32", gpt2(), lm_batch(1024, 50257), [2, 4], adamw),
        Case("GPT2-drop-bf16", gpt2(), lm_batch(1024, 50257), [2, 4], adamw, {"amp": "bf16"}),
        Case("GPT2-ckpt", gpt2(ckpt=True), lm_batch(1024, 50257), [4, 8], adamw),
        Case("BERT-mask", bert, bert_batch, [8, 16], adamw),
    ]


@dataclass(frozen=True)
class Case:
    label: str
    factory: Callable[[], Any]
    sample: Callable[[Any, int], Any]        # (model, batch size) -> batch
    batches: list[int]
    optimizer: Callable[[Any], Any]
    step: dict = field(default_factory=dict)  # Workload step settings: amp=, accumulate=

    @property
    def step_label(self) -> str:
        from dptune.step.workload import StepSettings

        return StepSettings(**self.step).describe()


def _cases() -> list[Case]:
    import torch

    try:
        from dptune.examples import hf
        from dptune.examples import models as ex
    except ImportError:  # pragma: no cover - the examples ship with dptune
        raise SystemExit("dptune.examples is missing") from None

    def adam(p: Any) -> Any:
        return torch.optim.Adam(p, lr=1e-4)

    def adamw(p: Any) -> Any:
        return torch.optim.AdamW(p, lr=1e-4)

    def sgd(p: Any) -> Any:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    def own(m: Any, b: int) -> Any:
        return m.sample(b)

    def gpt2_tokens(m: Any, b: int) -> Any:
        return hf.gpt2_batch(b, seq_len=512, vocab_size=m.config.vocab_size)

    def gpt2_mid() -> Any:
        return hf.tiny_gpt2(n_layer=6, n_embd=512, n_head=8, vocab_size=32000, n_positions=512)

    bf16 = {"amp": "bf16"}
    acc2 = {"accumulate": 2}
    return [
        Case("MLP", lambda: ex.MLP(), own, [64, 512], adam),
        Case("MLP-wide", lambda: ex.MLP(in_features=4096, hidden=8192, depth=3), own, [32, 256], sgd),
        Case("MLP-wide", lambda: ex.MLP(in_features=4096, hidden=8192, depth=3), own, [256], sgd, bf16),
        Case("SmallResNet(BN)", lambda: ex.SmallResNet(), own, [16, 64], sgd),
        Case("SmallResNet(BN)", lambda: ex.SmallResNet(), own, [64], sgd, bf16),
        Case("TinyGPT", lambda: ex.TinyGPT(), own, [4, 16], adamw),
        Case("TinyGPT-768", lambda: ex.TinyGPT(d_model=768, n_layers=6, n_heads=12, seq_len=512),
             own, [2, 8], adamw),
        Case("TinyGPT-768", lambda: ex.TinyGPT(d_model=768, n_layers=6, n_heads=12, seq_len=512),
             own, [8], adamw, bf16),
        Case("TinyGPT-768", lambda: ex.TinyGPT(d_model=768, n_layers=6, n_heads=12, seq_len=512),
             own, [8], adamw, acc2),
        Case("BertClassifier", lambda: ex.BertClassifier(), own, [16, 64], adamw),
        Case("SegNet", lambda: ex.SegNet(), own, [4, 16], sgd),
        Case("HF-GPT2+cache", gpt2_mid, gpt2_tokens, [4, 16], adamw),
        Case("HF-GPT2+cache", gpt2_mid, gpt2_tokens, [16], adamw, {"amp": "bf16", "accumulate": 2}),
        *_hf_cases(adamw),
        Case("MoE-top1", make_moe, own, [4, 8], adamw),
    ]


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def plain_step(model: Any, opt: Any, host_batches: list, amp: Optional[str], device: Any) -> None:
    """The training step as a user writes it: per micro-batch, the batch moved to the card,
    forward and loss under ``torch.autocast`` when ``amp`` is set, the loss divided by the
    number of micro-batches, backward; the output stays alive until the next forward has
    returned and through ``optimizer.step()`` (a plain loop's variables)."""
    import contextlib

    import torch

    from dptune.step.workload import batch_to_args, default_loss

    def to_card(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj.to(device)
        if isinstance(obj, dict):
            return {k: to_card(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_card(v) for v in obj)
        return obj

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp or "")
    n = len(host_batches)
    out = loss = None
    for host in host_batches:
        batch_dev = to_card(host)
        args, kwargs = batch_to_args(batch_dev)
        cast = (torch.autocast(torch.device(device).type, dtype=dtype) if dtype is not None
                else contextlib.nullcontext())
        with cast:
            out = model(*args, **kwargs)
            loss = default_loss(out, batch_dev)
        if n > 1:
            loss = loss / n
        del args, kwargs, batch_dev
        loss.backward()
    opt.step()
    del out, loss


def measure_real(case: Case, batch: int) -> int:
    """``max_memory_allocated`` of a steady-state step in a plain training loop on cuda:0."""
    import torch

    torch.manual_seed(0)
    model = case.factory().cuda(0)
    opt = case.optimizer(model.parameters())
    accumulate = int(case.step.get("accumulate", 1))
    peak = 0
    try:
        for _ in range(2):                      # warm-up, then the measured step
            model.zero_grad(set_to_none=True)
            hosts = [case.sample(model, batch) for _ in range(accumulate)]
            _free()
            torch.cuda.reset_peak_memory_stats(0)
            plain_step(model, opt, hosts, case.step.get("amp"), "cuda:0")
            del hosts
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(0)
    finally:
        del model, opt
        _free()
    return int(peak)


def measure_probe(case: Case, batch: int) -> int:
    """dptune's real-GPU probe of the same step."""
    import torch

    from dptune.backends.cuda import CudaBackend
    from dptune.step.workload import Workload

    torch.manual_seed(0)
    model = case.factory()
    wl = Workload(model=model, sample=lambda b, m=model: case.sample(m, b), optimizer=case.optimizer,
                  **case.step)
    with CudaBackend(wl, [0], repeats=2) as backend:
        result = backend.probe([batch])
    del model, wl
    _free()
    if not result.feasible:
        raise RuntimeError(f"probe ran out of memory: {result.note}")
    return int(result.peak_bytes[0])


def estimate(case: Case, batch: int, cluster: Any) -> int:
    import torch

    from dptune import estimate_memory

    with torch.device("meta"):
        shape_model = case.factory()        # for sample(); the estimate builds its own model
    est = estimate_memory(case.factory, lambda b: case.sample(shape_model, b), [batch], cluster,
                          optimizer=case.optimizer, **case.step)
    return int(est.peak_bytes[0])


def estimate_levels(case: Any, batch: int, cluster: Any) -> dict[str, int]:
    """The simulator's three levels (allocated, reserved, total use) for the same step (the allocator model on)."""
    import torch

    from dptune.backends.simulated.allocator import AllocatorConfig
    from dptune.budget import FixedCosts
    from dptune.backends.simulated.reserved import ReservedModel
    from dptune.backends.simulated import SimulatedBackend
    from dptune.step.workload import Workload

    with torch.device("meta"):
        shape_model = case.factory()
    wl = Workload(model=case.factory, sample=lambda b: case.sample(shape_model, b),
                  optimizer=case.optimizer, **case.step)
    model = ReservedModel(AllocatorConfig.from_env(), FixedCosts(nccl_bytes=0))
    backend = SimulatedBackend(wl, cluster, reserved=model)
    try:
        r = backend.probe([batch])
    finally:
        backend.close()
    assert r.reserved_bytes is not None and r.total_bytes is not None and r.alloc_retries is not None
    return {"allocated": int(r.peak_bytes[0]), "reserved": int(r.reserved_bytes[0]),
            "total": int(r.total_bytes[0]), "retries": int(r.alloc_retries[0])}


def _estimate_in_worker(index: int, batch: int, cluster_kw: dict, level: str) -> Any:
    """One estimate in a worker process (the cases hold lambdas: the worker rebuilds them)."""
    from dptune.backends.simulated import Cluster

    case = _cases()[index]
    cluster = Cluster.uniform(1, **cluster_kw)
    try:
        if level == "allocated":
            return estimate(case, batch, cluster)
        return estimate_levels(case, batch, cluster)
    except Exception as e:   # a construct the simulator cannot run: the row says which
        return RuntimeError(f"{type(e).__name__}: {str(e)[:120]}")


class RowWriter:
    """A CSV written row by row (flushed), so that a run stopped at its time limit keeps
    the rows it measured."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path, self._f, self._w = path, open(path, "w", newline=""), None

    def add(self, row: dict) -> None:
        if self._w is None:
            self._w = csv.DictWriter(self._f, fieldnames=list(row))
            self._w.writeheader()
        self._w.writerow(row)
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Estimates:
    """The simulator's estimates of every row, computed in ``jobs`` processes on the host's
    cores while the card measures (the estimates are CPU work and took most of a run)."""

    def __init__(self, rows: list[tuple[int, int]], cluster_kw: dict, level: str, jobs: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self._pool = ProcessPoolExecutor(max_workers=max(1, jobs),
                                         mp_context=multiprocessing.get_context("spawn"))
        self._futures = {key: self._pool.submit(_estimate_in_worker, *key, cluster_kw, level)
                         for key in rows}

    def get(self, index: int, batch: int) -> Any:
        """The estimate, or raises the worker's error as a RuntimeError."""
        out = self._futures[(index, batch)].result()
        if isinstance(out, Exception):
            raise out
        return out

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def selected_rows(cases: list[Case], quick: bool, only: Optional[list[str]]) -> list[tuple[int, int]]:
    """(case index, batch) of the rows a run measures."""
    return [(i, b) for i, case in enumerate(cases) if not only or case.label in only
            for b in (case.batches[:1] if quick else case.batches)]


def _row(case: Case, index: int, batch: int, estimates: Estimates, name: str,
         cluster_kw: dict) -> Optional[dict]:
    """Measure one row on the card, take its estimate, print it; None when the card is too small."""
    import torch

    from dptune.units import format_bytes

    t0 = time.perf_counter()
    label, step = case.label, case.step_label
    try:
        real = measure_real(case, batch)
        probe = measure_probe(case, batch)
    except torch.OutOfMemoryError:
        _free()
        print(f"{label:<16}{step:<24}{batch:>6}  out of memory on this card, skipped")
        return None
    row: dict[str, Any] = {"device": name, "card_total_bytes": cluster_kw["total_bytes"],
                           "capability": ".".join(map(str, cluster_kw["capability"])),
                           "model": label, "step": step, "batch_size": batch, "real_bytes": real,
                           "probe_bytes": probe, "probe_rel_error": round((probe - real) / real, 5)}
    try:
        est = estimates.get(index, batch)
    except RuntimeError as e:   # a construct the simulator cannot run yet: say which
        print(f"{label:<16}{step:<24}{batch:>6}{format_bytes(real):>12}{format_bytes(probe):>12}"
              f"  not simulated: {e}")
        return {**row, "estimate_bytes": "", "estimate_rel_error": None, "within_target": False,
                "seconds": round(time.perf_counter() - t0, 2)}
    est_err = (est - real) / real
    ok = abs(est_err) <= TARGET
    print(f"{label:<16}{step:<24}{batch:>6}{format_bytes(real):>12}{format_bytes(probe):>12}"
          f"{format_bytes(est):>12}{est_err:>+9.1%}{row['probe_rel_error']:>+10.1%}  {'yes' if ok else 'NO'}",
          flush=True)
    return {**row, "estimate_bytes": est, "estimate_rel_error": round(est_err, 5), "within_target": ok,
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--strict", action="store_true",
                        help=f"exit 1 when an estimate is off by more than {TARGET:.0%}")
    parser.add_argument("--csv", default=CSV_PATH, help="where to write the table")
    parser.add_argument("--quick", action="store_true", help="only the first batch size of each model")
    parser.add_argument("--only", action="append", metavar="MODEL",
                        help="only the rows of this model (repeatable)")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                        help="processes that compute the estimates while the card measures")
    args = parser.parse_args(argv)

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    import torch

    if not torch.cuda.is_available():
        print("validate_gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "nothing to validate, skipping.")
        return 0
    from dptune.units import format_bytes

    props = torch.cuda.get_device_properties(0)
    name = torch.cuda.get_device_name(0)
    torch.backends.cudnn.benchmark = False
    print(f"validate_gpu: {name}, {format_bytes(props.total_memory)}, torch {torch.__version__}")

    rows = []
    print(f"compute capability {props.major}.{props.minor}; date {time.strftime('%Y-%m-%d')}")
    header = (f"{'model':<16}{'step':<24}{'batch':>6}{'real':>12}{'probe':>12}{'estimate':>12}"
              f"{'est err':>9}{'probe err':>10}  ok")
    print(header)
    print("-" * len(header))
    worst = 0.0
    cases = _cases()
    wanted = selected_rows(cases, args.quick, args.only)
    cluster_kw = {"total_bytes": int(props.total_memory), "name": name,
                  "capability": tuple(torch.cuda.get_device_capability(0))}
    estimates = Estimates(wanted, cluster_kw, "allocated", args.jobs)
    out = RowWriter(args.csv)
    try:
        for index, batch in wanted:
            row = _row(cases[index], index, batch, estimates, name, cluster_kw)
            if row is not None:
                rows.append(row)
                out.add(row)
                worst = max(worst, abs(row["estimate_rel_error"] or 0.0))
    finally:
        estimates.close()
        out.close()
    n_ok = sum(r["within_target"] for r in rows)
    print(f"\n{n_ok}/{len(rows)} estimates within {TARGET:.0%} of the real peak "
          f"(worst {worst:.1%}); table written to {os.path.relpath(args.csv)}")
    return 1 if args.strict and n_ok < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
