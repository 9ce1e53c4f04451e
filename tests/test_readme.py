"""Every code block of the README and of the documentation site (docs/**/*.md) runs as printed.

Each ```python block runs as a script in a fresh interpreter, each ```bash block in bash with
``dptune`` on the PATH (this checkout's ``python -m dptune``), and each ```console block's
commands (its ``$`` lines, the output shown is not compared) in bash too, all in a temporary
folder that holds a copy of the committed example report (``reports/TinyGPT-4x24GB``, which the
commands show and plot), a small stand-in for the user's ``mymodels.py``
(tests/support/readme_mymodels.py: ``Net``, ``GPT``, ``make_batch``) and a ``lengths.txt``
(one length per line, as the variable-length guide reads it). A block that reads a report
an earlier block writes (``"reports/mynet"``) runs after that block, in the same folder. Blocks
indented inside a list item count too; ```text blocks (grammars, usage) are not code.
Without a GPU, dptune falls back to the simulated cluster, as the docs say.

A block preceded by ``<!-- no-run: reason -->`` is not run (it needs GPUs or torchrun, installs
packages, or is code that is not in this project); it is reported as skipped with its reason,
and there are few of them. Each block starts an interpreter with torch and runs a search or an
estimate (15 to 45 s on two busy cores), so running them is marked slow: CI runs them, ``make
test`` checks only that the blocks are found, few are left unrun, and the README and the site's
navigation say what they must.
"""

from __future__ import annotations

import json
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
DOCS = ROOT / "docs"
#: the pages whose blocks run: the README, then the site's pages in path order
PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.relative_to(DOCS).parts)
#: the languages of code that runs; other fences (text, none) are prose
RUN_LANGS = {"python", "bash", "console"}
#: the most blocks the README and the docs may leave unrun (GPUs, torchrun, installs, others' code)
MAX_NO_RUN = 20
#: the user's files the blocks name, as a user would have them in the working directory
MYMODELS = Path(__file__).resolve().parent / "support" / "readme_mymodels.py"
LENGTHS = [20 + (i * 37) % 1000 for i in range(400)]


class Block(NamedTuple):
    page: str               # the page's path from the repository root
    line: int               # the line of its opening fence
    lang: str               # "python", "bash" or "console"
    code: str
    no_run: Optional[str]   # why it is not run, or None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}:{self.lang}"


def page_blocks(path: Path) -> list[Block]:
    """The code blocks of one page (indented ones, inside list items, dedented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = path.relative_to(ROOT).as_posix()
    out: list[Block] = []
    k = 0
    while k < len(lines):
        m = re.fullmatch(r"( *)```(\w*)\s*", lines[k])
        if m is None:
            k += 1
            continue
        indent, lang = m.group(1), m.group(2)
        close = next(j for j in range(k + 1, len(lines)) if lines[j].strip() == "```")
        if lang in RUN_LANGS:
            prev = next((lines[j].strip() for j in range(k - 1, -1, -1) if lines[j].strip()), "")
            no_run = re.fullmatch(r"<!-- no-run: (.+) -->", prev)
            code = "\n".join(line[len(indent):] for line in lines[k + 1:close]) + "\n"
            out.append(Block(page, k + 1, lang, code, no_run.group(1) if no_run else None))
        k = close + 1
    return out


BLOCKS = [b for page in PAGES for b in page_blocks(page)]


def _reports_read(code: str) -> set[str]:
    return set(re.findall(r"""["'](reports/[\w.-]+)["']""", code))


def _writer_of(block: Block) -> list[Block]:
    """The blocks that write a report folder ``block`` reads: earlier on its own page, else
    anywhere in the docs."""
    wanted = _reports_read(block.code)
    writers = [b for b in BLOCKS if b.no_run is None and b.lang == "python" and b != block
               and wanted & _reports_read(b.code) and "write_report" in b.code]
    same = [b for b in writers if b.page == block.page and b.line < block.line]
    return same or [b for b in writers if b.page != block.page][:1]


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
def test_docs_block_runs_as_printed(block, workdir):
    folder, bin_dir = workdir
    for before in _writer_of(block):
        done = _run(before, folder, bin_dir)
        assert done.returncode == 0, f"{before.name} (run first):\n{done.stderr[-3000:]}"
    done = _run(block, folder, bin_dir)
    assert done.returncode == 0, f"{block.name} exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_docs_blocks_are_found_and_few_are_left_unrun():
    langs = {b.lang for b in BLOCKS}
    assert langs == RUN_LANGS, langs
    unrun = [b for b in BLOCKS if b.no_run is not None]
    assert len(BLOCKS) >= 30 and len(unrun) <= MAX_NO_RUN, [b.name for b in unrun]
    consoles = [b for b in BLOCKS if b.lang == "console"]
    assert all(_commands(b.code).startswith("dptune ") for b in consoles), consoles
    assert all(b.no_run.strip() for b in unrun)
    # the README's own examples run: its CLI and its Python example
    assert {b.lang for b in BLOCKS if b.page == "README.md" and b.no_run is None} == {"bash", "python"}
    # a block that reads a report some block writes runs after it
    reads = [b for b in BLOCKS if b.no_run is None and "load_result" in b.code]
    assert reads and all(_writer_of(b) for b in reads)


def test_readme_is_short_and_shows_the_command_for_each_setup_early():
    """The README stays a front page: at most 250 lines, the "your setup -> the command"
    table within its first 150, with the two commands it promises (`make demo`, `make test`)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)
    head = "\n".join(lines[:150])
    table = head.split("## Your setup → the command", 1)[1].split("\n## ", 1)[0]
    for setup, command in [("DataParallel", "dptune search"), ("DDP", "dptune plan"),
                           ("too big for one card", "--strategy fsdp"),
                           ("variable-length", "--lengths"), ("fastest", "--objective throughput"),
                           ("watching a run", "MemoryMonitor")]:
        row = next((r for r in table.splitlines() if setup in r), None)
        assert row is not None and command in row, (setup, command)
    assert "make demo" in head and "make test" in head


def _nav_pages() -> set[str]:
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    return set(re.findall(r"^\s*- (?:[^:\n]+: )?([\w/.-]+\.md)\s*$", text, re.M))


def test_every_page_is_in_the_site_navigation_and_every_link_lands():
    """Every page of docs/ is in mkdocs.yml's nav (the changelog is CHANGELOG.md, added at build
    time), and the README's and the pages' relative links to .md files point at files that
    exist (`mkdocs build --strict` checks the site's links too, where mkdocs is installed)."""
    pages = {p.relative_to(DOCS).as_posix() for p in PAGES[1:]}
    assert _nav_pages() == pages | {"changelog.md"}, _nav_pages() ^ (pages | {"changelog.md"})
    for page in PAGES + [ROOT / "CHANGELOG.md"]:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([\w./-]+\.md)(?:#[\w-]+)?\)", text):
            found = (page.parent / target).resolve()
            if found == DOCS / "changelog.md":     # made from CHANGELOG.md at build time
                found = ROOT / "CHANGELOG.md"
            assert found.exists(), f"{page.relative_to(ROOT)} links to {target}: not found"


def test_report_json_reference_names_every_field_of_the_example_report():
    """docs/reference/report-json.md lists every top-level field of the committed example's
    report.json (`make example` writes it): a field added to the report needs its line."""
    page = (DOCS / "reference" / "report-json.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w.]+)` \|", page, re.M))
    report = json.loads((ROOT / "reports" / "TinyGPT-4x24GB" / "report.json").read_text())
    assert set(report) <= listed, sorted(set(report) - listed)


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
    assert ignored(".mypy_cache/3.11/dptune/__init__.meta.json")
    assert ignored("site/index.html")
