"""A monitored run's report.html (``dptune show RUN``): the committed example run rendered as
one offline page with a chart per card (its peaks, the plan's prediction, the budget) and
every event in a table; opened in headless Chromium where it is installed."""

from __future__ import annotations

import html
import re
import shutil
from pathlib import Path

import pytest

from dptune.cli import main
from dptune.monitor.record import load_run
from dptune.report.html_run import render_run_html
from dptune.units import format_bytes
from tests.report.test_html_browser import BROWSER, chromium

EXAMPLE = Path(__file__).resolve().parents[2] / "reports" / "monitor-example"


def test_the_example_run_page_shows_every_card_and_event():
    record = load_run(str(EXAMPLE))
    text = render_run_html(record)
    # offline: no script, nothing fetched (the SVG namespace is a name, not a request)
    assert "<script" not in text and not re.search(r'(src|href)="https?:', text)
    for card in record.cards:
        assert html.escape(f"{card.label}: {card.name}") in text
        if card.budget_bytes is not None:
            assert html.escape(f"budget {format_bytes(card.budget_bytes)}") in text
    # one row per event in the table, each with its step and kind
    table = text[text.index('id="events"'):]
    rows = re.findall(r"<tr><td[^>]*>(\d+)</td><td[^>]*>[^<]*</td><td[^>]*>(\w+)</td>", table)
    assert [(int(s), k) for s, k in rows] == [(ev.step, ev.kind.value) for ev in record.events]
    assert record.events, "the example run records at least one event"


def test_show_run_writes_the_page_beside_the_timeline(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(EXAMPLE, run)
    (run / "report.html").unlink(missing_ok=True)
    assert main(["show", str(run)]) == 0
    out = capsys.readouterr().out
    assert (run / "report.html").exists() and f"wrote {run / 'report.html'}" in out
    assert (run / "timeline.png").exists()


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (apt-get install -y chromium)")
def test_the_run_page_opens_in_chromium_without_a_console_message(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(render_run_html(load_run(str(EXAMPLE))), encoding="utf-8")
    dom, console = chromium(page, tmp_path)
    assert console == [], console
    assert dom.count('class="chart"') == len(load_run(str(EXAMPLE)).cards)
