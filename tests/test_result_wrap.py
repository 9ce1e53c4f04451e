"""Reusing a saved split: ``load_result(path).wrap(model)`` (was
``BalancedDataParallel.from_report``): the result reads the report, the wrapper only wraps."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import dptune
from dptune.backends.base import Device, ProbeResult
from dptune.errors import UsageError
from dptune.parallel import BalancedDataParallel
from dptune.result.model import Fit, SplitFigures, TuneResult, load_result
from dptune.split import even_split
from tiny_models import SmallMLP as MLP  # tests/support


def write_report(folder, chunk_sizes):
    n = len(chunk_sizes)
    gib = 2**30
    devices = [Device(index=i, name="Virtual 24GB", total_bytes=24 * gib) for i in range(n)]
    peaks = [10 * gib] * n
    result = TuneResult(
        objective="balance", backend="simulated", cluster=f"{n}x24GB (simulated)",
        model_name="MLP", devices=devices, headroom_bytes=gib, budget_bytes=[23 * gib] * n,
        chunk_sizes=list(chunk_sizes), peak_bytes=peaks,
        even=SplitFigures(chunk_sizes=tuple(even_split(sum(chunk_sizes), n)),
                          peak_bytes=tuple(peaks), imbalance=1.0),
        probes=[ProbeResult(chunk_sizes=tuple(chunk_sizes), peak_bytes=tuple(peaks))],
        fits=[Fit(intercept_bytes=1e9, slope_bytes=1e8) for _ in range(n)],
    )
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "report.json", "w", encoding="utf-8") as f:
        json.dump(result.to_dict(), f)
    return folder


def test_wrap_folder_and_file(tmp_path):
    folder = write_report(tmp_path / "rep", [6, 10, 10, 10])
    for path in (folder, folder / "report.json", str(folder)):
        with pytest.warns(UserWarning, match="no CUDA"):   # built on this CPU-only machine
            w = load_result(path).wrap(MLP(), device_ids=[0, 1, 2, 3])
        assert isinstance(w, BalancedDataParallel)
        assert w.chunk_sizes == [6, 10, 10, 10]


def test_wrap_with_too_few_visible_devices(tmp_path, monkeypatch):
    folder = write_report(tmp_path / "rep", [6, 10, 10, 10])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UsageError, match=r"tuned for 4 cards .* but 2 CUDA device"):
        load_result(folder).wrap(MLP())


def test_wrap_without_cuda_is_a_pass_through(tmp_path, monkeypatch):
    """The README's promise: a script that reuses a report runs unchanged without a GPU."""
    folder = write_report(tmp_path / "rep", [3, 5])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    net = MLP()
    with pytest.warns(UserWarning, match="no CUDA device is available.*not used"):
        w = load_result(folder).wrap(net)
    assert w.device_ids == [] and w.module is net and w.chunk_sizes == [3, 5]
    x = torch.randn(8, 4)
    assert torch.equal(w(x), net(x))


def test_wrap_device_ids_mismatch(tmp_path):
    folder = write_report(tmp_path / "rep", [6, 10, 10, 10])
    with pytest.raises(UsageError, match="split for 4 cards.*give 4 device ids"):
        load_result(folder).wrap(MLP(), device_ids=[0, 1])


def test_wrap_missing(tmp_path):
    with pytest.raises(UsageError, match="no report"):
        load_result(tmp_path / "nothing")


def test_wrap_of_a_result_in_memory_names_no_file(monkeypatch, tmp_path):
    """A result that was not read from a file says "the result" in its messages; one read
    from a report names the file."""
    folder = write_report(tmp_path / "rep", [6, 10, 10, 10])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    loaded = load_result(folder)
    assert loaded.source == str(folder / "report.json")
    in_memory = TuneResult.from_dict(loaded.to_dict())
    assert in_memory.source is None and in_memory == loaded     # source is not compared
    with pytest.raises(UsageError, match=r"^the result was tuned for 4 cards"):
        in_memory.wrap(MLP())
    with pytest.raises(UsageError, match=r"^the report at .*report.json' was tuned for 4 cards"):
        loaded.wrap(MLP())


def test_load_result_is_public():
    assert dptune.load_result is load_result


def test_wrap_moves_the_model_to_the_first_card(monkeypatch, tmp_path):
    """With CUDA the model goes to device_ids[0] (DataParallel needs it there), so the user's
    line needs no ``.to("cuda:0")`` and runs unchanged without CUDA."""
    folder = write_report(tmp_path / "rep", [3, 5])
    moved_to = []

    class Spy(MLP):
        def to(self, *args, **kwargs):
            moved_to.append(args[0])
            return self

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(BalancedDataParallel, "__init__",
                        lambda self, module, device_ids=None, output_device=None, **kw:
                        nn.Module.__init__(self) or setattr(self, "seen", (device_ids, output_device, kw)))
    w = load_result(folder).wrap(Spy())
    assert moved_to == [torch.device("cuda", 0)]
    assert w.seen == ([0, 1], 0, {"chunk_sizes": [3, 5]})


def test_every_objective_a_search_writes_can_be_read_back(tmp_path):
    """A throughput search writes ``objective: throughput``; reading its report (``dptune show``,
    ``load_result(...).wrap``) refused it as invalid before."""
    import warnings

    from dptune import Tuner
    from dptune.examples.models import TinyGPT
    from dptune.report import write_report
    from dptune.result.model import load_result

    model = TinyGPT(vocab_size=256, d_model=32, n_layers=1, n_heads=2, seq_len=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = Tuner(model, model.sample, batch_size=16, objective="throughput",
                       simulate="2x8GB", verbose=False).fit()
    assert result.objective == "throughput"
    write_report(result, tmp_path / "r", plots=False)
    back = load_result(tmp_path / "r")
    assert back.objective == "throughput" and back.chunk_sizes == result.chunk_sizes
