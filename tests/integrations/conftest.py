"""Fixtures of the integration tests."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

from dptune.parallel import BalancedDataParallel, find_batch_size, narrow_scatter


def _cpu_gather(outputs, dim=0):
    """torch's gather on the CPU: 0-dim tensors become a vector, others are concatenated,
    containers are rebuilt with their own type."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(outputs))
        return torch.cat(list(outputs), dim=dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, _cpu_gather([o[k] for o in outputs], dim)) for k in first)
    return type(first)(map(lambda xs: _cpu_gather(list(xs), dim), zip(*outputs)))


@pytest.fixture
def fake_gpus(monkeypatch):
    """4 'GPUs' for DataParallel and BalancedDataParallel, all of them this CPU."""
    dp_module = importlib.import_module("torch.nn.parallel.data_parallel")
    monkeypatch.setattr(dp_module, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(dp_module, "_get_all_device_indices", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(dp_module, "_check_balance", lambda ids: None)
    runs: list = []

    def parallel_apply(self, replicas, inputs, kwargs, device_ids):
        runs.append([find_batch_size(a, k)[0] for a, k in zip(inputs, kwargs)])
        return [r(*a, **k) for r, a, k in zip(replicas, inputs, kwargs)]

    B = BalancedDataParallel
    monkeypatch.setattr(B, "_check_module_device", lambda self: None)
    monkeypatch.setattr(B, "_scatter_tensor", lambda self, t, ids, sizes, dim:
                        narrow_scatter(t, ids, sizes, dim))
    def replicate(self, module, ids):
        # with autograd on, replicate's copies are differentiable views of the weights: the
        # module itself stands for them; with it off (card 0 gets no samples), detached copies
        if torch.is_grad_enabled():
            return [module] * len(ids)
        return [copy.deepcopy(module) for _ in ids]

    monkeypatch.setattr(B, "replicate", replicate)
    monkeypatch.setattr(B, "_reduce_onto", lambda self, per_device, destination:
                        [sum(gs) for gs in zip(*per_device)])
    monkeypatch.setattr(B, "_parallel_apply", parallel_apply)
    monkeypatch.setattr(B, "gather", lambda self, outputs, device: _cpu_gather(outputs, self.dim))
    return runs
