"""Real-GPU probes (``cuda`` marker): skipped on machines without a CUDA GPU.

Run them with ``pytest -m cuda`` on a machine with at least one card (two for the
multi-card tests).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from dptune.backends.cuda import CudaBackend, CudaRuntime
from dptune.step.state import snapshot

from state_check import differences
from dptune.units import GiB, MiB
from dptune.step.workload import Workload

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

two_cards = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                               reason="needs two CUDA GPUs")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                         nn.Linear(2048, 10))


def sample(b: int) -> torch.Tensor:
    return torch.randn(b, 512)


def n_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Hog(nn.Module):
    """Allocates ``per_sample`` bytes per sample of its chunk on its card (no init)."""

    def __init__(self, per_sample: int):
        super().__init__()
        self.per_sample = per_sample
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = torch.empty(x.shape[0] * self.per_sample, dtype=torch.uint8, device=x.device)
        return self.lin(x) + big[:1].float() * 0


def test_devices_match_the_cards():
    b = CudaBackend(Workload(mlp(), sample), [0])
    d = b.devices[0]
    assert d.total_bytes == torch.cuda.get_device_properties(0).total_memory
    assert 0 <= d.used_bytes < d.total_bytes and d.context_bytes >= 0
    assert d.available_bytes > 0
    assert d.uuid is None or d.uuid.startswith(("GPU-", "mig-"))
    b.close()


def test_real_probe_on_one_card_is_sane_and_leaves_no_trace():
    torch.manual_seed(0)
    model = mlp()                                          # on the CPU
    user_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flag = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = True      # the user's setting, before the snapshot
    before = snapshot(model, optimizers=[user_opt], cuda=True)
    py_state = random.getstate()
    wl = Workload(model, sample, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    with CudaBackend(wl, [0], repeats=3) as b:
        r = b.probe([256])
        weights = n_bytes(model)
        # weights + AdamW state (2x) + grads at least; well under a GiB for this model
        assert r.feasible
        assert 3 * weights <= r.peak_bytes[0] < 1 * GiB
        assert r.reserved_bytes[0] >= r.peak_bytes[0]
        assert r.repeat_spread_bytes[0] <= max(1 * MiB, r.peak_bytes[0] // 100)
        assert r.alloc_retries == (0,)
        if r.nvml_used_bytes is not None:
            assert r.nvml_used_bytes[0] >= r.reserved_bytes[0]
        r2 = b.probe([512])
        assert r2.peak_bytes[0] > r.peak_bytes[0]          # more samples, more activations
        assert torch.backends.cudnn.benchmark is True      # restored after each probe
    try:
        assert differences(before) == []
    finally:
        torch.backends.cudnn.benchmark = flag
    assert next(model.parameters()).device.type == "cpu"
    assert random.getstate() == py_state
    torch.backends.cudnn.benchmark = False


def test_model_already_on_card_zero_is_used_in_place():
    model = mlp().cuda(0)
    before = snapshot(model, cuda=True)
    ptr = model[0].weight.data_ptr()
    with CudaBackend(Workload(model, sample), [0]) as b:
        r = b.probe([64])
        assert model[0].weight.data_ptr() == ptr            # not copied
        assert r.feasible and r.peak_bytes[0] >= n_bytes(model)
    assert differences(before) == []


def test_peak_matches_a_hand_measured_step():
    torch.manual_seed(0)
    model = mlp().cuda(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):                                     # warm-up, then measure
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(0)
        model(sample(128).cuda(0)).sum().backward()
        opt.step()
        torch.cuda.synchronize()
    expected = torch.cuda.max_memory_allocated(0)
    del opt
    model.zero_grad(set_to_none=True)
    with CudaBackend(Workload(model, sample, optimizer=lambda p: torch.optim.SGD(
            p, lr=0.1, momentum=0.9)), [0]) as b:
        r = b.probe([128])
    assert abs(r.peak_bytes[0] - expected) <= max(2 * MiB, expected // 50)


def test_huge_batch_gives_an_oom_result_not_an_exception():
    total = torch.cuda.get_device_properties(0).total_memory
    model = Hog(per_sample=1 * GiB)
    wl = Workload(model, lambda b: torch.randn(b, 8))
    allocated_before = torch.cuda.memory_allocated(0)
    with CudaBackend(wl, [0]) as b:
        r = b.probe([total // GiB + 2])
        assert not r.feasible and r.oom_device == 0
        assert "out of memory" in r.note.lower()
        ok = b.probe([1])                                  # recovered: the card is usable
        assert ok.feasible
    assert torch.cuda.memory_allocated(0) <= allocated_before + 64 * MiB


def test_user_error_on_a_real_card():
    from dptune.errors import UserCodeError

    class Bad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x[:, :3])                      # shape mismatch

    with CudaBackend(Workload(Bad(), lambda b: torch.randn(b, 8)), [0]) as b:
        with pytest.raises(UserCodeError, match="during the forward") as info:
            b.probe([4])
        assert isinstance(info.value.__cause__, RuntimeError)


@two_cards
def test_two_cards_uneven_split_and_replica_oom():
    total1 = torch.cuda.get_device_properties(1).total_memory
    with CudaBackend(Workload(mlp(), sample), [0, 1]) as b:
        r = b.probe([192, 64])
        assert r.feasible and r.peak_bytes[0] > r.peak_bytes[1] > 0
        r = b.probe([256, 0])                               # card 1 gets no replica
        assert r.feasible and r.peak_bytes[1] < 256 * MiB
    hog = Hog(per_sample=1 * GiB)
    with CudaBackend(Workload(hog, lambda b: torch.randn(b, 8)), [0, 1]) as b:
        r = b.probe([1, total1 // GiB + 2])
        assert r.oom_device == 1


@two_cards
def test_device_ids_order_maps_oom_to_position():
    total0 = torch.cuda.get_device_properties(0).total_memory
    hog = Hog(per_sample=1 * GiB)
    with CudaBackend(Workload(hog, lambda b: torch.randn(b, 8)), [1, 0]) as b:
        r = b.probe([1, total0 // GiB + 2])                # torch card 0 is position 1
        assert r.oom_device == 1


def test_runtime_uuid_matches_nvml_when_available():
    from dptune.hardware import nvml as _nvml

    rt = CudaRuntime()
    if _nvml.nvml() is None:   # no NVML: allocator-only figures, never a crash
        assert rt.nvml_used(0) is None
    else:
        assert rt.nvml_used(0) is not None and rt.nvml_used(0) > 0
