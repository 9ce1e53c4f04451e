"""report.html in a real browser: headless Chromium (Debian's ``chromium`` package) loads the
page from disk with the network left out, logs no console message (the detector is checked
on a page that does throw), keeps the split and the budget in its rendered DOM, and draws the
bars and the budget lines (their colours are in the screenshot). The screenshot is kept for a
person to look at: its path is printed (``pytest -s`` shows it), and the simulated cluster's
lands in ``reports/_scratch/report-html.png`` (git-ignored).

Skipped only when no Chromium is installed (``apt-get install -y chromium``).
"""

from __future__ import annotations

import dataclasses
import html
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dptune.report.html import render_result_html
from dptune.report.html_svg import COLORS
from tests.report.test_plots import cards
from tests.report.test_report import make_result
from tests.report.test_report_levels import reserved_result

ROOT = Path(__file__).resolve().parents[2]
BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless Chromium installed "
                                "(apt-get install -y chromium); the page is checked in a browser")

TINY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=1024, depth=2):
        super().__init__()
        self.width = width
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x):
        return self.layers(x)

    def sample(self, batch_size):
        return torch.randn(batch_size, self.width)
'''


def chromium(page: Path, tmp: Path, *, shot: Path | None = None, height: int = 1600
             ) -> tuple[str, list[str]]:
    """Load ``page`` headless, offline; its DOM (or nothing, when taking ``shot``) and the
    console messages Chromium logged (``INFO:CONSOLE`` lines: errors, uncaught exceptions,
    resources that failed to load)."""
    args = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp / 'chromium-profile'}",
            "--proxy-server=127.0.0.1:9", "--hide-scrollbars", f"--window-size=1100,{height}"]
    args += [f"--screenshot={shot}"] if shot is not None else ["--dump-dom"]
    proc = subprocess.run([*args, page.resolve().as_uri()], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console


def colour_pixels(png: Path, hex_colour: str) -> int:
    """Pixels of ``png`` within a few levels of ``hex_colour``."""
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(str(png))[..., :3]
    want = np.array([int(hex_colour[k:k + 2], 16) for k in (1, 3, 5)]) / 255
    return int((np.abs(img - want).max(axis=-1) < 0.04).sum())


def check_page(page: Path, tmp: Path, split: list[int], budget_text: str, shot: Path) -> None:
    dom, console = chromium(page, tmp)
    assert console == [], console
    facts = dict(re.findall(r'data-fact="([^"]+)">[^<]*<b>([^<]*)</b>', dom))
    assert html.unescape(facts["split"]) == str(split)
    assert html.unescape(facts["budget"]) == budget_text
    _, console = chromium(page, tmp, shot=shot)
    assert console == [], console
    print(f"\nscreenshot of {page}: {shot}")
    assert shot.stat().st_size > 10_000
    for what in ("allocated", "budget"):    # the bars and the budget lines were drawn
        assert colour_pixels(shot, COLORS[what]) > 50, what


def test_the_console_detector_sees_a_broken_page(tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><script>throw new Error('boom')</script></body></html>")
    _, console = chromium(bad, tmp_path)
    assert any("Uncaught Error: boom" in line for line in console)


@pytest.mark.slow
def test_a_reserved_level_page_and_a_256_card_page_in_chromium(tmp_path):
    r = reserved_result("max_batch")
    page = tmp_path / "report.html"
    page.write_text(render_result_html(r), encoding="utf-8")
    lo = min(r.budget_bytes)
    from dptune.units import format_bytes

    budget = format_bytes(lo) + " per card" if lo == max(r.budget_bytes) else \
        f"{format_bytes(lo)} to {format_bytes(max(r.budget_bytes))} per card"
    check_page(page, tmp_path, r.chunk_sizes, budget, tmp_path / "reserved.png")

    many = cards(make_result("balance"), 256)
    many = dataclasses.replace(many, chunk_sizes=list(many.chunk_sizes))
    page256 = tmp_path / "report256.html"
    page256.write_text(render_result_html(many), encoding="utf-8")
    dom, console = chromium(page256, tmp_path)
    assert console == []
    assert len(re.findall(r'<g class="row card"', dom)) == 256


@pytest.mark.slow
def test_a_search_on_the_simulated_cluster_opens_in_chromium(tmp_path):
    """The whole path: `dptune search` writes report.html, Chromium opens it."""
    (tmp_path / "tinymod.py").write_text(TINY)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(tmp_path)]))
    out = tmp_path / "rep"
    proc = subprocess.run([sys.executable, "-m", "dptune", "search", "--model", "tinymod:Net",
                           "--batch-size", "4096", "--simulate", "2x8GB,1x4GB", "--max-probes",
                           "6", "--out", str(out), "--quiet"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    from dptune.report import read_report
    from dptune.units import format_bytes

    r = read_report(out)
    keep = ROOT / "reports" / "_scratch"
    keep.mkdir(parents=True, exist_ok=True)
    budgets = sorted(set(r.budget_bytes))
    check_page(out / "report.html", tmp_path, r.chunk_sizes,
               f"{format_bytes(budgets[0])} to {format_bytes(budgets[-1])} per card",
               keep / "report-html.png")
