"""BalancedDataParallel: splitting, pass-through, reduce, warnings, repr.

Everything but the class at the end runs on the CPU. The multi-device path of ``forward`` is
run on the CPU by :class:`CpuBDP`, which pretends to have devices 0..n-1 and replaces only
the CUDA steps (scatter, replicate, parallel_apply, gather) with CPU ones.
"""

from __future__ import annotations

import copy
import warnings
from collections import namedtuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from dptune.errors import UsageError
from dptune.parallel import (
    BalancedDataParallel, find_batch_size, gpu0_split, narrow_scatter, split_inputs,
    weighted_reduce,
)
from dptune.split import even_split
from tiny_models import SmallMLP as MLP  # tests/support

Pair = namedtuple("Pair", "x y")


class CpuBDP(BalancedDataParallel):
    """The multi-device forward on the CPU: every 'replica' is the module, run in turn."""

    def _scatter_tensor(self, tensor, device_ids, chunk_sizes, dim):
        self.scattered.append((list(device_ids), list(chunk_sizes)))
        return narrow_scatter(tensor, device_ids, chunk_sizes, dim)

    def replicate(self, module, device_ids):
        self.replicated_to = list(device_ids)
        if not torch.is_grad_enabled():   # detached copies, as replicate(..., detach=True)
            return [copy.deepcopy(module) for _ in device_ids]
        return [module for _ in device_ids]

    def _reduce_onto(self, grads_per_device, destination):
        self.reduced_from = len(grads_per_device)
        return [sum(gs) for gs in zip(*grads_per_device)]

    def _parallel_apply(self, replicas, inputs, kwargs, device_ids):
        self.ran_on = list(device_ids)
        return [r(*a, **k) for r, a, k in zip(replicas, inputs, kwargs)]

    def gather(self, outputs, output_device):
        self.gathered_to = output_device

        def cat(outs):
            first = outs[0]
            if isinstance(first, torch.Tensor):
                if first.dim() == 0:
                    return torch.stack(list(outs))
                return torch.cat(list(outs), dim=self.dim)
            if isinstance(first, dict):
                return type(first)((k, cat([o[k] for o in outs])) for k in first)
            if isinstance(first, (tuple, list)):
                return type(first)(cat(list(z)) for z in zip(*outs))
            return first

        return cat(outputs)


def make_cpu(module, n, *, output_device=0, **kw):
    """A :class:`CpuBDP` that believes it has devices 0..n-1 (all on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA device" while built on the CPU
        w = CpuBDP(module, **kw)
    w.device_ids = list(range(n))
    w.output_device = output_device
    w.src_device_obj = torch.device("cpu")
    if w.chunk_sizes is not None:
        w.chunk_sizes = w.chunk_sizes  # validate against the n devices
    w.scattered = []
    return w


class LossModel(nn.Module):
    """Returns the mean loss over its chunk (a 0-dim tensor), as HF-style models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 1)

    def forward(self, x, target):
        return ((self.lin(x).squeeze(-1) - target) ** 2).mean()


# ---- argument validation ----------------------------------------------------------------

def test_both_chunk_sizes_and_gpu0_bsz_is_an_error():
    with pytest.raises(UsageError, match="not both"):
        BalancedDataParallel(nn.Linear(2, 2), chunk_sizes=[1, 2], gpu0_bsz=1)


@pytest.mark.parametrize("bad", [[], [1, -1], [0, 0], [1.5, 2], [True, 1]])
def test_bad_chunk_sizes(bad):
    with pytest.raises(UsageError):
        BalancedDataParallel(nn.Linear(2, 2), chunk_sizes=bad)


@pytest.mark.parametrize("bad", [-1, 2.0, True, "4"])
def test_bad_gpu0_bsz(bad):
    with pytest.raises(UsageError, match="gpu0_bsz"):
        BalancedDataParallel(nn.Linear(2, 2), gpu0_bsz=bad)


def test_chunk_sizes_must_match_device_count():
    w = make_cpu(nn.Linear(2, 2), 4)
    with pytest.raises(UsageError, match="3 entries but there are 4 devices"):
        w.chunk_sizes = [1, 2, 3]
    w.chunk_sizes = [1, 2, 3, 0]
    assert w.chunk_sizes == [1, 2, 3, 0]


def test_chunk_sizes_setter_clears_gpu0_bsz_and_property_is_a_copy():
    w = make_cpu(nn.Linear(2, 2), 2, gpu0_bsz=3)
    assert w.chunk_sizes is None and w.gpu0_bsz == 3
    w.chunk_sizes = [1, 5]
    assert w.gpu0_bsz is None
    w.chunk_sizes.append(9)
    assert w.chunk_sizes == [1, 5]


def test_is_a_data_parallel():
    assert isinstance(BalancedDataParallel(nn.Linear(2, 2)), nn.DataParallel)


# ---- gpu0_split ---------------------------------------------------------------------------

@pytest.mark.parametrize("g0, batch, n, expected", [
    (4, 34, 4, [4, 10, 10, 10]),
    (4, 35, 4, [4, 11, 10, 10]),
    (4, 3, 4, [3, 0, 0, 0]),
    (0, 9, 4, [0, 3, 3, 3]),
    (4, 9, 1, [9]),
])
def test_gpu0_split(g0, batch, n, expected):
    assert gpu0_split(g0, batch, n) == expected


@given(st.integers(0, 100), st.integers(0, 1000), st.integers(1, 8))
def test_gpu0_split_properties(g0, batch, n):
    out = gpu0_split(g0, batch, n)
    assert len(out) == n and sum(out) == batch
    if n > 1:
        assert out[0] == min(g0, batch)
        assert max(out[1:]) - min(out[1:]) <= 1


# ---- CPU-only machine: pass-through -------------------------------------------------------

def test_cpu_pass_through_same_output():
    model = MLP()
    w = BalancedDataParallel(model)
    assert w.device_ids == []
    x = torch.randn(5, 4)
    mask = torch.ones(5, 3)
    assert torch.equal(w(x, mask=mask, scale=2.0), model(x, mask=mask, scale=2.0))
    assert w.last_chunk_sizes is None


def test_cpu_pass_through_no_warning_without_split(recwarn):
    BalancedDataParallel(MLP())
    assert not [r for r in recwarn if "BalancedDataParallel" in str(r.message)]


def test_cpu_with_split_warns_that_it_is_not_used():
    with pytest.warns(UserWarning, match=r"no CUDA device.*chunk_sizes=\[6, 10\]"):
        w = BalancedDataParallel(MLP(), chunk_sizes=[6, 10])
    assert w.chunk_sizes == [6, 10]
    x = torch.randn(3, 4)
    assert torch.equal(w(x), w.module(x))


def test_cpu_reduce_of_scalar_is_identity():
    w = BalancedDataParallel(LossModel())
    loss = w(torch.randn(4, 4), torch.randn(4))
    assert w.reduce(loss) is loss


# ---- find_batch_size ---------------------------------------------------------------------

def test_batch_size_first_tensor_args_then_kwargs():
    assert find_batch_size((3, [torch.zeros(7, 2)]), {"a": torch.zeros(5)}) == (7, "args[1][0]")
    assert find_batch_size((), {"a": "x", "b": {"c": torch.zeros(5)}}) == (5, "kwargs['b']['c']")
    assert find_batch_size((1, "a"), {"k": None}) is None
    assert find_batch_size((torch.zeros(2, 9),), {}, dim=1) == (9, "args[0]")


def test_batch_size_of_scalar_tensor_is_an_error():
    with pytest.raises(UsageError, match=r"args\[0\] is a 0-dim tensor"):
        find_batch_size((torch.tensor(1.0),), {})


# ---- split_inputs ---------------------------------------------------------------------

def test_split_kwargs_only():
    x = torch.arange(10).reshape(5, 2)
    parts = split_inputs((), {"x": x, "flag": True}, [2, 3], 0, [0, 1])
    assert parts.args == ((), ())
    assert [k["flag"] for k in parts.kwargs] == [True, True]
    assert torch.equal(torch.cat([k["x"] for k in parts.kwargs]), x)
    assert [k["x"].shape[0] for k in parts.kwargs] == [2, 3]


def test_split_nested_structures_with_same_sizes():
    b = torch.arange(6)
    marker = object()
    args = (b, (b * 2, [b * 3, marker]), {"d": b * 4})
    kwargs = {"pair": Pair(b * 5, "s"), "n": 7}
    parts = split_inputs(args, kwargs, [1, 0, 5], 0, [0, 1, 2])
    assert parts.device_ids == [0, 2] and parts.chunk_sizes == [1, 5]
    for d, (lo, hi) in enumerate([(0, 1), (1, 6)]):
        a, k = parts.args[d], parts.kwargs[d]
        assert torch.equal(a[0], b[lo:hi])
        assert isinstance(a[1], tuple) and torch.equal(a[1][0], b[lo:hi] * 2)
        assert isinstance(a[1][1], list) and torch.equal(a[1][1][0], b[lo:hi] * 3)
        assert a[1][1][1] is marker                          # non-tensors given as they are
        assert torch.equal(a[2]["d"], b[lo:hi] * 4)
        assert isinstance(k["pair"], Pair) and k["pair"].y == "s"
        assert torch.equal(k["pair"].x, b[lo:hi] * 5)
        assert k["n"] == 7


def test_split_along_other_dim():
    x = torch.arange(12).reshape(2, 6)
    parts = split_inputs((x,), {}, [4, 2], 1, [0, 1])
    assert [a[0].shape for a in parts.args] == [(2, 4), (2, 2)]


def test_split_skips_zero_chunk_devices_and_uses_the_scatter_fn():
    calls = []

    def scatter(t, ids, sizes, dim):
        calls.append((list(ids), list(sizes)))
        return narrow_scatter(t, ids, sizes, dim)

    parts = split_inputs((torch.zeros(8, 1),), {"m": torch.zeros(8)}, [0, 3, 0, 5], 0,
                         [4, 5, 6, 7], scatter)
    assert parts.device_ids == [5, 7] and parts.chunk_sizes == [3, 5]
    assert calls == [([5, 7], [3, 5])] * 2


@pytest.mark.parametrize("args, kwargs, where", [
    ((torch.zeros(6, 2),), {"mask": torch.zeros(5, 2)}, r"kwargs\['mask'\] has size 5"),
    ((torch.zeros(6, 2), [torch.zeros(4)]), {}, r"args\[1\]\[0\] has size 4"),
    ((torch.zeros(6), torch.tensor(2.0)), {}, r"args\[1\] has shape \(\)"),
    ((torch.zeros(6), Pair(torch.zeros(6), torch.zeros(2))), {}, r"args\[1\]\.y has size 2"),
])
def test_mismatched_tensor_is_named(args, kwargs, where):
    with pytest.raises(UsageError, match=where):
        split_inputs(args, kwargs, [3, 3], 0, [0, 1])


def test_split_argument_errors():
    with pytest.raises(UsageError, match="2 chunk sizes for 3 devices"):
        split_inputs((torch.zeros(2),), {}, [1, 1], 0, [0, 1, 2])
    with pytest.raises(UsageError, match="no device a sample"):
        split_inputs((torch.zeros(0),), {}, [0, 0], 0, [0, 1])


def test_split_keeps_autograd():
    x = torch.randn(6, 2, requires_grad=True)
    parts = split_inputs((x,), {}, [2, 4], 0, [0, 1])
    sum(a[0].sum() * (i + 1) for i, a in enumerate(parts.args)).backward()
    assert torch.equal(x.grad, torch.tensor([[1.0]] * 2 + [[2.0]] * 4).expand(6, 2))


# ---- the multi-device forward, on the CPU ----------------------------------------------------

def test_uneven_forward_matches_module():
    model = MLP()
    w = make_cpu(model, 4, chunk_sizes=[6, 10, 10, 10])
    x = torch.randn(36, 4)
    mask = torch.rand(36, 3)
    out = w(x, mask=mask, scale=0.5)
    assert torch.allclose(out, model(x, mask=mask, scale=0.5))
    assert w.last_chunk_sizes == [6, 10, 10, 10]
    assert w.ran_on == [0, 1, 2, 3] and w.gathered_to == 0
    assert w.scattered == [([0, 1, 2, 3], [6, 10, 10, 10])] * 2


def test_other_batch_size_is_scaled():
    w = make_cpu(MLP(), 4, chunk_sizes=[6, 10, 10, 10])
    w(torch.randn(18, 4))
    assert w.last_chunk_sizes == [3, 5, 5, 5]
    w(torch.randn(7, 4))
    assert sum(w.last_chunk_sizes) == 7


def test_zero_chunk_devices_are_skipped_and_output_still_gathered():
    model = MLP()
    w = make_cpu(model, 4, chunk_sizes=[0, 5, 0, 3], output_device=0)
    x = torch.randn(8, 4)
    assert torch.allclose(w(x), model(x))
    assert w.ran_on == [1, 3]
    assert w.replicated_to == [0, 1, 3]   # broadcast starts from device_ids[0]
    assert w.gathered_to == 0
    assert w.last_chunk_sizes == [0, 5, 0, 3]


def test_zero_chunk_card0_runs_no_replica_and_receives_the_summed_gradients():
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    w = make_cpu(model, 3, chunk_sizes=[0, 5, 3])
    x = torch.randn(8, 4)
    out = w(x)
    assert w.ran_on == [1, 2] and w.replicated_to == [0, 1, 2]
    out.pow(2).mean().backward()
    assert w.reduced_from == 2            # the two replicas that ran, nothing from card 0
    ref(x).pow(2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, atol=1e-6), name
    # the user's module keeps its parameters (the replicas got the joined views)
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_zero_chunk_card0_without_grad_needs_no_join():
    model = MLP()
    w = make_cpu(model, 2, chunk_sizes=[0, 4])
    x = torch.randn(4, 4)
    with torch.no_grad():
        assert torch.allclose(w(x), model(x))
    assert not hasattr(w, "reduced_from")


def test_reduce_onto_a_card_without_replica_copies_one_bucket_at_a_time(monkeypatch):
    """``_cuda_reduce_onto`` with torch.cuda.comm replaced by a CPU sum that records buckets."""
    from torch.cuda import comm

    from dptune import parallel

    buckets = []

    def fake_reduce(inputs, destination):
        buckets.append(sum(t.nbytes for t in inputs[0]))
        return [sum(ts) for ts in zip(*inputs)]

    monkeypatch.setattr(comm, "reduce_add_coalesced", fake_reduce)
    monkeypatch.setattr(parallel, "BUCKET_BYTES", 4096)
    sizes = [300, 300, 700, 10, 2000]            # fp32 elements
    grads = [[torch.full((n,), float(d + 1)) for n in sizes] for d in range(3)]
    out = parallel._cuda_reduce_onto(grads, "cpu")
    assert [t.tolist() for t in out] == [[6.0] * n for n in sizes]
    assert buckets == [2400, 2840, 8000]         # <= 4096 bytes, or one tensor larger than that
    one = parallel._cuda_reduce_onto(grads[:1], "cpu")   # a single replica: just moved
    assert [t.tolist() for t in one] == [[1.0] * n for n in sizes]


def test_default_is_the_even_split():
    w = make_cpu(MLP(), 4)
    w(torch.randn(10, 4))
    assert w.last_chunk_sizes == even_split(10, 4) == [3, 3, 3, 1]
    w(torch.randn(2, 4))
    assert w.last_chunk_sizes == [1, 1, 0, 0] and w.ran_on == [0, 1]


def test_gpu0_bsz_forward():
    w = make_cpu(MLP(), 4, gpu0_bsz=4)
    w(torch.randn(35, 4))
    assert w.last_chunk_sizes == [4, 11, 10, 10]


def test_kwargs_only_forward():
    model = MLP()
    w = make_cpu(model, 2, chunk_sizes=[1, 3])
    x = torch.randn(4, 4)
    assert torch.allclose(w(x=x), model(x=x))
    assert w.last_chunk_sizes == [1, 3]


def test_forward_without_tensors_runs_once_on_first_device():
    class Const(nn.Module):
        def forward(self, n):
            return torch.full((n,), 2.0)

    w = make_cpu(Const(), 3)
    assert torch.equal(w(4), torch.full((4,), 2.0))
    assert w.ran_on == [0] and w.last_chunk_sizes is None


def test_empty_batch_is_an_error():
    w = make_cpu(MLP(), 2)
    with pytest.raises(UsageError, match="empty batch"):
        w(torch.zeros(0, 4))


def test_one_device_calls_the_module_directly():
    model = MLP()
    w = make_cpu(model, 1)
    x = torch.randn(3, 4)
    assert torch.allclose(w(x), model(x))
    assert not hasattr(w, "ran_on") and w.last_chunk_sizes == [3]


def test_parameters_on_the_wrong_device_say_what_to_do():
    w = make_cpu(MLP(), 2)
    w.src_device_obj = torch.device("cuda", 0)
    with pytest.raises(UsageError, match=r"'net\.0\.weight' is on cpu.*model\.to\('cuda:0'\)"
                                         r".*CUDA_VISIBLE_DEVICES"):
        w(torch.randn(2, 4))


# ---- reduce and the scalar warning ---------------------------------------------------------

def test_weighted_reduce_of_chunk_means_is_batch_mean():
    torch.manual_seed(3)
    per_sample = torch.randn(13, requires_grad=True)
    sizes = [1, 5, 0, 7]
    chunks = per_sample.split([s for s in sizes if s])
    losses = torch.stack([c.mean() for c in chunks])
    red = weighted_reduce(losses, [s for s in sizes if s])
    assert torch.allclose(red, per_sample.mean())
    red.backward()
    assert torch.allclose(per_sample.grad, torch.full((13,), 1 / 13))
    assert not torch.allclose(losses.mean(), per_sample.mean())   # the plain mean is off


def test_weighted_reduce_errors_and_scalars():
    s = torch.tensor(1.5)
    assert weighted_reduce(s, [3]) is s
    with pytest.raises(UsageError, match="3 replicas"):
        weighted_reduce(torch.ones(2), [1, 2, 3])
    with pytest.raises(UsageError, match="tensor"):
        weighted_reduce([1.0, 2.0], [1, 1])


def test_reduce_matches_whole_batch_loss_and_gradients():
    model = LossModel()
    w = make_cpu(model, 3, chunk_sizes=[2, 0, 9])
    x, t = torch.randn(11, 4), torch.randn(11)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = w(x, t)
    assert losses.shape == (2,)
    loss = w.reduce(losses)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x, t)
    ref.backward()
    assert torch.allclose(loss, ref)
    for g, p in zip(grads, model.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)


def test_reduce_needs_a_forward():
    w = make_cpu(LossModel(), 2)
    with pytest.raises(UsageError, match="forward first"):
        w.reduce(torch.ones(2))


def test_scalar_outputs_from_uneven_split_warn_once():
    w = make_cpu(LossModel(), 2, chunk_sizes=[1, 3])
    x, t = torch.randn(4, 4), torch.randn(4)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        w(x, t)
        w(x, t)
    mine = [r for r in rec if "model.reduce" in str(r.message)]
    assert len(mine) == 1
    assert "[1, 3]" in str(mine[0].message)


def test_scalar_in_dict_output_warns_and_even_split_does_not():
    class DictLoss(LossModel):
        def forward(self, x, target):
            return {"loss": super().forward(x, target), "pred": self.lin(x)}

    x, t = torch.randn(4, 4), torch.randn(4)
    for sizes, expected in (([2, 2], 0), ([3, 1], 1)):
        w = make_cpu(DictLoss(), 2, chunk_sizes=sizes)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            out = w(x, t)
        assert len([r for r in rec if "model.reduce" in str(r.message)]) == expected
        assert out["loss"].shape == (2,) and out["pred"].shape == (4, 1)


def test_non_scalar_outputs_do_not_warn():
    w = make_cpu(MLP(), 2, chunk_sizes=[1, 3])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        w(torch.randn(4, 4))
    assert not [r for r in rec if "model.reduce" in str(r.message)]


# ---- repr --------------------------------------------------------------------------------

def test_repr_shows_split_and_devices():
    w = BalancedDataParallel(nn.Linear(2, 2))
    w.device_ids, w.output_device = [0, 1, 2, 3], 0
    w.chunk_sizes = [6, 10, 10, 10]
    text = repr(w)
    assert text.startswith("BalancedDataParallel(\n  chunk_sizes=[6, 10, 10, 10], device_ids=[0, 1, 2, 3]")
    assert "(module): Linear(in_features=2, out_features=2, bias=True)" in text
    assert "gpu0_bsz=4" in repr(make_cpu(nn.Linear(2, 2), 2, gpu0_bsz=4))
    assert "chunk_sizes=even" in repr(make_cpu(nn.Linear(2, 2), 2))
    assert "output_device=1" in repr(make_cpu(nn.Linear(2, 2), 2, output_device=1))
    assert "no CUDA" in repr(BalancedDataParallel(nn.Linear(2, 2)))


# ---- from_report moved to the result ---------------------------------------------------

def test_from_report_says_where_it_moved(tmp_path):
    """Reading a report belongs to the result (load_result(path).wrap(model), tested in
    test_result_wrap.py); the old name answers with the new one instead of reading."""
    with pytest.raises(UsageError, match=r"load_result\('rep'\)\.wrap\(model\)"):
        BalancedDataParallel.from_report(MLP(), "rep")


# ---- real GPUs ----------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestCuda:
    def _model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).cuda(0)

    def _compare(self, sizes, batch, device_ids):
        import copy

        ref = self._model()
        model = copy.deepcopy(ref)
        w = BalancedDataParallel(model, device_ids=device_ids, chunk_sizes=sizes)
        torch.manual_seed(1)
        x = torch.randn(batch, 16, device="cuda:0")
        out = w(x)
        assert out.device == torch.device("cuda", 0)
        out.pow(2).mean().backward()
        r = ref(x)
        r.pow(2).mean().backward()
        assert torch.allclose(out, r, atol=1e-5, rtol=1e-4)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-5, rtol=1e-4)
        return w

    def test_uneven_split_across_all_gpus(self):
        n = torch.cuda.device_count()
        sizes = [1] + [3] * (n - 1) if n > 1 else [5]
        w = self._compare(sizes, sum(sizes), list(range(n)))
        assert w.last_chunk_sizes == sizes
        w2 = self._compare(sizes, 2 * sum(sizes) + 1, list(range(n)))   # a scaled batch
        assert sum(w2.last_chunk_sizes) == 2 * sum(sizes) + 1

    def test_one_gpu_pass_through(self):
        w = self._compare([8], 8, [0])
        assert w.last_chunk_sizes == [8]

    def test_cpu_input_is_moved(self):
        model = self._model()
        w = BalancedDataParallel(model, device_ids=[0])
        x = torch.randn(3, 16)
        assert torch.allclose(w(x), model(x.cuda(0)))

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
    def test_zero_chunk_device(self):
        n = torch.cuda.device_count()
        sizes = [0] + [4] * (n - 1)
        w = self._compare(sizes, sum(sizes), list(range(n)))
        assert w.last_chunk_sizes[0] == 0

    @pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
    def test_reduce_on_gpus(self):
        torch.manual_seed(0)
        model = LossModel().cuda(0)
        w = BalancedDataParallel(model, device_ids=[0, 1], chunk_sizes=[1, 5])
        x, t = torch.randn(6, 4, device="cuda:0"), torch.randn(6, device="cuda:0")
        with pytest.warns(UserWarning, match="model.reduce"):
            losses = w(x, t)
        assert torch.allclose(w.reduce(losses), model(x, t), atol=1e-6)


def test_private_scatter_has_the_signature_scatter_chunks_calls():
    """dptune._torch_private.scatter_chunks calls Scatter.apply(ids, sizes, dim, tensor)."""
    import inspect

    from torch.nn.parallel._functions import Scatter

    params = list(inspect.signature(Scatter.forward).parameters)
    assert params == ["ctx", "target_gpus", "chunk_sizes", "dim", "input"]
