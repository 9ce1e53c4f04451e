"""patch_dataparallel: nn.DataParallel builds a BalancedDataParallel inside, the original outside.

Without CUDA, ``DataParallel.__init__`` ignores ``device_ids``; the ``cards`` fixture makes it
believe ``n`` CUDA devices exist (only the three lookups it makes are replaced), so the
arguments a script passes are kept and checked as on a machine with GPUs.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from torch import nn

import dptune
from dptune.errors import UsageError
from dptune.integrations.dataparallel import chunk_sizes_of, patch_dataparallel
from dptune.parallel import BalancedDataParallel

REAL = nn.DataParallel
# the module (torch.nn.parallel.data_parallel is also the name of a function)
dp_module = importlib.import_module("torch.nn.parallel.data_parallel")


@pytest.fixture
def cards(monkeypatch):
    """Make DataParallel.__init__ see 4 CUDA devices (nothing runs on them)."""
    monkeypatch.setattr(dp_module, "_get_available_device_type", lambda: "cuda")
    monkeypatch.setattr(dp_module, "_get_all_device_indices", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(dp_module, "_check_balance", lambda ids: None)
    return 4


def build(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no CUDA device": the split is unused on the CPU
        return nn.DataParallel(*args, **kwargs)


def test_class_inside_and_outside():
    net = nn.Linear(3, 2)
    assert type(build(net)) is REAL
    with patch_dataparallel([2, 6]) as sizes:
        assert sizes == [2, 6]
        assert nn.DataParallel is not REAL and torch.nn.parallel.DataParallel is nn.DataParallel
        wrapped = build(net)
        assert type(wrapped) is BalancedDataParallel
        assert wrapped.chunk_sizes == [2, 6]
        # isinstance keeps its meaning, for balanced and plain wrappers alike
        assert isinstance(wrapped, nn.DataParallel)
        assert isinstance(REAL(net), nn.DataParallel)
        assert not isinstance(net, nn.DataParallel)
        assert issubclass(BalancedDataParallel, nn.DataParallel)
        assert "chunk_sizes=[2, 6]" in repr(nn.DataParallel)
    assert nn.DataParallel is REAL and torch.nn.parallel.DataParallel is REAL
    assert type(build(net)) is REAL


def test_script_arguments_are_kept(cards):
    net = nn.Linear(3, 2)
    with patch_dataparallel([1, 5, 5, 5]):
        # what a script writes; the module stays on the CPU (several devices: no .to())
        model = nn.DataParallel(net, device_ids=[0, 1, 2, 3], output_device=1, dim=0)
        positional = torch.nn.DataParallel(net, [0, 1, 2, 3], 2)
        everything = torch.nn.DataParallel(net)
    assert type(model) is BalancedDataParallel
    assert model.module is net
    assert model.device_ids == [0, 1, 2, 3]
    assert model.output_device == 1
    assert model.dim == 0
    assert model.chunk_sizes == [1, 5, 5, 5]
    assert model.split_for(16) == [1, 5, 5, 5]
    assert model.split_for(8) == [1, 3, 2, 2]          # another batch: same proportions
    assert positional.output_device == 2 and positional.chunk_sizes == [1, 5, 5, 5]
    assert everything.device_ids == [0, 1, 2, 3] and everything.output_device == 0


def test_device_ids_that_do_not_match_the_split_say_so(cards):
    with patch_dataparallel([1, 5, 5, 5]):
        with pytest.raises(UsageError, match="4 entries but there are 2 devices"):
            nn.DataParallel(nn.Linear(3, 2), device_ids=[0, 1])
        with pytest.raises(UsageError, match="takes no chunk_sizes"):
            nn.DataParallel(nn.Linear(3, 2), chunk_sizes=[1, 1, 1, 1])
    assert nn.DataParallel is REAL


def test_nesting_innermost_split_applies_and_each_exit_restores():
    net = nn.Linear(3, 2)
    with patch_dataparallel([2, 6]):
        outer = nn.DataParallel
        with patch_dataparallel([3, 5]):
            assert build(net).chunk_sizes == [3, 5]
            # the inner stand-in wraps the real class, not the outer stand-in
            assert outer.__dict__["_dptune_original"] is REAL
            assert nn.DataParallel.__dict__["_dptune_original"] is REAL
        assert nn.DataParallel is outer
        assert build(net).chunk_sizes == [2, 6]
    assert nn.DataParallel is REAL


def test_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with patch_dataparallel([2, 6]):
            with patch_dataparallel([3, 5]):
                raise RuntimeError("boom")
    assert nn.DataParallel is REAL and torch.nn.parallel.DataParallel is REAL


def test_a_users_subclass_of_the_stand_in_builds_itself():
    with patch_dataparallel([2, 6]):
        class MyDP(nn.DataParallel):
            pass

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = MyDP(nn.Linear(3, 2))
    assert type(m) is MyDP and isinstance(m, REAL)


def test_accepts_a_result_a_report_folder_or_a_list(tmp_path):
    from tests.test_result_wrap import write_report  # the shared report fixture

    from dptune.result.model import TuneResult

    folder = write_report(tmp_path / "rep", [2, 6])
    assert chunk_sizes_of(TuneResult.load(str(folder))) == [2, 6]
    assert chunk_sizes_of(folder) == [2, 6]
    assert chunk_sizes_of(str(folder / "report.json")) == [2, 6]
    assert chunk_sizes_of((2, 6)) == [2, 6]
    with patch_dataparallel(folder):
        assert build(nn.Linear(3, 2)).chunk_sizes == [2, 6]
    for bad, match in [([], "empty"), ([1, -1], "non-negative"), ("nope", "no report"),
                       (3, "expected a TuneResult"), ([0, 0], "sum to 0")]:
        with pytest.raises(UsageError, match=match):
            with patch_dataparallel(bad):
                pass  # pragma: no cover
    assert nn.DataParallel is REAL


@pytest.mark.slow
def test_top_level_name_and_yolov5_style_script(tmp_path):
    """A script that builds torch.nn.DataParallel itself, run under dptune.patch_dataparallel."""
    script = tmp_path / "train_dp.py"
    script.write_text(textwrap.dedent("""
        import torch
        def run(device_ids):
            model = torch.nn.Linear(4, 2)
            # DP mode, as YOLOv5's train.py writes it
            model = torch.nn.DataParallel(model, device_ids=device_ids, output_device=device_ids[-1])
            return model
    """))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys, warnings
        sys.path.insert(0, {str(tmp_path)!r})
        import importlib
        dp = importlib.import_module("torch.nn.parallel.data_parallel")
        dp._get_available_device_type = lambda: "cuda"      # pretend 3 cards
        dp._check_balance = lambda ids: None
        import dptune, train_dp
        warnings.simplefilter("ignore")
        with dptune.patch_dataparallel([2, 7, 7]):
            m = train_dp.run([0, 1, 2])
        plain = train_dp.run([0, 1, 2])
        print(json.dumps([type(m).__name__, m.chunk_sizes, m.device_ids, m.output_device,
                          type(plain).__name__]))
    """)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["BalancedDataParallel", [2, 7, 7], [0, 1, 2], 2,
                                       "DataParallel"]
    assert dptune.patch_dataparallel is patch_dataparallel
