"""``import dptune`` is cheap and quiet, and every public name resolves.

Each check runs its code in a fresh interpreter state: a child forked by
tests/support/fresh_imports.py from a parent that has imported nothing of dptune (and, for the
checks that begin with ``import torch``, has imported torch once for all of them): one parent
process for the module's checks instead of one ``python -c`` per check."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dptune

HEAVY = ("pandas", "matplotlib", "pynvml", "transformers")
RUNNER = Path(__file__).resolve().parent / "support" / "fresh_imports.py"


@functools.cache
def run_jobs(jobs: tuple[tuple[bool, str], ...]) -> tuple[subprocess.CompletedProcess, ...]:
    """Run each ``(after_torch, code)`` in its own fresh child (see fresh_imports.py); one
    CompletedProcess per job, with the child's own exit status, stdout and stderr."""
    payload = json.dumps([{"torch": t, "code": textwrap.dedent(c)} for t, c in jobs])
    proc = subprocess.run([sys.executable, str(RUNNER)], input=payload, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tuple(subprocess.CompletedProcess(c, r["returncode"], r["stdout"], r["stderr"])
                 for (_, c), r in zip(jobs, json.loads(proc.stdout)))


def run_one(job: tuple[bool, str]) -> subprocess.CompletedProcess:
    """``job``'s outcome, all of this module's checks run together (one parent process)."""
    return run_jobs(ALL_JOBS)[ALL_JOBS.index(job)]


LOADS_NOTHING_HEAVY = """
    import json, sys
    import dptune
    torch = sys.modules.get("torch")
    print(json.dumps({
        "heavy": [m for m in %r if m in sys.modules],
        "torch": torch is not None,
        "cuda_initialised": bool(torch is not None and torch.cuda.is_initialized()),
    }))
""" % (HEAVY,)
#: the checks of a bare interpreter (nothing imported before dptune)
BARE = ((False, "import dptune"), (False, LOADS_NOTHING_HEAVY))


def test_import_prints_nothing():
    proc = run_one(BARE[0])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""


def test_import_loads_nothing_heavy():
    proc = run_one(BARE[1])
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info == {"heavy": [], "torch": False, "cuda_initialised": False}


LAZY_MODULES = ["dptune.parallel", "dptune.checkpoint", "dptune.cli.devices",
                "dptune.hardware.nvml", "dptune.split", "dptune.result.model",
                "dptune.integrations.dataparallel"]
LAZY = tuple((True, f"""
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
""") for module in LAZY_MODULES)


@pytest.mark.parametrize("module", LAZY_MODULES)
def test_modules_are_lazy_about_cuda_nvml_pandas(module):
    # torch itself may import pynvml (torch.cuda does, where it is installed): only what the
    # module adds on top of torch counts.
    proc = run_one(LAZY[LAZY_MODULES.index(module)])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"heavy": [], "cuda_initialised": False}
    assert proc.stderr == ""


def test_all_is_sorted_and_has_version():
    assert "__version__" in dptune.__all__
    assert set(dir(dptune)) == set(dptune.__all__)
    with pytest.raises(AttributeError):
        dptune.no_such_name  # noqa: B018


NAMES = [n for n in dptune.__all__ if n != "__version__"]
RESOLVE = tuple((True, f"import dptune; obj = dptune.{name}; assert obj is not None")
                for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_public_name_resolves(name):
    """Each lazy name imports in a fresh child (so one cannot hide another's import)."""
    proc = run_one(RESOLVE[NAMES.index(name)])
    assert proc.returncode == 0, proc.stderr[-2000:]


ONE_WAY = [
    ("dptune.result.model", ["dptune.report", "dptune.cli"]),      # types below rendering
    ("dptune.parallel", ["dptune.report", "dptune.cli"]),    # reads reports through result
    ("dptune.step.presets", ["dptune.cli"]),                      # built-ins below the CLI
    ("dptune.backends.cuda", ["dptune.cli", "dptune.report"]),  # the isolated child's side
]
ONE_WAY_JOBS = tuple((True, f"""
    import json, sys
    import {module}
    print(json.dumps([m for m in {must_not_load!r} if m in sys.modules]))
""") for module, must_not_load in ONE_WAY)


@pytest.mark.parametrize("module, must_not_load", ONE_WAY)
def test_imports_go_one_way(module, must_not_load):
    proc = run_one(ONE_WAY_JOBS[ONE_WAY.index((module, must_not_load))])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


ALL_JOBS = BARE + LAZY + RESOLVE + ONE_WAY_JOBS
