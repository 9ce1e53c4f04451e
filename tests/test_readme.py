"""Every code block of the README from "Use it" down to "Layout" runs as printed.

Each ```python block runs as a script in a fresh interpreter, each ```bash block in bash with
``dptune`` on the PATH (this checkout's ``python -m dptune``), and each ```console block's
commands (its ``$`` lines, the output shown is not compared) in bash too, all in a temporary
folder that holds a copy of the committed example report (``reports/TinyGPT-4x24GB``, which the
commands show and plot), a small stand-in for the user's ``mymodels.py``
(tests/support/readme_mymodels.py: ``Net``, ``GPT``, ``make_batch``) and a ``lengths.txt``
(one length per line, as the variable-length section reads it). A block that reads a report
an earlier block writes (``"reports/mynet"``) runs after that block, in the same folder.
Without a GPU, dptune falls back to the simulated cluster, as the README says.

A block preceded by ``<!-- no-run: reason -->`` is not run (it needs GPUs or torchrun, or code
that is not in this project); it is reported as skipped with its reason, and there are few of
them. Each block starts an interpreter with torch and runs a search or an estimate (15 to 45 s
on two busy cores), so running them is marked slow: CI runs them, ``make test`` checks only
that the blocks are found and few are left unrun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FIRST, LAST = "## Use it", "## Layout"
#: the most blocks the README may leave unrun (those needing GPUs, torchrun or someone else's code)
MAX_NO_RUN = 13
#: the user's files the README's blocks name, as a user would have them in the working directory
MYMODELS = Path(__file__).resolve().parent / "support" / "readme_mymodels.py"
LENGTHS = [20 + (i * 37) % 1000 for i in range(400)]


class Block(NamedTuple):
    line: int               # the line of its opening fence
    lang: str               # "python", "bash" or "console"
    code: str
    no_run: Optional[str]   # why it is not run, or None

    @property
    def name(self) -> str:
        return f"README.md:{self.line}:{self.lang}"


def blocks() -> list[Block]:
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(FIRST)
    end = lines.index(LAST)
    out: list[Block] = []
    k = start
    while k < end:
        m = re.fullmatch(r"```(\w+)", lines[k])
        if m is None:
            k += 1
            continue
        close = lines.index("```", k + 1)
        prev = next((lines[j] for j in range(k - 1, start, -1) if lines[j].strip()), "")
        no_run = re.fullmatch(r"<!-- no-run: (.+) -->", prev)
        out.append(Block(k + 1, m.group(1), "\n".join(lines[k + 1:close]) + "\n",
                         no_run.group(1) if no_run else None))
        k = close + 1
    return out


BLOCKS = blocks()


def _reports_read(code: str) -> set[str]:
    return set(re.findall(r"""["'](reports/[\w.-]+)["']""", code))


def _writer_of(block: Block) -> list[Block]:
    """The earlier blocks that write a report folder ``block`` reads (in README order)."""
    wanted = _reports_read(block.code)
    return [b for b in BLOCKS if b.line < block.line and b.no_run is None
            and b.lang == "python" and wanted & _reports_read(b.code) and "write_report" in b.code]


def _run(block: Block, folder: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               MPLBACKEND="Agg")
    if block.lang == "python":
        script = folder / f"block_{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    else:
        code = _commands(block.code) if block.lang == "console" else block.code
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=900)


def _commands(console: str) -> str:
    """The commands of a console transcript: each ``$ `` line and the lines it continues
    (ending with a backslash); the output lines are left out."""
    out: list[str] = []
    going_on = False
    for line in console.splitlines():
        if line.startswith("$ ") or going_on:
            out.append(line[2:] if line.startswith("$ ") and not going_on else line)
            going_on = line.endswith("\\")
    return "\n".join(out) + "\n"


@pytest.fixture
def workdir(tmp_path):
    """A folder like a checkout's working directory: the committed example report, the
    user's ``mymodels.py`` and ``lengths.txt``, and a ``dptune`` command that runs this
    checkout's code."""
    shutil.copytree(ROOT / "reports" / "TinyGPT-4x24GB", tmp_path / "reports" / "TinyGPT-4x24GB")
    shutil.copy(MYMODELS, tmp_path / "mymodels.py")
    (tmp_path / "lengths.txt").write_text("".join(f"{n}\n" for n in LENGTHS), encoding="utf-8")
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "dptune"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dptune "$@"\n', encoding="utf-8")
    shim.chmod(0o755)
    return tmp_path, bin_dir


def _params() -> list:
    params = []
    for b in BLOCKS:
        marks = [pytest.mark.skip(reason=f"{b.name}: {b.no_run}")] if b.no_run is not None else []
        params.append(pytest.param(b, id=b.name, marks=marks))
    return params


@pytest.mark.slow
@pytest.mark.parametrize("block", _params())
def test_readme_block_runs_as_printed(block, workdir):
    folder, bin_dir = workdir
    for before in _writer_of(block):
        done = _run(before, folder, bin_dir)
        assert done.returncode == 0, f"{before.name} (run first):\n{done.stderr[-3000:]}"
    done = _run(block, folder, bin_dir)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_readme_blocks_are_found_and_few_are_left_unrun():
    langs = {b.lang for b in BLOCKS}
    assert langs == {"python", "bash", "console"}, langs
    unrun = [b for b in BLOCKS if b.no_run is not None]
    assert len(BLOCKS) >= 25 and len(unrun) <= MAX_NO_RUN, [b.name for b in unrun]
    consoles = [b for b in BLOCKS if b.lang == "console"]
    assert all(_commands(b.code).startswith("dptune ") for b in consoles), consoles
    assert all(b.no_run.strip() for b in unrun)
    # a block that reads a report some block writes runs after it
    reads = [b for b in BLOCKS if b.no_run is None and "load_result" in b.code]
    assert reads and all(_writer_of(b) for b in reads)


def test_default_report_folders_are_not_left_untracked(tmp_path):
    """`dptune search` without --out writes reports/<Model>-<cluster>/ in the working
    directory: inside the checkout git ignores it, while the committed reports stay tracked."""
    if shutil.which("git") is None:
        pytest.skip("the git program is not installed")
    # the checkout's .gitignore in a repository of its own: the test also runs on a copy of the
    # tree that is not a git checkout
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / ".gitignore", repo / ".gitignore")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)

    def ignored(path: str) -> bool:
        done = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=repo)
        assert done.returncode in (0, 1), done
        return done.returncode == 0

    assert ignored("reports/TinyGPT-8x80GB/report.json")
    assert ignored("reports/ddp-TinyGPT-4x24GB/plan.json")
    assert not ignored("reports/TinyGPT-4x24GB/report.json")
    assert not ignored("reports/benchmarks/results.csv")
