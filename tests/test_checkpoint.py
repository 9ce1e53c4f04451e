"""Checkpoints load whether the model was wrapped when saved, and whether it is now.

On the CPU, DataParallel is a pass-through container whose state dict has ``module.`` keys,
which is all these tests need.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dptune.checkpoint import load_state_dict, state_dict, unwrap
from dptune.errors import UsageError
from dptune.parallel import BalancedDataParallel


class Net(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)


def wrap(model, kind):
    if kind == "plain":
        return model
    if kind == "dp":
        return nn.DataParallel(model)
    if kind == "bdp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return BalancedDataParallel(model, chunk_sizes=[2, 3])
    if kind == "nested":
        return nn.DataParallel(nn.DataParallel(model))
    raise AssertionError(kind)


def same_weights(a, b):
    sa, sb = unwrap(a).state_dict(), unwrap(b).state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_raw_state_dict_of_wrapped_model_has_prefix():
    assert all(k.startswith("module.") for k in nn.DataParallel(Net()).state_dict())


@pytest.mark.parametrize("kind", ["plain", "dp", "bdp", "nested"])
def test_state_dict_has_no_prefix(kind):
    keys = list(state_dict(wrap(Net(), kind)))
    assert keys == list(Net().state_dict())
    assert not any(k.startswith("module.") for k in keys)


@pytest.mark.parametrize("saved_as", ["plain", "dp", "bdp", "nested"])
@pytest.mark.parametrize("loaded_into", ["plain", "dp", "bdp"])
def test_load_any_into_any(saved_as, loaded_into):
    src = wrap(Net(seed=1), saved_as)
    raw = src.state_dict()            # torch's own: prefixed as the model was wrapped
    dst = wrap(Net(seed=2), loaded_into)
    assert not same_weights(src, dst)
    result = load_state_dict(dst, raw)
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert same_weights(src, dst)


@pytest.mark.parametrize("saved_as", ["plain", "dp"])
@pytest.mark.parametrize("loaded_into", ["plain", "dp"])
def test_load_from_path(tmp_path, saved_as, loaded_into):
    src = wrap(Net(seed=1), saved_as)
    path = tmp_path / "ckpt.pt"
    torch.save(src.state_dict(), path)
    for p in (path, str(path)):
        dst = wrap(Net(seed=2), loaded_into)
        load_state_dict(dst, p)
        assert same_weights(src, dst)


def test_dptune_state_dict_round_trip_through_file(tmp_path):
    src = wrap(Net(seed=1), "dp")
    torch.save(state_dict(src), tmp_path / "a.pt")
    dst = Net(seed=2)
    load_state_dict(dst, tmp_path / "a.pt")
    assert same_weights(src, dst)


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no checkpoint at"):
        load_state_dict(Net(), tmp_path / "nope.pt")


def test_file_that_is_not_a_state_dict(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(UsageError, match="not a state dict"):
        load_state_dict(Net(), tmp_path / "list.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(UsageError, match="cannot read"):
        load_state_dict(Net(), tmp_path / "junk.pt")


def test_strict_false_returns_missing_and_unexpected():
    raw = nn.DataParallel(Net(seed=1)).state_dict()
    del raw["module.lin.bias"]
    raw["module.extra"] = torch.zeros(1)
    result = load_state_dict(Net(), raw, strict=False)
    assert result.missing_keys == ["lin.bias"]
    assert result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError):
        load_state_dict(Net(), raw, strict=True)


def test_child_really_named_module_is_kept():
    class Holder(nn.Module):
        def __init__(self, seed):
            super().__init__()
            self.module = Net(seed)

    src = Holder(1)
    for saved in (src.state_dict(), nn.DataParallel(src).state_dict()):
        dst = Holder(2)
        load_state_dict(dst, saved)
        assert same_weights(src, dst)
        dst = nn.DataParallel(Holder(3))
        load_state_dict(dst, saved)
        assert same_weights(src, dst)


def test_metadata_is_kept_and_caller_dict_untouched():
    raw = nn.DataParallel(Net(seed=1)).state_dict()
    keys = list(raw)
    meta_keys = list(raw._metadata)
    load_state_dict(Net(), raw)
    assert list(raw) == keys and list(raw._metadata) == meta_keys   # not changed in place

    seen = {}

    class Spy(nn.BatchNorm1d):
        def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args):
            seen["version"] = local_metadata.get("version")
            super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)

    dst = Net()
    dst.bn = Spy(4)
    load_state_dict(dst, raw)
    assert seen["version"] == nn.BatchNorm1d._version


def test_bad_state_type():
    with pytest.raises(UsageError, match="state dict or a path"):
        load_state_dict(Net(), 42)


def test_distributed_data_parallel_is_unwrapped(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(Net(seed=1))
        assert list(state_dict(ddp)) == list(Net().state_dict())
        dst = Net(seed=2)
        load_state_dict(dst, ddp.state_dict())
        assert same_weights(ddp, dst)
        load_state_dict(ddp, Net(seed=3).state_dict())
        assert same_weights(ddp, Net(seed=3))
    finally:
        dist.destroy_process_group()
