"""The command line: through main(argv) in-process and through `python -m dptune`.

The happy path runs a tiny model on a small simulated cluster; every bad input is checked
for its exit code and a one-line message without a dptune traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dptune.settings import SearchSettings
from dptune import cli
from dptune.cli import main, search_command
from dptune.step.spec import RandomBatch, WorkloadSpec
from dptune.errors import UsageError
from dptune.report import report_dict, write_report
from dptune.result.model import TuneResult

from tests.report.test_report import make_result

ROOT = Path(__file__).resolve().parents[2]
# dptune's own source folder: no frame of it may show in a user's traceback (the checkout's own
# folder may well be called dptune, and hold the venv whose torch frames are shown)
PACKAGE_DIR = str(Path(cli.__file__).resolve().parents[1]) + os.sep

TINY_MODULE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=256, depth=2):
        super().__init__()
        self.width = width
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)

    def sample(self, batch_size):
        return torch.randn(batch_size, self.width)


class NoSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class Broken(Net):
    def forward(self, x):
        raise ValueError("boom in forward")


def make_batch(batch_size):
    return torch.randn(batch_size, 256)


def my_loss(output, batch):
    return output.pow(2).mean()


def my_optimizer(params):
    return torch.optim.SGD(params, lr=0.1)


not_callable = 3
'''

# 2 GB cards: at the default reserved level NCCL's 1.6 GB per card leaves no room; these
# tests check the CLI's files and flags at the allocated level (test_report_levels: the default)
FAST = ["--simulate", "2x2GB", "--max-probes", "6", "--budget-level", "allocated"]


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """A model module, under a fresh name, in the working directory (tmp_path)."""
    name = f"tiny_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TINY_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "dptune", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# ---- happy path --------------------------------------------------------------------------

@pytest.mark.slow
def test_search_subprocess_writes_every_file(tmp_path):
    (tmp_path / "tinymod.py").write_text(TINY_MODULE)
    proc = run_subprocess(tmp_path, "search", "--model", "tinymod:Net", "--batch-size", "32",
                          *FAST)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Net on 2x2GB (simulated, sm 8.0 assumed), fp32: batch 32")
    assert "even split" in lines[1] and "dptune split" in lines[1]
    assert any(line.startswith("imbalance") for line in lines)
    assert lines[-1] == f"report written to {Path('reports', 'Net-2x2GB')}{os.sep}"
    folder = tmp_path / "reports" / "Net-2x2GB"
    assert {p.name for p in folder.iterdir()} == {
        "report.json", "probes.csv", "summary.md", "report.html", "peaks.png", "fits.png"}
    result = TuneResult.load(str(folder))
    assert result.model_name == "Net" and result.batch_size == 32
    assert len(result.devices) == 2
    assert (folder / "probes.csv").read_text().count("\n") == result.num_probes + 1


def test_search_in_process_max_batch_with_options(tiny, capsys):
    code, out, err = run_main(
        capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs", '{"depth": 3}',
        "--sample", f"{tiny}:make_batch", "--batch-size", "16", "--objective", "max-batch",
        "--loss", f"{tiny}:my_loss", "--optimizer", "sgd", "--headroom", "512MiB",
        "--out", "out/run", "--no-plots", *FAST)
    assert code == 0, err
    assert "max batch that fits: even" in out
    assert out.splitlines()[-1] == f"report written to {Path('out', 'run')}{os.sep}"
    assert {p.name for p in Path("out/run").iterdir()} == {"report.json", "probes.csv",
                                                         "summary.md", "report.html"}
    result = TuneResult.load("out/run")
    assert result.objective == "max_batch" and result.headroom_bytes == 512 * 2**20


def test_search_input_shape_token_ids(tiny, capsys, monkeypatch):
    seen = {}
    real_search = cli.search

    def spy(spec, **kwargs):
        seen.update(kwargs, spec=spec)
        return real_search(spec, **kwargs)

    monkeypatch.setattr(search_command, "search", spy)
    code, out, err = run_main(
        capsys, "search", "--model", "dptune.examples.models:TinyGPT", "--model-kwargs",
        '{"vocab_size": 512, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 16}',
        "--input-shape", "16", "--vocab-size", "512", "--batch-size", "8", "--loss",
        "cross_entropy", "--optimizer", "none", "--quiet", *FAST)
    assert code == 0, err
    spec = seen["spec"]
    assert spec.input_shape == (16,) and spec.vocab_size == 512 and spec.batch_dtype == "long"
    assert out == f"report written to {Path('reports', 'TinyGPT-2x2GB')}{os.sep}\n"
    assert "probing" not in err  # --quiet: no progress bar


def test_json_output_round_trips(tiny, capsys):
    code, out, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--batch-size", "8",
                              "--json", "--no-plots", *FAST)
    assert code == 0, err
    data = json.loads(out)  # stdout holds the JSON and nothing else
    # report.json's content: the result's dict plus the derived budget level and memory_stats
    assert data.pop("budget_level") == "allocated" and data.pop("memory_stats") is None
    assert TuneResult.from_dict(data).to_dict() == data
    assert data["model_name"] == "Net" and data["batch_size"] == 8
    assert "report written to" in err


def test_default_cluster_when_no_gpu_is_announced_once(tiny, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--batch-size", "8",
                              "--max-probes", "4", "--no-plots")
    assert code == 0, err
    assert err.count("4x24GB") == 1 and "no GPU is visible" in err
    assert "Net on 4x24GB (simulated, sm 8.0 assumed)" in out
    assert Path("reports/Net-4x24GB/report.json").exists()


@pytest.mark.slow     # a second `python -m dptune search` process; test_search_subprocess_writes_every_file is the one in make test
def test_subprocess_default_sample_from_examples(tmp_path):
    """The Makefile's demo shape: an example model, its own sample(), --json on stdout."""
    proc = run_subprocess(
        tmp_path, "search", "--model", "dptune.examples.models:MLP", "--model-kwargs",
        '{"in_features": 64, "hidden": 64, "depth": 2, "num_classes": 10}', "--batch-size",
        "16", "--json", *FAST)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["model_name"] == "MLP" and data["batch_size"] == 16
    assert (tmp_path / "reports" / "MLP-2x2GB" / "peaks.png").stat().st_size > 0


# ---- exit codes for bad input --------------------------------------------------------------

def assert_usage_error(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert "dptune: error:" in err or "error:" in err
    for fragment in fragments:
        assert fragment in err, err


def test_bad_model_kwargs_json(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs",
                            "{depth: 3}", *FAST)
    assert_usage_error(code, err, "--model-kwargs is not valid JSON")
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs",
                            "[1, 2]", *FAST)
    assert_usage_error(code, err, "must be a JSON object")


def test_bad_cluster_spec(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--simulate",
                            "4xbanana")
    assert_usage_error(code, err, "dptune: error:", "banana")


@pytest.mark.parametrize("model, fragment", [
    ("{tiny}.Net", 'expected "module:attribute"'),
    ("no_such_module_xyz:Net", "no module named 'no_such_module_xyz'"),
    ("{tiny}:Nett", "has no attribute 'Nett'; did you mean 'Net'"),
    ("{tiny}:not_callable", "names a int"),
])
def test_bad_import_string(tiny, capsys, model, fragment):
    code, _, err = run_main(capsys, "search", "--model", model.format(tiny=tiny), *FAST)
    assert_usage_error(code, err, "dptune: error:", fragment)


def test_bad_loss_and_optimizer_names(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--loss", "hinge",
                            *FAST)
    assert_usage_error(code, err, "--loss 'hinge': choose one of")
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--optimizer",
                            f"{tiny}:missing", *FAST)
    assert_usage_error(code, err, "has no attribute 'missing'")


def test_no_way_to_build_a_batch(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:NoSample", *FAST)
    assert_usage_error(code, err, "has no sample(batch_size) method", "--input-shape",
                       "--sample")


@pytest.mark.parametrize("argv, fragment", [
    ([], "one of the arguments --model --hf-trainer is required"),
    (["--model", "m:N", "--devices", "0", "--simulate", "2x2GB"], "not allowed with"),
    (["--model", "m:N", "--headroom", "lots"], "not a byte size"),
    (["--model", "m:N", "--batch-size", "0"], "expected a positive integer"),
    (["--model", "m:N", "--input-shape", "3,a"], "positive ints"),
    (["--model", "m:N", "--sample", "m:f", "--input-shape", "3"], "not allowed with"),
    (["--model", "m:N", "--objective", "fast"], "invalid choice"),
])
def test_argparse_errors_exit_2(capsys, argv, fragment):
    code, _, err = run_main(capsys, "search", *argv)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_dtype_long_needs_vocab_size(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--input-shape", "4",
                            "--dtype", "long", *FAST)
    assert_usage_error(code, err, "--vocab-size")


def test_devices_without_gpu_exit_4(tiny, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--devices", "0,1")
    assert code == 4
    assert "Traceback" not in err
    assert "dptune: error: GPUs 0, 1 were asked for but torch sees none" in err
    assert "--simulate" in err and "CUDA_VISIBLE_DEVICES" in err


def test_no_split_fits_exit_3(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs",
                            '{"width": 2048}', "--batch-size", "1000000", *FAST)
    assert code == 3
    assert "Traceback" not in err
    assert "dptune: error: no split of batch size 1000000 fits" in err


def test_user_model_raising_exit_1_with_its_traceback(tiny, capsys):
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Broken", "--batch-size", "8",
                            *FAST)
    assert code == 1
    assert "Traceback" in err and f"{tiny}.py" in err and "boom in forward" in err
    assert err.rstrip().splitlines()[-1].startswith("dptune: error: ValueError")
    assert f"dptune{os.sep}cli{os.sep}" not in err  # the user's frames, not dptune's


def test_user_model_constructor_raising_exit_1(tiny, capsys):
    # raised at the call itself: no frame of the user's to show, the message says it all
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs",
                            '{"colour": 1}', "--batch-size", "8", *FAST)
    assert code == 1
    assert "Traceback" not in err
    assert "dptune: error: the model factory 'Net' raised while building the model" in err
    assert "unexpected keyword argument 'colour'" in err
    # raised inside the user's __init__: their frame is shown
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--model-kwargs",
                            '{"width": -1}', "--batch-size", "8", *FAST)
    assert code == 1
    assert "Traceback" in err and f"{tiny}.py" in err and PACKAGE_DIR not in err


@pytest.mark.slow     # a `python -m dptune` process (tests/test_importer.py checks the import error in-process)
def test_import_error_inside_user_module_subprocess(tmp_path):
    (tmp_path / "badmod.py").write_text("import torch\nimport not_installed_pkg_xyz\n")
    proc = run_subprocess(tmp_path, "search", "--model", "badmod:Net", *FAST)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" in proc.stderr
    assert 'badmod.py", line 2' in proc.stderr
    assert "No module named 'not_installed_pkg_xyz'" in proc.stderr
    assert "importlib" not in proc.stderr and PACKAGE_DIR not in proc.stderr


def test_bad_spec_subprocess_no_traceback(tmp_path):
    (tmp_path / "tinymod.py").write_text(TINY_MODULE)
    proc = run_subprocess(tmp_path, "search", "--model", "tinymod:Net", "--simulate", "4x")
    assert proc.returncode == 2
    assert proc.stderr.startswith("dptune: error:") and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_keyboard_interrupt_exit_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(search_command, "search", interrupted)
    code, _, err = run_main(capsys, "search", "--model", "m:N", *FAST)
    assert code == 130 and "interrupted" in err


def test_unexpected_error_in_code_dptune_runs_is_blamed_on_that_code(capsys, monkeypatch):
    def bug(*args, **kwargs):       # this test file stands for the user's code
        raise AssertionError("a bug")

    monkeypatch.setattr(search_command, "search", bug)
    code, _, err = run_main(capsys, "search", "--model", "m:N", *FAST)
    assert code == 1 and "Traceback" in err and "unexpected AssertionError: a bug" in err
    assert "bug in dptune" not in err


def test_unexpected_error_in_dptunes_own_code_is_a_bug_in_dptune_exit_5(capsys, monkeypatch):
    from dptune.errors import EXIT_INTERNAL
    from dptune.units import format_bytes

    # dptune's own function fails (through torch-free code of dptune, no user frame after it)
    monkeypatch.setattr(search_command, "search", lambda *a, **k: format_bytes("not a size"))
    code, _, err = run_main(capsys, "search", "--model", "m:N", *FAST)
    assert code == EXIT_INTERNAL == 5 and "Traceback" in err
    assert "in dptune's own code" in err and "not in your code" in err


def test_an_error_rebuilt_from_another_process_is_dptunes_not_the_users():
    from dptune.errors import EXIT_INTERNAL, DptuneError, InternalError

    assert DptuneError("rank 1 failed while planning (AssertionError): x").exit_code == EXIT_INTERNAL
    assert InternalError("the ledger failed").exit_code == EXIT_INTERNAL


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path):
    """``dptune show DIR --json | head``: the reader closes the pipe before dptune writes; dptune
    stops with 141 (as a shell reports SIGPIPE) and no traceback, not as a bug."""
    result = make_result()
    write_report(result, tmp_path / "r")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.Popen([sys.executable, "-m", "dptune", "show", str(tmp_path / "r"), "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()                         # before the child has imported anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "bug" not in err


# ---- other commands ----------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    result = make_result("max_batch")
    folder = write_report(result, tmp_path / "reports" / "saved", plots=False)
    return result, folder


def test_show_prints_summary(saved, capsys):
    result, folder = saved
    code, out, err = run_main(capsys, "show", str(folder))
    assert code == 0, err
    assert out.startswith("# dptune report: TinyGPT on 4x24GB (simulated)")
    assert "max batch that fits: even 132 -> balanced 208" in out
    assert result.advice[0] in out
    code, out, _ = run_main(capsys, "show", str(folder / "report.json"), "--json")
    data = json.loads(out)
    assert code == 0 and data == report_dict(result)
    verify = result.probes[-1]        # the probe that measured the split (make_result)
    assert list(verify.chunk_sizes) == result.chunk_sizes
    assert [ms["reserved_bytes.all.peak"] for ms in data["memory_stats"]] == \
        list(verify.reserved_bytes)


def test_plot_redraws_from_saved_report(saved, capsys):
    _, folder = saved
    code, out, err = run_main(capsys, "plot", str(folder))
    assert code == 0, err
    for kind in ("peaks", "fits", "max_batch"):
        png = folder / f"{kind}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"wrote {png}" in out
    code, out, _ = run_main(capsys, "plot", str(folder), "--kind", "fits", "--out",
                            str(folder / "again"))
    assert code == 0 and [p.name for p in (folder / "again").iterdir()] == ["fits.png"]


def test_show_and_plot_missing_report_exit_2(tmp_path, capsys):
    for command in ("show", "plot"):
        code, _, err = run_main(capsys, command, str(tmp_path / "nothing"))
        assert_usage_error(code, err, "dptune: error: no report at")


def test_show_report_of_another_version_exit_2(saved, capsys):
    _, folder = saved
    data = json.loads((folder / "report.json").read_text())
    data["version"] = 99
    (folder / "report.json").write_text(json.dumps(data))
    code, _, err = run_main(capsys, "show", str(folder))
    assert_usage_error(code, err, "report version 99 is not supported")


def test_devices_without_gpu(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_main(capsys, "devices")
    assert code == 0 and "no CUDA GPU is visible" in out


def test_help_documents_exit_codes(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    for line in ("0    success", "2    usage", "3    no split", "4    backend unavailable",
                 "130  interrupted"):
        assert line in out
    code, out, _ = run_main(capsys, "search", "--help")
    assert code == 0 and "--input-shape" in out and "exit codes:" in out


def test_no_command_is_usage(capsys):
    code, _, err = run_main(capsys)
    assert code == 2 and "search" in err


# ---- the pieces ------------------------------------------------------------------------

def test_random_batch():
    import torch

    x = RandomBatch((3, 4))(5)
    assert x.shape == (5, 3, 4) and x.dtype == torch.float32
    ids = RandomBatch((7,), "long", 11)(2)
    assert ids.shape == (2, 7) and ids.dtype == torch.long and int(ids.max()) < 11
    assert RandomBatch((2,), "bfloat16")(1).dtype == torch.bfloat16


def test_spec_uses_models_own_sample_on_meta():
    wl = WorkloadSpec("dptune.examples.models:TinyGPT", model_kwargs={"seq_len": 12}).build()
    assert callable(wl.model) and wl.model.__name__ == "TinyGPT"
    batch = wl.sample(3)      # before any model is built: read from a meta instance
    assert batch.shape == (3, 12) and not batch.is_meta
    assert wl.loss_fn is None and wl.optimizer is cli.adamw


def test_spec_of_a_factory_function_finds_its_models_sample(tiny):
    import torch

    wl = WorkloadSpec(f"{tiny}:Net", model_kwargs={"width": 8}, loss="mse",
                      optimizer="none").build()
    model = wl.model()
    assert isinstance(model, torch.nn.Module) and wl.sample(2).shape == (2, 8)
    assert wl.optimizer is None and wl.loss_fn is cli.mse_loss


@pytest.mark.parametrize("name", ["sum", "mean", "cross_entropy", "mse"])
def test_builtin_losses_backpropagate(name):
    import torch

    logits = torch.randn(4, 5, 7, requires_grad=True)
    for output in (logits, (logits,), {"logits": logits}):
        loss = cli.LOSSES[name](output, None)
        assert loss.dim() == 0
        loss.backward()
        assert logits.grad is not None
        logits.grad = None


def test_cross_entropy_needs_classes():
    import torch

    with pytest.raises(UsageError, match="shape \\(batch, ..., classes\\)"):
        cli.cross_entropy_loss(torch.randn(4, requires_grad=True))


@pytest.mark.parametrize("name, kind", [("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW")])
def test_builtin_optimizers(name, kind):
    import torch

    opt = cli.OPTIMIZERS[name]([torch.nn.Parameter(torch.zeros(2))])
    assert type(opt).__name__ == kind


def test_default_report_dir():
    r = make_result()
    assert cli.default_report_dir(r) == Path("reports", "TinyGPT-4x24GB")
    r.cluster = "2xA100-80GB,used=0:6GB (simulated)"
    assert cli.default_report_dir(r) == Path("reports", "TinyGPT-2xA100-80GB_used_0_6GB")
    r.cluster = "2x NVIDIA H100 80GB HBM3"
    assert cli.default_report_dir(r) == Path("reports", "TinyGPT-2x_NVIDIA_H100_80GB_HBM3")


def test_isolate_is_for_real_gpus(capsys):
    from dptune.cli import main

    code = main(["search", "--model", "dptune.examples.models:MLP", "--simulate", "2x24GB",
                 "--batch-size", "8", "--isolate", "--quiet", "--no-plots"])
    assert code == 2
    assert "--isolate" in capsys.readouterr().err


def test_isolate_builds_an_isolated_backend_from_the_flags_spec(monkeypatch):
    """--isolate hands the child the spec the flags describe (built-ins by name: the child
    resolves them below the CLI, without importing it)."""
    import pickle

    import dptune.backends.cuda as cuda
    import dptune.tuner as tuner_mod
    from dptune.tuner import BackendChoice

    captured = {}

    class FakeBackend:
        def __init__(self, spec, device_ids=None, isolate=False):
            captured.update(spec=spec, device_ids=device_ids, isolate=isolate)
            raise RuntimeError("stop here")

    monkeypatch.setattr(cuda, "CudaBackend", FakeBackend)
    monkeypatch.setattr(tuner_mod, "choose_backend",
                        lambda ids, sim: BackendChoice(device_ids=list(ids)))
    args = cli.build_parser().parse_args(
        ["search", "--model", "dptune.examples.models:TinyGPT", "--model-kwargs",
         '{"vocab_size": 100}', "--input-shape", "16", "--vocab-size", "100", "--loss",
         "cross_entropy", "--devices", "0,1", "--isolate"])
    with pytest.raises(RuntimeError, match="stop here"):
        cli.search(cli.workload_spec(args), devices=args.devices, isolate=True,
                   search_settings=SearchSettings(verbose=False))
    spec = captured["spec"]
    assert isinstance(spec, WorkloadSpec) and captured["isolate"] and captured["device_ids"] == [0, 1]
    assert (spec.loss, spec.optimizer, spec.batch_dtype, spec.vocab_size) == (
        "cross_entropy", "adamw", "long", 100)
    wl = pickle.loads(pickle.dumps(spec)).build()   # the child's view
    assert wl.loss_fn is cli.LOSSES["cross_entropy"] and wl.optimizer is cli.OPTIMIZERS["adamw"]
    assert wl.sample(3).shape == (3, 16)
