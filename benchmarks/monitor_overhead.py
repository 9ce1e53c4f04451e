"""The training monitor's cost as a share of step time: ``python -m benchmarks.monitor_overhead
[--cards N] [--steps N] [--every N] [--out DIR]``.

On the CPU test runtime: the cards are fake (the runtime protocol of
:mod:`dptune.monitor.cards`, with the memory model of ``tests/support/fake_cards.py``), whose
``memory_stats`` answers a dict as large as a real card's (every key torch's allocator
reports), and each step is a real training step on the CPU of a small transformer-like MLP
(``--width``, batch ``--batch``). A GPU step is longer than this, so the share measured here
is an upper bound for the same number of cards.

Two figures, medians over ``--repeats`` rounds:

- ``monitor`` : the monitor's own time per step (``observe`` with a length plan, every card
  read, a row written to the run folder), timed alone over the same steps' shapes;
- ``a/b``     : the step time with the monitor minus without, over alternating rounds (noisier:
  it is the difference of two larger figures).

Both are given as a share of the step time without the monitor; the target is < 1 % at the
default interval (``every=1``). With ``--cuda`` (and a CUDA card) the runtime is the real one
and the step runs on card 0.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

__all__ = ["measure", "main", "full_stats"]

_TYPES = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
          "allocation", "segment", "active", "inactive_split")
_POOLS = ("all", "large_pool", "small_pool")
_KINDS = ("current", "peak", "allocated", "freed")
_OTHERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free",
           "max_split_size", "oversize_allocations.current", "oversize_allocations.peak",
           "oversize_segments.current", "oversize_segments.peak")


def full_stats(base: dict) -> dict:
    """A dict with every key a real ``torch.cuda.memory_stats`` has (113), ``base``'s values
    where it has them: what the monitor really gets from a card, in size."""
    out = {f"{t}.{p}.{k}": 0 for t in _TYPES for p in _POOLS for k in _KINDS}
    out.update({k: 0 for k in _OTHERS})
    out.update(base)
    return out


def _fake_runtime(cards: int) -> Any:
    root = pathlib.Path(__file__).resolve().parents[1] / "tests" / "support"
    sys.path.insert(0, str(root))
    from fake_cards import GiB, FakeCards

    class FullStats(FakeCards):
        def memory_stats(self, d: int) -> dict:
            return full_stats(super().memory_stats(d))

    rt = FullStats(n=cards)
    for d in range(cards):
        rt.alloc(d, 2 * GiB)
    return rt


def _plan(cards: int) -> Any:
    from dptune.lengths.plan import BucketPlan, LengthPlan

    gib = 1 << 30
    buckets = tuple(BucketPlan(lo=lo, length=n, samples=10, chunk_sizes=(4,) * cards,
                               peak_bytes=(8 * gib,) * cards, binding_card=0, certified=True)
                    for lo, n in ((0, 128), (128, 256), (256, 512)))
    return LengthPlan(buckets=buckets, devices=("Fake",) * cards, budget_bytes=(20 * gib,) * cards)


def _model_step(width: int, batch: int, device: str) -> Callable[[int], None]:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    xs = {n: torch.randn(batch, n // 16, width, device=device) for n in (128, 256, 512)}

    def step(length: int) -> None:
        model(xs[length]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device != "cpu":
            torch.cuda.synchronize()

    return step


def measure(cards: int = 2, steps: int = 200, every: int = 1, repeats: int = 5, width: int = 256,
            batch: int = 8, cuda: bool = False) -> dict[str, Any]:
    """``{"step_s", "monitor_s", "ab_s", "monitor_share", "ab_share", ...}`` (medians)."""
    import torch

    from dptune.monitor import MemoryMonitor

    device = "cuda:0" if cuda else "cpu"
    rt = None if cuda else _fake_runtime(cards)
    step = _model_step(width, batch, device)
    lengths = [(128, 256, 512)[k % 3] for k in range(steps)]
    torch.set_num_threads(1)
    for n in (128, 256, 512):                       # warm-up
        step(n)
    plain, watched, own = [], [], []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for r in range(repeats):
            mon = MemoryMonitor(None if cuda else _plan(cards), runtime=rt, every=every,
                                run_dir=pathlib.Path(tmp) / f"run{r}", devices=[0] if cuda else None)
            t0 = time.perf_counter()
            for n in lengths:
                step(n)
            plain.append((time.perf_counter() - t0) / steps)
            t0 = time.perf_counter()
            for n in lengths:
                with mon.step(batch_size=batch, length=n):
                    step(n)
            watched.append((time.perf_counter() - t0) / steps)
            t0 = time.perf_counter()
            for n in lengths:                       # the monitor alone, the same shapes
                mon.observe(batch, n)
            own.append((time.perf_counter() - t0) / steps)
            mon.close()
    step_s, monitor_s = statistics.median(plain), statistics.median(own)
    ab_s = statistics.median(w - p for w, p in zip(watched, plain))
    return dict(runtime="cuda" if cuda else "cpu test runtime (fake cards)", cards=1 if cuda else cards,
                every=every, steps=steps, step_s=step_s, monitor_s=monitor_s, ab_s=ab_s,
                monitor_share=monitor_s / step_s, ab_share=ab_s / step_s)


def render(m: dict[str, Any]) -> str:
    return (f"monitor overhead on the {m['runtime']}, {m['cards']} card(s), a reading every {m['every']} "
            f"step(s), {m['steps']} steps:\n"
            f"  step alone            {1e3 * m['step_s']:.3f} ms\n"
            f"  monitor, timed alone  {1e6 * m['monitor_s']:.1f} us  = {100 * m['monitor_share']:.2f} % of the step\n"
            f"  with - without (a/b)  {1e6 * m['ab_s']:.1f} us  = {100 * m['ab_share']:.2f} % of the step\n"
            f"  target: < 1 % -> {'met' if m['monitor_share'] < 0.01 else 'NOT met'}")


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.monitor_overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--cards", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--cuda", action="store_true", help="the real runtime, a step on card 0")
    p.add_argument("--out", help="also write monitor_overhead.md there")
    a = p.parse_args(argv)
    m = measure(a.cards, a.steps, a.every, a.repeats, a.width, a.batch, a.cuda)
    text = render(m)
    print(text)
    if a.out:
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "monitor_overhead.md").write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
