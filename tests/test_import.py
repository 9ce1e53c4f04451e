"""``import dptune`` is cheap and quiet, and every public name resolves."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import dptune

HEAVY = ("pandas", "matplotlib", "pynvml", "transformers")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_import_prints_nothing():
    proc = run_python("import dptune")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_import_loads_nothing_heavy():
    proc = run_python("""
        import json, sys
        import dptune
        torch = sys.modules.get("torch")
        print(json.dumps({
            "heavy": [m for m in %r if m in sys.modules],
            "torch": torch is not None,
            "cuda_initialised": bool(torch is not None and torch.cuda.is_initialized()),
        }))
    """ % (HEAVY,))
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info == {"heavy": [], "torch": False, "cuda_initialised": False}


@pytest.mark.parametrize("module", ["dptune.parallel", "dptune.checkpoint", "dptune.cli.devices",
                                    "dptune.hardware.nvml", "dptune.split", "dptune.result.model",
                                    "dptune.integrations.dataparallel"])
def test_modules_are_lazy_about_cuda_nvml_pandas(module):
    # torch itself may import pynvml (torch.cuda does, where it is installed): only what the
    # module adds on top of torch counts.
    proc = run_python(f"""
        import json, sys
        import torch
        for m in {HEAVY!r}:
            sys.modules.pop(m, None)
        import {module}
        torch = sys.modules.get("torch")
        print(json.dumps({{
            "heavy": [m for m in {HEAVY!r} if m in sys.modules],
            "cuda_initialised": bool(torch is not None and torch.cuda.is_initialized()),
        }}))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"heavy": [], "cuda_initialised": False}
    assert proc.stderr == ""


def test_all_is_sorted_and_has_version():
    assert "__version__" in dptune.__all__
    assert set(dir(dptune)) == set(dptune.__all__)
    with pytest.raises(AttributeError):
        dptune.no_such_name  # noqa: B018


@pytest.mark.parametrize("name", [n for n in dptune.__all__ if n != "__version__"])
def test_every_public_name_resolves(name):
    """Each lazy name imports in a fresh interpreter (so one cannot hide another's import)."""
    proc = run_python(f"import dptune; obj = dptune.{name}; assert obj is not None")
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("module, must_not_load", [
    ("dptune.result.model", ["dptune.report", "dptune.cli"]),      # types below rendering
    ("dptune.parallel", ["dptune.report", "dptune.cli"]),    # reads reports through result
    ("dptune.step.presets", ["dptune.cli"]),                      # built-ins below the CLI
    ("dptune.backends.cuda", ["dptune.cli", "dptune.report"]),  # the isolated child's side
])
def test_imports_go_one_way(module, must_not_load):
    proc = run_python(f"""
        import json, sys
        import {module}
        print(json.dumps([m for m in {must_not_load!r} if m in sys.modules]))
    """)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
