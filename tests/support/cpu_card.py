"""A rank's one "CUDA card" that is a CPU device, for the gloo jobs of the tests: what every
such fake runtime answers alike (one card, named ``Card``, ``total_`` bytes, all free; no
retries, no NVML, nothing to empty or wait for). The memory model (``memory_allocated``, ``max_memory_allocated``, ...) is each subclass's own."""

from __future__ import annotations

import torch


class OneCpuCard:
    cuda_rng = False
    total_: int

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def torch_device(self, d: int) -> torch.device:
        return torch.device("cpu")

    def name(self, d: int) -> str:
        return "Card"

    def total(self, d: int) -> int:
        return self.total_

    def uuid(self, d: int) -> str:
        return f"GPU-{d:08d}-0000-0000-0000-000000000000"

    def mem_get_info(self, d: int) -> tuple[int, int]:
        return self.total_, self.total_

    def memory_stats(self, d: int) -> dict:
        return {"num_alloc_retries": 0}

    def empty_cache(self) -> None: ...

    def synchronize(self, d: int) -> None: ...

    def gc_collect(self) -> None: ...

    def nvml_used(self, d: int) -> None:
        return None

    nvml_process_used = nvml_used
