"""Per-step cost of ``BalancedDataParallel`` against ``torch.nn.DataParallel`` on real GPUs.

Both wrap the same model on all visible GPUs and train the same batch with the even split
(so only the wrapper differs); the figure is the median step time over ``steps`` steps after
a warm-up, for ``repeats`` alternating rounds. Without a CUDA GPU nothing is measured and the
result says so.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["measure", "SKIP_MESSAGE"]

SKIP_MESSAGE = "no CUDA GPU: skipping the per-step overhead of BalancedDataParallel"


def measure(steps: int = 20, repeats: int = 3, per_card: int = 64) -> dict[str, Any]:
    """``{"skipped": bool, "text": str, ...}`` with median step times in seconds when run."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return {"skipped": True, "text": SKIP_MESSAGE + "."}
    from dptune.examples.models import MLP
    from dptune.parallel import BalancedDataParallel
    from dptune.split import even_split

    n = torch.cuda.device_count()
    ids = list(range(n))
    net = MLP().cuda(0)
    x = torch.randn(per_card * n, net.in_features, device="cuda:0")
    wrappers = {
        "DataParallel": torch.nn.DataParallel(net, device_ids=ids),
        "BalancedDataParallel": BalancedDataParallel(net, device_ids=ids,
                                                     chunk_sizes=even_split(per_card * n, n)),
    }
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step(wrapped: torch.nn.Module) -> None:
        opt.zero_grad(set_to_none=True)
        wrapped(x).sum().backward()
        opt.step()

    times: dict[str, list[float]] = {k: [] for k in wrappers}
    for w in wrappers.values():       # warm-up: cuBLAS workspaces, optimizer state
        for _ in range(3):
            step(w)
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, w in wrappers.items():
            for _ in range(steps):
                t0 = time.perf_counter()
                step(w)
                for d in ids:
                    torch.cuda.synchronize(d)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["BalancedDataParallel"] / med["DataParallel"]
    gpus = f"{n}x {torch.cuda.get_device_name(0)}"
    return {"skipped": False, "gpus": gpus, "seconds": med, "ratio": ratio,
            "text": (f"{gpus}, MLP, batch {per_card * n}, even split: median step "
                     f"DataParallel {med['DataParallel'] * 1e3:.2f} ms, BalancedDataParallel "
                     f"{med['BalancedDataParallel'] * 1e3:.2f} ms ({ratio:.3f}x), "
                     f"{repeats}x{steps} steps each.")}
