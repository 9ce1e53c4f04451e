"""The committed example (reports/TinyGPT-4x24GB, the README's first picture) is what its
command prints today: the command is read from the Makefile's ``example`` target (what
``make example`` runs), run into a scratch folder, and its report.json compared with the
committed one, every field but the wall-clock seconds. When the search or the simulator
changes, this fails until the example is regenerated (``make example``, then commit)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "reports" / "TinyGPT-4x24GB"


def example_command() -> list[str]:
    """The ``example`` target's ``dptune`` arguments, as ``make example`` runs them."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    recipe = re.search(r"^example:.*\n\t(.+)$", text, re.M)
    assert recipe, "the Makefile has no example target"
    argv = shlex.split(recipe.group(1))
    assert argv[:3] == ["$(PY)", "-m", "dptune"], argv
    return argv[3:]


def without_seconds(x: Any) -> Any:
    """``x`` with every ``seconds`` key dropped (how long the machine took, not the result)."""
    if isinstance(x, dict):
        return {k: without_seconds(v) for k, v in x.items() if k != "seconds"}
    if isinstance(x, list):
        return [without_seconds(v) for v in x]
    return x


def test_the_makefile_writes_the_committed_example():
    argv = example_command()
    out = argv[argv.index("--out") + 1]
    assert (ROOT / out).resolve() == EXAMPLE.resolve()
    assert {"report.json", "summary.md", "report.html", "peaks.png", "fits.png",
            "max_batch.png", "probes.csv"} <= {p.name for p in EXAMPLE.iterdir()}


@pytest.mark.slow
def test_the_committed_example_is_what_its_command_prints(tmp_path):
    argv = example_command()
    argv[argv.index("--out") + 1] = str(tmp_path / "example")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([sys.executable, "-m", "dptune", *argv, "--quiet"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads((tmp_path / "example" / "report.json").read_text())
    committed = json.loads((EXAMPLE / "report.json").read_text())
    # the headline first, so a failure names what a reader sees
    for key in ("chunk_sizes", "batch_size", "certified", "budget_bytes", "peak_bytes"):
        assert fresh[key] == committed[key], (key, "regenerate: make example")
    assert fresh["even"]["chunk_sizes"] == committed["even"]["chunk_sizes"]
    assert [p["chunk_sizes"] for p in fresh["probes"]] == \
        [p["chunk_sizes"] for p in committed["probes"]]
    assert without_seconds(fresh) == without_seconds(committed)
