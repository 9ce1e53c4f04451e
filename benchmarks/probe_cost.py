"""What one simulated probe costs: against a plain fake step, and as the cards grow.

For a model (``TinyGPT`` by default, or HF GPT-2 small), this measures in one process:

- ``plain``: one training step (forward, loss, backward, AdamW) of the whole batch under a
  bare ``FakeTensorMode`` on one device, nothing else around it: the floor a simulated probe
  can be compared with;
- ``probe@N``: one probe of ``SimulatedBackend`` on ``N`` identical cards (the whole batch split
  evenly, ``per_card`` samples a card), after a first probe that builds the fake model.

Each figure is the median of ``repeats`` runs, in wall-clock seconds, or with ``--clock cpu``
in CPU seconds of the process (``time.process_time``: steadier on a machine shared with other
work, where the wall clock counts the time the process waits for a core). ``--against PATH``
runs the same measurement in a subprocess with ``PYTHONPATH=PATH`` (another checkout of dptune:
today's code, say) and prints both with their ratios, so that both are measured on the same
machine in the same run.

    python -m benchmarks.probe_cost --model tinygpt --cards 4,64,256 --against /tmp/base
    python -m benchmarks.probe_cost --model gpt2 --repeats 5 --clock cpu --against /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

__all__ = ["measure", "main"]

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}


def _model(name: str) -> tuple[Any, Callable[[int], Any], int]:
    """(model, sample(n), default samples per card)."""
    import torch

    if name == "tinygpt":
        from dptune.examples.models import TinyGPT

        torch.manual_seed(0)
        m = TinyGPT()
        return m, m.sample, 4
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_positions=1024)
        with torch.device("meta"):
            m = GPT2LMHeadModel(cfg)

        def sample(n: int) -> dict:
            ids = torch.randint(0, cfg.vocab_size, (n, 1024))
            return {"input_ids": ids, "labels": ids}
        return m, sample, 4
    raise SystemExit(f"--model {name}: expected tinygpt or gpt2")


def _loss(out: Any, batch: Any) -> Any:
    if isinstance(out, dict) or hasattr(out, "loss"):
        loss = out["loss"] if isinstance(out, dict) else out.loss
        if loss is not None:
            return loss.mean()
    return out.float().sum()


def _plain_step(model: Any, sample: Callable[[int], Any], batch: int, repeats: int,
                clock: Callable[[], float] = time.perf_counter) -> float:
    import torch

    from dptune._torch_private import fake_tensor_mode
    from dptune.backends.simulated.fake_model import _fake_module
    from dptune.step.workload import batch_to_args

    mode = fake_tensor_mode(allow_non_fake_inputs=True)
    times = []
    with mode:
        fake = _fake_module(model)
        fake.train()
        opt = torch.optim.AdamW([p for p in fake.parameters() if p.requires_grad], foreach=True)
        for i in range(repeats + 1):
            t0 = clock()
            args, kwargs = batch_to_args(sample(batch))
            _loss(fake(*args, **kwargs), None).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:
                times.append(clock() - t0)
    return statistics.median(times)


def _probe(model: Any, sample: Callable[[int], Any], cards: int, per_card: int, repeats: int,
           clock: Callable[[], float] = time.perf_counter, **backend_kw: Any) -> float:
    import torch

    from dptune.backends.simulated import SimulatedBackend
    from dptune.step.workload import Workload

    wl = Workload(model, sample, _loss, lambda ps: torch.optim.AdamW(ps, foreach=True))
    backend = SimulatedBackend(wl, f"{cards}x24GB", **backend_kw)
    split = [per_card] * cards
    backend.probe(split)                         # builds the fake model and optimizer state
    times = []
    for _ in range(repeats):
        t0 = clock()
        backend.probe(split)
        times.append(clock() - t0)
    backend.close()
    return statistics.median(times)


def measure(model: str = "tinygpt", cards: tuple[int, ...] = (4,), repeats: int = 3,
            per_card: int = 0, clock: str = "wall") -> dict[str, float]:
    """``{"plain": s, "probe@N": s, ...}``: median seconds on ``clock`` (module docstring)."""
    m, sample, default = _model(model)
    per_card = per_card or default
    tick = CLOCKS[clock]
    out = {"plain": _plain_step(m, sample, per_card * 4, repeats, tick)}
    for n in cards:
        out[f"probe@{n}"] = _probe(m, sample, n, per_card, repeats, tick)
    return out


def _run_elsewhere(path: str, argv: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
    script = os.path.abspath(__file__)
    done = subprocess.run([sys.executable, script, *argv, "--json"], env=env, cwd=path,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tinygpt", choices=("tinygpt", "gpt2"))
    p.add_argument("--cards", default="4", help="comma-separated card counts (default 4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--per-card", type=int, default=0)
    p.add_argument("--clock", default="wall", choices=tuple(CLOCKS),
                   help="wall-clock seconds (default) or CPU seconds of the process")
    p.add_argument("--against", help="another dptune checkout to measure in the same run")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    cards = tuple(int(c) for c in a.cards.split(","))
    own = ["--model", a.model, "--cards", a.cards, "--repeats", str(a.repeats),
           "--per-card", str(a.per_card), "--clock", a.clock]
    other = _run_elsewhere(a.against, own) if a.against else None
    mine = measure(a.model, cards, a.repeats, a.per_card, a.clock)
    if a.json:
        print(json.dumps(mine))
        return
    print(f"{a.model}, {a.per_card or 'default'} samples a card, median of {a.repeats} "
          f"({a.clock} seconds)")
    head = f"{'':>10} {'this':>9} {'/plain':>7}"
    if other:
        head += f" {'against':>9} {'/plain':>7} {'speed-up':>8}"
    print(head)
    for key in mine:
        line = f"{key:>10} {mine[key]:9.3f} {mine[key] / mine['plain']:7.2f}"
        if other:
            line += (f" {other[key]:9.3f} {other[key] / other['plain']:7.2f}"
                     f" {other[key] / mine[key]:8.2f}")
        print(line)
    if len(cards) > 1:
        first = f"probe@{cards[0]}"
        print("per-probe time against the first card count: " + ", ".join(
            f"{k}: {mine[k] / mine[first]:.2f}x" for k in mine if k.startswith("probe@")))


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()
