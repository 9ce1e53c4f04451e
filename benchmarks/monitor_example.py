"""The committed example of a monitored run (fake cards): ``python -m benchmarks.monitor_example
[--out reports/monitor-example]``, then ``dptune show reports/monitor-example``.

Two fake 24 GB cards (the memory model of ``tests/support/fake_cards.py``) train a
transformer-like step under a plan per length bucket (<= 128, 256, 512; a batch of 8 split
4/4, each bucket's peak a probe of the same model). What happens, and what the monitor says:

- steps 1-29: lengths within the plan: no event;
- step 30: a batch padded to 576, past the longest bucket: ``off_plan`` and ``drift`` on both
  cards (it still fits: nothing else is on the cards yet);
- step 41: another process takes all of card 1 but 100 MiB: ``headroom`` (once, when it starts);
- step 55: the allocator retries a ``cudaMalloc`` on card 0: ``fragmentation``;
- step 70: a batch padded to 640: card 1, short of memory since step 41, runs out: ``oom``,
  with the forensics in ``oom.rank0.json``; the script stops there, as a training script would.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil
import sys
import warnings
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def record(out: pathlib.Path) -> Any:
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    import torch
    from fake_cards import GiB, FakeCards, probe_peak, train_step

    from dptune.lengths.plan import BucketPlan, LengthPlan
    from dptune.monitor import MemoryMonitor

    edges = (128, 256, 512)
    budget = 24 * GiB - 500 * (1 << 20) - 256 * (1 << 20)
    plan = LengthPlan(buckets=tuple(BucketPlan(lo=lo, length=n, samples=1000, chunk_sizes=(4, 4),
                                               peak_bytes=(probe_peak(4, n),) * 2, binding_card=0, certified=True)
                                    for lo, n in zip((0,) + edges[:-1], edges)),
                      devices=("Fake 24GB",) * 2, budget_bytes=(budget, budget), cluster="2x24GB (fake)",
                      model_name="fake transformer", headroom_bytes=256 * (1 << 20))
    cards = FakeCards(n=2)
    if out.exists():
        shutil.rmtree(out)
    lengths = [(96, 200, 480, 128, 256)[k % 5] for k in range(69)] + [640]
    lengths[29] = 576
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with MemoryMonitor(plan, runtime=cards, run_dir=out) as mon:
            try:
                for k, n in enumerate(lengths, start=1):
                    if k == 41:
                        # all that is free on the card but 100 MiB (the cache holds step 30's)
                        cards.take(1, cards.capacity(1) - cards.reserved[1] - 100 * (1 << 20))
                    if k == 55:
                        cards.fragment(0)
                    with mon.step(batch_size=8, length=n):
                        for d in (0, 1):
                            train_step(cards, d, 4, n, setup=k == 1)
            except torch.OutOfMemoryError:
                pass                       # the script would stop here; the monitor closes
    return mon


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.monitor_example")
    p.add_argument("--out", default="reports/monitor-example",
                   help="the run's folder (default: reports/monitor-example, from the repository's root)")
    a = p.parse_args(argv)
    out = pathlib.Path(a.out)
    mon = record(out)
    from dptune.monitor import load_run
    from dptune.report.timeline import render_run, write_timeline

    rec = load_run(out)
    write_timeline(rec)
    text = render_run(rec)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    print(text)
    print(f"\n{len(mon.events)} event(s); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
