"""Leave no trace (dptune.step.state): snapshot and restore, bit for bit, identity kept."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn

from dptune.step.state import restore, snapshot

from state_check import differences, preserved


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight            # tied
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.register_buffer("scale", torch.tensor(2.0))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        self.register_buffer("absent", None)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        return self.head(self.frozen(self.bn(torch.relu(self.fc(x)))) * self.scale)


def make_model() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    model.fc.eval()                                   # a mixed train/eval tree
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = model(torch.randint(0, 10, (4, 5)))
    out.sum().backward()
    opt.step()                                        # the user's optimizer has state
    model.fc.bias.grad = None                         # some grads None, some set
    return model, opt


def tensors_of(model: nn.Module) -> dict:
    out = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out[n] = (p, p.detach().clone(), None if p.grad is None else p.grad.clone(),
                  p.requires_grad, p.device, p.dtype)
    for n, b in model.named_buffers():
        out["buf:" + n] = (b, b.clone(), None, False, b.device, b.dtype)
    return out


def assert_same(model: nn.Module, before: dict) -> None:
    after = tensors_of(model)
    assert after.keys() == before.keys()
    for k, (obj, val, grad, rg, dev, dt) in before.items():
        obj2, val2, grad2, rg2, dev2, dt2 = after[k]
        assert obj2 is obj, k                      # identity kept
        assert torch.equal(val2, val), k
        assert (dev2, dt2, rg2) == (dev, dt, rg), k
        assert (grad is None) == (grad2 is None), k
        if grad is not None:
            assert torch.equal(grad, grad2), k


def train_wildly(model: Net, opt: torch.optim.Optimizer) -> None:
    """Everything a probe could do, and more."""
    model.train()
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    out = model(torch.randint(0, 10, (6, 5)))
    out.sum().backward()
    opt.step()
    own = torch.optim.SGD(model.parameters(), lr=1.0)
    own.step()
    model.fc.bias.grad = torch.ones_like(model.fc.bias)
    model.emb.weight.grad = None
    model.frozen.weight.requires_grad_(True)
    model.fc.weight = nn.Parameter(torch.zeros(8, 8))       # replaced outright
    model.register_buffer("new", torch.ones(1))             # added
    model.bn.running_mean = torch.full((8,), 7.0)           # buffer object replaced
    model.absent = torch.ones(2)
    opt.param_groups[0]["lr"] = 123.0
    random.random()
    torch.randn(3)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic = not torch.backends.cudnn.deterministic
    torch.backends.cudnn.enabled = not torch.backends.cudnn.enabled


def test_preserved_restores_everything_bit_for_bit():
    model, opt = make_model()
    before = tensors_of(model)
    opt_state = {id(p): {k: v.clone() for k, v in st.items()} for p, st in opt.state.items()}
    modes = [(m, m.training) for m in model.modules()]
    flags = (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
             torch.backends.cudnn.deterministic)
    py_state, torch_state = random.getstate(), torch.get_rng_state()

    with preserved(model, optimizers=[opt]) as snap:
        train_wildly(model, opt)
        assert differences(snap)                    # it did change things

    assert differences(snap) == []
    assert_same(model, before)
    assert "new" not in model._buffers and model.absent is None
    assert [(m, m.training) for m in model.modules()] == modes
    assert opt.param_groups[0]["lr"] == 1e-2
    for p, st in opt.state.items():
        for k, v in st.items():
            assert torch.equal(v, opt_state[id(p)][k])
    assert (torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark,
            torch.backends.cudnn.deterministic) == flags
    assert random.getstate() == py_state
    assert torch.equal(torch.get_rng_state(), torch_state)


def test_users_optimizer_keeps_working_after_restore():
    model, opt = make_model()
    with preserved(model, optimizers=[opt]):
        train_wildly(model, opt)
    w = model.fc.weight.detach().clone()
    model.zero_grad()
    model(torch.randint(0, 10, (4, 5))).sum().backward()
    opt.step()                                       # references the restored params
    assert not torch.equal(w, model.fc.weight)


def test_restores_on_exception():
    model, _ = make_model()
    before = tensors_of(model)
    with pytest.raises(ZeroDivisionError):
        with preserved(model):
            with torch.no_grad():
                model.fc.weight.mul_(3)
            raise ZeroDivisionError
    assert_same(model, before)


def test_device_and_dtype_moves_are_undone_with_identity():
    model, _ = make_model()
    before = tensors_of(model)
    with preserved(model):
        model.to(torch.float64)
        assert model.fc.weight.dtype == torch.float64
        model.to("meta")                             # another device, no memory
        assert model.fc.weight.device.type == "meta"
    assert_same(model, before)


def test_nan_weights_compare_bit_exactly():
    model = nn.Linear(3, 3)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    snap = snapshot(model)
    assert differences(snap) == []
    with torch.no_grad():
        model.weight[1, 1] += 1
    assert differences(snap)
    restore(snap)
    assert differences(snap) == []
    assert torch.isnan(model.weight[0, 0])


def test_numpy_rng_restored():
    np = pytest.importorskip("numpy")
    np.random.seed(1)
    expected = np.random.get_state()[1].copy()
    with preserved():
        np.random.rand(10)
    assert (np.random.get_state()[1] == expected).all()
    a = np.random.rand()
    np.random.seed(1)
    assert a == np.random.rand()


def test_model_none_records_rng_and_flags_only():
    snap = snapshot(None)
    assert snap.params == [] and snap.cudnn is not None and snap.torch_rng is not None
    assert snap.cuda_rng is None                    # cuda=False by default


def test_grad_mode_restored():
    with torch.no_grad():
        with preserved():
            torch.set_grad_enabled(True)
        assert not torch.is_grad_enabled()


def test_restore_attempts_every_part_and_raises_the_first_failure(monkeypatch):
    model, _ = make_model()
    before = tensors_of(model)
    snap = snapshot(model)
    with torch.no_grad():
        model.fc.weight.add_(1)
    torch.backends.cudnn.benchmark = not snap.cudnn["benchmark"]

    def broken(state):
        raise RuntimeError("setstate broke")

    monkeypatch.setattr(random, "setstate", broken)
    with pytest.raises(RuntimeError, match="setstate broke"):
        restore(snap)
    monkeypatch.undo()
    assert_same(model, before)                               # parts before it
    assert torch.backends.cudnn.benchmark == snap.cudnn["benchmark"]   # and after it


def test_consume_hands_the_host_copies_back():
    model, _ = make_model()
    before = tensors_of(model)
    snap = snapshot(model)
    model.to(torch.float64)
    restore(snap, consume=True)
    assert_same(model, before)
    assert model.fc.weight.data_ptr() == snap.params[
        [id(ps.param) for ps in snap.params].index(id(model.fc.weight))].data.value.data_ptr()
