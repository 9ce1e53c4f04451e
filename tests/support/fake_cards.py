"""Fake CUDA cards for the training monitor's tests: the runtime protocol the CUDA backend's
tests fake (``tests/backends/cuda/test_cuda_backend.FakeRuntime``), with a memory model that
counts like the caching allocator, under ``torch.cuda.memory_stats``'s own key names.

Per card: ``allocated`` bytes and their peak; ``reserved`` segments rounded up to 2 MiB, kept
after a free (the cache), and their peak; ``num_alloc_retries`` (a request that did not fit the
cache at once: the cache is freed and the request retried) and ``num_ooms`` (a request over the
card's capacity raises a real ``torch.OutOfMemoryError`` naming the card, as CUDA's does).
Other processes hold ``others[d]`` bytes (:meth:`FakeCards.take` adds to them); NVML sees the
whole card: others + the CUDA context + what the allocator reserves.

:func:`train_step` is a transformer-like step's memory: weights and optimizer state held for
the run, activations of ``batch x length`` tokens (linear in both, plus attention scores
quadratic in the length) allocated and freed within the step.
"""

from __future__ import annotations

from typing import Optional

import torch

MiB = 1 << 20
GiB = 1 << 30
CONTEXT = 500 * MiB
SEGMENT = 2 * MiB


def _round(n: int) -> int:
    return -(-n // SEGMENT) * SEGMENT


class FakeCards:
    """n fake cards (see the module docstring); ``resets`` counts peak resets per card."""

    cuda_rng = False

    def __init__(self, n: int = 2, total: int = 24 * GiB, others: Optional[list] = None,
                 nvml: bool = True, device: int = 0):
        self.n, self.total_, self.nvml = n, total, nvml
        self.others = list(others or [0] * n)
        self.allocated = [0] * n
        self.peak = [0] * n
        self.reserved = [0] * n
        self.reserved_peak = [0] * n
        self.retries = [0] * n
        self.ooms = [0] * n
        self.resets = [0] * n
        self.stats_calls = 0
        self.device = device

    # ---- the memory model ---------------------------------------------------------------------
    def capacity(self, d: int) -> int:
        return self.total_ - self.others[d] - CONTEXT

    def alloc(self, d: int, nbytes: int) -> None:
        need = self.allocated[d] + nbytes
        if need > self.capacity(d):
            self.ooms[d] += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / GiB:.2f} GiB. GPU {d} has a "
                f"total capacity of {self.total_ / GiB:.2f} GiB of which "
                f"{(self.capacity(d) - self.reserved[d]) / GiB:.2f} GiB is free.")
        self.allocated[d] = need
        self.peak[d] = max(self.peak[d], need)
        if need > self.reserved[d]:
            self.reserved[d] = _round(need)
            self.reserved_peak[d] = max(self.reserved_peak[d], self.reserved[d])

    def free(self, d: int, nbytes: int) -> None:
        self.allocated[d] -= nbytes

    def take(self, d: int, nbytes: int) -> None:
        """Another process starts using ``nbytes`` of card ``d`` (it can only take what is
        free: not what this process's allocator holds in its cache); negative: it frees them."""
        if nbytes > 0 and self.others[d] + nbytes + CONTEXT + self.reserved[d] > self.total_:
            raise torch.OutOfMemoryError(f"the other process cannot take {nbytes} bytes of card {d}")
        self.others[d] += nbytes

    def fragment(self, d: int) -> None:
        """A request the cache could not serve at once: freed and retried."""
        self.retries[d] += 1

    # ---- the runtime protocol -----------------------------------------------------------------
    def is_available(self) -> bool:
        return self.n > 0

    def device_count(self) -> int:
        return self.n

    def current_device(self) -> int:
        return self.device

    def name(self, d: int) -> str:
        return "Fake 24GB"

    def total(self, d: int) -> int:
        return self.total_

    def uuid(self, d: int) -> str:
        return f"GPU-{d:08d}-0000-0000-0000-000000000000"

    def memory_stats(self, d: int) -> dict:
        self.stats_calls += 1
        return {"allocated_bytes.all.current": self.allocated[d], "allocated_bytes.all.peak": self.peak[d],
                "reserved_bytes.all.current": self.reserved[d], "reserved_bytes.all.peak": self.reserved_peak[d],
                "num_alloc_retries": self.retries[d], "num_ooms": self.ooms[d]}

    def max_memory_allocated(self, d: int) -> int:
        return self.peak[d]

    def reset_peak_memory_stats(self, d: int) -> None:
        self.resets[d] += 1
        self.peak[d] = self.allocated[d]
        self.reserved_peak[d] = self.reserved[d]

    def mem_get_info(self, d: int) -> tuple:
        return self.capacity(d) - self.reserved[d], self.total_

    def nvml_used(self, d: int) -> Optional[int]:
        return self.others[d] + CONTEXT + self.reserved[d] if self.nvml else None


#: the step's memory model: weights + optimizer state, activations per token, attention per
#: token pair
STATE = 2 * GiB
PER_TOKEN = 1 * MiB
PER_PAIR = 2 * 1024


def train_step(cards: FakeCards, d: int, batch: int, length: int, *, setup: bool = False) -> None:
    """One step's memory on card ``d``: the state (once, ``setup``), then the activations."""
    if setup:
        cards.alloc(d, STATE)
    act = batch * length * PER_TOKEN + batch * length * length * PER_PAIR
    cards.alloc(d, act)
    cards.free(d, act)


def probe_peak(batch: int, length: int) -> int:
    """What a planner measures for one step at this shape: the reserved peak of a fresh card
    that holds the state and runs the step once (the plan's ``peak_bytes``)."""
    card = FakeCards(n=1, total=1 << 50)
    train_step(card, 0, batch, length, setup=True)
    return card.reserved_peak[0]
