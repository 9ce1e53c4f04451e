"""DDP's memory per rank: the Reducer's buckets (checked against torch's own bucketing and a
real DDP model on gloo) and the simulated rank (hand counts on a small MLP)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dptune.backends.simulated.ddp_memory import DDPOptions, ParamInfo, bucket_bytes, bucket_layout, params_of
from dptune.backends.simulated import estimate_memory, parse_cluster
from dptune.backends.simulated.ddp import SimulatedDDP, estimate_ddp_memory
from dptune.errors import UsageError
from dptune.step.workload import Workload
from tiny_models import HID, IN, OUT, mlp, sample  # the hand-counted MLP (tests/support)

R = 512


def rnd(n: int) -> int:
    return -(-n // R) * R


# ---- bucketing ------------------------------------------------------------------------------

def deep() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


@pytest.mark.parametrize("limits", [(1 << 20, 25 << 20), (2 << 20, 2 << 20), (100, 100), (1 << 30, 1 << 30)])
def test_layout_matches_torch_bucket_assignment(limits):
    params = list(deep().parameters())[::-1]
    mixed = params + [torch.zeros(300, dtype=torch.float16), torch.zeros(70000, dtype=torch.float16)]
    for tensors in (params, mixed):
        got = bucket_layout([ParamInfo(t.numel(), t.element_size(), str(t.dtype)) for t in tensors],
                            DDPOptions(bucket_cap_mb=limits[1] / 2**20))
        expected, _ = dist._compute_bucket_assignment_by_size(tensors, [limits[0], limits[1]],
                                                              [False] * len(tensors))
        if limits[0] != limits[1]:  # torch's default first bucket comes with bucket_cap_mb=None
            got = bucket_layout([ParamInfo(t.numel(), t.element_size(), str(t.dtype)) for t in tensors])
        assert sorted(sorted(b.params) for b in got) == sorted(sorted(b) for b in expected)


@pytest.mark.parametrize("cap", [None, 2])
def test_layout_matches_real_ddp_after_its_rebuild(cap):
    model = deep()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        for _ in range(3):  # buckets are rebuilt after the first iteration
            ddp.zero_grad()
            ddp(torch.randn(4, 512)).sum().backward()
        data = ddp._get_ddp_logging_data()
        del ddp
    finally:
        dist.destroy_process_group()
    real = [int(x) for x in data["rebuilt_bucket_sizes"].split(",")]
    ours = [b.nbytes for b in bucket_layout(params_of(model), DDPOptions(bucket_cap_mb=cap))]
    assert ours == real
    assert sum(real) == sum(p.numel() * 4 for p in model.parameters())  # one whole copy


def test_options_are_checked():
    with pytest.raises(UsageError, match="bucket_cap_mb"):
        DDPOptions(bucket_cap_mb=0)
    with pytest.raises(UsageError, match="gradient_as_bucket_view"):
        DDPOptions(gradient_as_bucket_view="yes")  # type: ignore[arg-type]
    assert DDPOptions().limits() == (1 << 20, 25 << 20)
    assert DDPOptions(bucket_cap_mb=4).limits() == (4 << 20, 4 << 20)
    assert DDPOptions.from_dict(DDPOptions(3, True).to_dict()) == DDPOptions(3, True)


# ---- the simulated rank, counted by hand ---------------------------------------------------
W1, W2 = IN * HID * 4, HID * OUT * 4          # bytes of each weight (and of its gradient)
W = rnd(W1) + rnd(W2)
# the workspaces a busy card keeps (torch's CublasHandlePool.cpp): a cuBLAS workspace per
# thread's handle (the forward's thread and the autograd engine's), and cuBLASLt's 1 MiB
WS = 2 * parse_cluster("24GB").workspace_bytes(0) + 2**20
SCALAR = R



def x_bytes(b: int) -> int:
    return rnd(b * IN * 4)


def h_bytes(b: int) -> int:
    return rnd(b * HID * 4)


def single_card_peak(b: int) -> int:
    """No optimizer: the backward's layer-1 weight gradient, with weights, both gradients,
    the hidden layer's gradient, the saved input, the loss and its gradient, the workspace,
    and the output (kept alive through the backward, as a plain loop does)."""
    return W + W + h_bytes(b) + x_bytes(b) + 2 * SCALAR + WS + out_bytes(b)


def out_bytes(b: int) -> int:
    return rnd(b * OUT * 4)


def test_single_card_reference_is_the_hand_count():
    assert estimate_memory(mlp(), sample, [64], "1x24GB").peak_bytes == [single_card_peak(64)]


@pytest.mark.parametrize("cap", [None, 0.05])
def test_ddp_rank_is_the_single_card_step_plus_the_bucket_copy(cap):
    # cap None: one bucket of W1+W2 bytes (it reaches the 1 MiB first limit only once layer 1
    # joins); cap 0.05 MiB: layer 2's gradient alone fills the first bucket, layer 1 the second
    buckets = [rnd(W2 + W1)] if cap is None else [rnd(W2), rnd(W1)]
    est = estimate_ddp_memory(mlp(), sample, [64, 16], "2x24GB", bucket_cap_mb=cap)
    assert est.peak_bytes == [single_card_peak(64) + sum(buckets), single_card_peak(16) + sum(buckets)]
    assert est.breakdown[0]["gradients"] == W + sum(buckets)
    assert est.baseline_bytes == [W + sum(buckets)] * 2


def test_gradient_as_bucket_view_removes_the_copy():
    copy = estimate_ddp_memory(mlp(), sample, [64], "24GB").peak_bytes[0]
    view = estimate_ddp_memory(mlp(), sample, [64], "24GB", gradient_as_bucket_view=True).peak_bytes[0]
    bucket = rnd(W1 + W2)
    # the gradients now live only in the bucket: at the peak, layer 2's gradient has been
    # copied there and freed, layer 1's is being made (its copy follows at once)
    assert view == W + bucket + rnd(W1) + h_bytes(64) + x_bytes(64) + 2 * SCALAR + WS + out_bytes(64)
    assert copy - single_card_peak(64) == bucket
    assert copy - view == rnd(W2)   # here layer 1 is almost all of the gradients
    # eight equal layers: the copy (all gradients) gives way to about one layer's gradient
    deep = lambda: nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(8)])  # noqa: E731
    x = lambda b: torch.randn(b, 512)  # noqa: E731
    layer = 512 * 512 * 4
    single = estimate_memory(deep(), x, [4], "1x24GB").peak_bytes[0]
    copy = estimate_ddp_memory(deep(), x, [4], "24GB").peak_bytes[0]
    view = estimate_ddp_memory(deep(), x, [4], "24GB", gradient_as_bucket_view=True).peak_bytes[0]
    assert copy - single == 8 * layer
    assert single < view < single + 2 * layer


def test_adam_peak_at_the_step_with_and_without_views():
    adam = lambda p: torch.optim.Adam(p)  # noqa: E731
    single = estimate_memory(mlp(), sample, [64], "1x24GB", optimizer=adam).peak_bytes[0]
    # weights, gradients, two moments + foreach temporary; the output and the loss still alive
    assert single == W + W + 3 * W + WS + out_bytes(64) + SCALAR
    copy = estimate_ddp_memory(mlp(), sample, [64], "24GB", optimizer=adam).peak_bytes[0]
    assert copy == single + rnd(W1 + W2)
    view = estimate_ddp_memory(mlp(), sample, [64], "24GB", optimizer=adam,
                               gradient_as_bucket_view=True).peak_bytes[0]
    # with views the step holds no second copy; the backward (moments + bucket + layer 1's
    # fresh gradient + activations) is now the peak
    assert view == (W + 2 * W + rnd(W1 + W2) + rnd(W1) + h_bytes(64) + x_bytes(64) + 2 * SCALAR + WS
                    + out_bytes(64))
    assert view < copy


def test_ranks_are_independent_and_probe_names_the_rank_over_budget():
    sim = SimulatedDDP(Workload(mlp(), sample), "24GB,H100-80GB,used=0:23.5GB")
    try:
        est = sim.estimate([8, 8])
        hopper = 2 * parse_cluster("H100").workspace_bytes(0) + 2**20
        assert est.peak_bytes[1] - est.peak_bytes[0] == hopper - WS
        assert sim.estimate([8, 512]).peak_bytes[0] == est.peak_bytes[0]
        res = sim.probe([20000, 8])
        assert res.oom_device == 0 and not res.feasible
        with pytest.raises(UsageError, match="one int >= 1 per rank"):
            sim.estimate([8, 0])
    finally:
        sim.close()


def test_bucket_bytes_counts_tied_weights_once():
    emb = nn.Embedding(100, 16)
    head = nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    assert bucket_bytes(params_of(model)) == rnd(100 * 16 * 4)
