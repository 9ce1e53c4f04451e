"""dptune.step.tree against torch's own scatter and gather, on every container type torch handles."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import torch.nn.parallel.scatter_gather as sg
from dptune.step import tree as _tree
from dptune.errors import UsageError, UserCodeError

Pair = collections.namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass
class Plain:
    x: torch.Tensor


def _cpu_stand_ins(monkeypatch, n):
    """torch's Scatter/Gather are CUDA-only; stand-ins that split/concatenate on the CPU,
    tagging each chunk with its card, so torch's own container logic can run here."""

    class Scatter:
        @staticmethod
        def apply(target_gpus, chunk_sizes, dim, t):
            return tuple(t.chunk(n, dim))

    class Gather:
        @staticmethod
        def apply(target_device, dim, *ts):
            return torch.cat(ts, dim) if ts[0].dim() else torch.stack(ts)

    monkeypatch.setattr(sg, "Scatter", Scatter)
    monkeypatch.setattr(sg, "Gather", Gather)


def _same(a, b):
    """Structural equality: same container types, keys and tensors."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)) or (hasattr(a, "__len__") and not isinstance(a, str)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b or a is b


def _batches():
    t = torch.arange(8.0).reshape(4, 2)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.update(t.view(4, 1, 1, 2), t.view(4, 1, 1, 2), 0)
    cache.update(t.view(4, 1, 1, 2) + 1, t.view(4, 1, 1, 2), 1)
    return {
        "tensor": t,
        "tuple": (t, t + 1),
        "list": [t, [t * 2, "tag"]],
        "dict": {"a": t, "b": (t, 3)},
        "ordered": collections.OrderedDict(a=t, b=t),
        "namedtuple": Pair(t, {"z": t}),
        "model_output": CausalLMOutputWithPast(logits=t, loss=t[:, 0]),
        "model_output_with_cache": CausalLMOutputWithPast(logits=t, past_key_values=cache),
        "empty": ((), [], {}),
        "other": (3, "s", None, Plain(t)),
    }


@pytest.mark.parametrize("name", list(_batches()))
def test_scatter_matches_torch(monkeypatch, name):
    n = 2
    _cpu_stand_ins(monkeypatch, n)
    obj = _batches()[name]
    theirs = sg.scatter(obj, [0, 1], 0)
    ours = _tree.scatter(obj, n, lambda t, path: t.chunk(n, 0))
    assert len(ours) == len(theirs) == n
    for a, b in zip(ours, theirs):
        _same(a, b)


@pytest.mark.parametrize("name", [k for k in _batches() if k not in ("other", "list", "dict")])
def test_gather_matches_torch(monkeypatch, name):
    n = 2
    _cpu_stand_ins(monkeypatch, n)
    obj = _batches()[name]
    outs = [obj, obj]
    theirs = sg.gather(outs, 0, 0)
    ours = _tree.gather(outs, lambda ts, path: torch.cat(ts, 0) if ts[0].dim() else torch.stack(ts))
    _same(ours, theirs)


def test_gather_of_nested_lists_and_dicts_matches_torch(monkeypatch):
    _cpu_stand_ins(monkeypatch, 2)
    t = torch.ones(2, 3)
    outs = [{"a": [t, (t, None)], "b": Pair(t, [t])}] * 2
    _same(_tree.gather(outs, lambda ts, path: torch.cat(ts, 0)), sg.gather(outs, 0, 0))


def test_gather_of_a_string_is_torchs_map_text(monkeypatch):
    """torch returns the text of a map object for a string (sentence-transformers' output
    has one, output['modality']); training goes on, so the simulator's gather does too."""
    _cpu_stand_ins(monkeypatch, 2)
    assert sg.gather(["s", "s"], 0, 0).startswith("<map object")
    assert _tree.gather(["s", "s"], lambda ts, path: torch.cat(ts)).startswith("<map object")


@pytest.mark.parametrize("bad", [Plain(torch.ones(2)), 3])
def test_gather_refuses_what_torch_cannot_gather(monkeypatch, bad):
    _cpu_stand_ins(monkeypatch, 2)
    with pytest.raises(TypeError):
        sg.gather([bad, bad], 0, 0)
    with pytest.raises(UsageError, match=f"output\\[1\\] is a {type(bad).__name__}"):
        _tree.gather([(torch.ones(1), bad)] * 2, lambda ts, path: torch.cat(ts))


def test_tensors_and_map_tensors_walk_every_container_with_paths():
    t = torch.ones(2)
    obj = {"a": [t, (t, Pair(t, Plain(t)))], "b": None}
    paths = [p for p, _ in _tree.tensors(obj)]
    assert paths == ["['a'][0]", "['a'][1][0]", "['a'][1][1].x", "['a'][1][1].y.x"]
    doubled = _tree.map_tensors(lambda x: x * 2, obj)
    assert isinstance(doubled["a"][1][1], Pair) and isinstance(doubled["a"][1][1].y, Plain)
    assert all(torch.equal(x, t * 2) for _, x in _tree.tensors(doubled))
    assert doubled["b"] is None


def test_simulator_splits_a_namedtuple_batch_as_the_wrapper_does():
    from dptune.backends.simulated import estimate_memory
    from dptune.parallel import split_inputs

    seen = []

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, pair):
            seen.append((type(pair).__name__, tuple(pair.x.shape), tuple(pair.y.shape)))
            return self.lin(pair.x + pair.y)

    sample = lambda b: (Pair(torch.randn(b, 8), torch.randn(b, 8)),)  # noqa: E731
    estimate_memory(Net(), sample, [3, 5], "2x24GB")
    real = split_inputs(sample(8), {}, [3, 5], 0, [0, 1])
    assert seen == [(type(a[0]).__name__, tuple(a[0].x.shape), tuple(a[0].y.shape)) for a in real.args]
    assert seen == [("Pair", (3, 8), (3, 8)), ("Pair", (5, 8), (5, 8))]


def test_a_sliding_window_cache_fails_to_gather_in_torch_and_says_so_here(monkeypatch):
    """A Mistral-style DynamicCache carries each layer's sliding window as a 0-dim tensor;
    gather stacks the replicas' into a vector, and DynamicCache(...) then calls .item() on
    it. torch's own gather fails the same way, so the message names the output and the fix."""
    from transformers import MistralConfig
    from transformers.cache_utils import DynamicCache

    _cpu_stand_ins(monkeypatch, 2)
    cfg = MistralConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2,
                        num_key_value_heads=1, sliding_window=4)
    cache = DynamicCache(config=cfg)
    t = torch.ones(2, 1, 3, 4)
    cache.update(t, t, 0)
    outs = [{"logits": torch.ones(2, 3), "past_key_values": cache}] * 2
    with pytest.raises(RuntimeError, match="cannot be converted to Scalar"):
        sg.gather(outs, 0, 0)
    with pytest.raises(UserCodeError, match=r"output\['past_key_values'\] is a DynamicCache.*"
                                            r"fails the same way.*use_cache=False"):
        _tree.gather(outs, lambda ts, path: torch.cat(ts, 0) if ts[0].dim() else torch.stack(ts))
