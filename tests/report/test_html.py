"""report.html (dptune.report.html): one self-contained page per report kind, read back with
the standard library's HTML parser. The bars are checked against the probe's own figures
(allocated, reserved, and the fixed costs up to the peak the budget was checked on), in the
SVG's pixels as drawn: a card at 100% of its budget ends on its budget line."""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser

import pytest

from dptune.ddp.result import DDPPlan, RankPlan, RankProbe
from dptune.lengths.plan import BucketPlan, LengthPlan
from dptune.report.html import Section, card_rows, render_result_html
from dptune.report.html_plans import render_lengths_html, render_plan_html
from dptune.report.levels import split_memory
from dptune.types import Device
from dptune.units import GiB, MiB
from tests.report.test_plots import cards
from tests.report.test_report import make_result
from tests.report.test_report_levels import best_probe, reserved_result

VOID = {"meta", "br", "img", "input", "link", "hr"}


class Page(HTMLParser):
    """The elements of a page, with a check that every element is closed in order."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.elements: list[tuple[str, dict[str, str], list[str]]] = []   # tag, attrs, ancestors
        self.text: list[str] = []
        self.feed(text)
        self.close()
        assert not self.stack, f"unclosed elements: {self.stack}"

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}, list(self.stack)))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}, list(self.stack)))

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag: str, cls: str = "") -> list[dict[str, str]]:
        return [a for t, a, _ in self.elements
                if t == tag and (not cls or cls in a.get("class", "").split())]


def self_contained(text: str) -> None:
    """Nothing fetched and no script: no src/href to anything, no <script>, no @import."""
    p = Page(text)
    assert not p.find("script") and not p.find("link") and not p.find("img")
    assert "@import" not in text and "url(http" not in text
    for _, attrs, _ in p.elements:
        for k, v in attrs.items():
            assert k not in ("src", "href") and not k.startswith("on"), (k, v)
    assert set(re.findall(r'https?://[^"\s]*', text)) <= {"http://www.w3.org/2000/svg"}  # a name


def row_geometry(text: str) -> list[dict]:
    """Per card row of the memory bars (in document order): its data, the end in pixels of
    its main bar's last segment, and the x of its budget line and total-use tick."""
    rows = []
    for m in re.finditer(r'<g class="row card"([^>]*)>(.*?)</g>', text, re.S):
        data = dict(re.findall(r'data-(\w+)="([^"]*)"', m.group(1)))
        body = m.group(2)
        segs = re.findall(r'<rect class="seg ([\w-]+)" x="([\d.]+)" y="([\d.]+)" '
                          r'width="([\d.]+)"', body)
        main_y = min(float(y) for _, _, y, _ in segs)
        main = [(c, float(x), float(w)) for c, x, y, w in segs if float(y) == main_y]
        budget = re.search(r'<line class="budget" x1="([\d.]+)"', body)
        total = re.search(r'<line class="total" x1="([\d.]+)"', body)
        rows.append(dict(data=data, segments=main, end=main[-1][1] + main[-1][2],
                         start=main[0][1], budget_x=float(budget.group(1)),
                         total_x=float(total.group(1)) if total else None))
    return rows


@pytest.mark.parametrize("objective", ["balance", "max_batch"])
def test_a_search_page_is_self_contained_with_every_section(objective):
    r = reserved_result(objective)
    text = render_result_html(r)
    self_contained(text)
    ids = [a["id"] for a in Page(text).find("section")]
    expected = ["overview", "cards"] + (["max-batch"] if objective == "max_batch" else []) + \
        ["fits", "probes", "advice"]
    assert ids == expected
    assert f"split: <b>{r.chunk_sizes}</b>" in text
    assert len(row_geometry(text)) == 4


def test_the_bars_are_the_probes_figures_at_every_level():
    """allocated, reserved - allocated, peak - reserved (NCCL's buffers: the fixed costs) end
    where the peak the budget checked ends; the total use tick on the card's memory."""
    r = reserved_result("balance")
    p = best_probe(r)
    for i, row in enumerate(card_rows(r)):
        sizes = {s.css: s.size for s in row.segments}
        assert sizes["seg-allocated"] == p.allocated_peak_bytes[i]
        assert sizes["seg-allocated"] + sizes["seg-reserved"] == p.reserved_bytes[i]
        assert sum(sizes.values()) == r.peak_bytes[i] == p.peak_bytes[i]
        assert sizes.get("seg-fixed", 0) == p.peak_bytes[i] - p.reserved_bytes[i]
        marks = {m.css: m.at for m in row.marks}
        assert marks == {"budget": r.budget_bytes[i], "total": p.total_bytes[i]}
        assert row.track == r.devices[i].total_bytes   # total use is read against the card


def test_a_card_at_its_whole_budget_reaches_the_budget_line_in_the_svg():
    r = reserved_result("balance")
    # the budget of card 1 set to its peak: 100% of it
    budgets = list(r.budget_bytes)
    budgets[1] = r.peak_bytes[1]
    r = dataclasses.replace(r, budget_bytes=budgets)
    geo = row_geometry(render_result_html(r))
    px_per_byte = (geo[0]["end"] - geo[0]["start"]) / r.peak_bytes[0]
    assert geo[1]["end"] == pytest.approx(geo[1]["budget_x"], abs=0.2)
    assert [c for c, _, _ in geo[1]["segments"]] == ["seg-allocated", "seg-reserved", "seg-fixed"]
    for i, g in enumerate(geo):   # every bar ends at its peak, every tick at its total use
        assert g["end"] - g["start"] == pytest.approx(r.peak_bytes[i] * px_per_byte, abs=0.2)
        total = split_memory(r, r.chunk_sizes, r.peak_bytes)[i].total_bytes
        assert g["total_x"] - g["start"] == pytest.approx(total * px_per_byte, abs=0.2)
        assert int(g["data"]["budget"]) == budgets[i]


def test_at_the_allocated_level_the_bar_is_the_peak():
    r = make_result("balance")
    r = dataclasses.replace(r, probes=[dataclasses.replace(p, reserved_bytes=None)
                                       for p in r.probes])
    for i, row in enumerate(card_rows(r)):
        assert [(s.css, s.size) for s in row.segments] == [("seg-peak", r.peak_bytes[i])]
        assert [m.css for m in row.marks] == ["budget"]


def test_user_text_is_escaped():
    evil = '<script>alert("x")</script>&'
    r = dataclasses.replace(reserved_result("balance"), model_name=evil, cluster=evil,
                            advice=[evil], notes=[evil])
    text = render_result_html(r)
    self_contained(text)
    assert "<script" not in text
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;" in text


def test_256_cards_one_row_each_in_a_scrolling_box():
    r = cards(make_result("max_batch"), 256)
    text = render_result_html(r)
    self_contained(text)
    geo = row_geometry(text)
    assert [int(g["data"]["card"]) for g in geo] == list(range(256))
    assert [int(g["data"]["chunk"]) for g in geo] == r.chunk_sizes
    p = Page(text)
    scrolled = [anc for t, a, anc in p.elements if t == "svg" and "bars" in a.get("class", "")]
    assert scrolled and "div" in scrolled[0]          # inside <div class="scroll">
    assert len(text) < 1_500_000
    one = render_result_html(cards(make_result("balance"), 1))
    self_contained(one)
    assert len(row_geometry(one)) == 1


def test_a_page_is_a_list_of_sections_another_part_can_extend():
    r = make_result("balance")
    text = render_result_html(r, extra=[Section("timeline", "Training timeline", "<p>t</p>")])
    ids = [a["id"] for a in Page(text).find("section")]
    assert ids[-1] == "timeline" and ids[0] == "overview"


def test_throughput_shows_step_time_per_timed_split():
    from dptune.types import StepTime, TimeSource

    r = make_result("balance")
    times = [0.030, 0.020, 0.025]
    probes = [dataclasses.replace(p, time=StepTime((t,) * 4, t, TimeSource.ESTIMATED))
              for p, t in zip(r.probes, times)]
    r = dataclasses.replace(r, objective="throughput", probes=probes)
    text = render_result_html(r)
    self_contained(text)
    assert 'id="step-time"' in text
    drawn = re.findall(r'probe (\d+): ([\d.]+) ms \((\w[\w ]*)\)', text)
    assert [(int(k), float(ms)) for k, ms, _ in drawn] == [(1, 30.0), (2, 20.0), (3, 25.0)]
    assert drawn[2][2] == "chosen"   # probe 3 is the split the result holds


def _plan(strategy_note: bool) -> DDPPlan:
    dev = [Device(index=i, name="24GB", total_bytes=24 * GiB) for i in range(2)]
    ranks = tuple(RankPlan(rank=r, batch_size=b, loss_scale=2 * b / 30, device=dev[r],
                           budget_bytes=20 * GiB, predicted_peak_bytes=(10 + r) * GiB,
                           ddp_bytes=512 * MiB) for r, b in enumerate((14, 16)))
    probes = tuple(RankProbe(rank=r, batch_size=b, peak_bytes=GiB * b // 2, fits=True,
                             seconds=0.001 * b) for r in (0, 1) for b in (8, 14, 16))
    notes = ("strategy fsdp: FSDP2: fully_shard on each ModuleList block then the root, "
             "reshard_after_forward=True (the DDP bucket settings do not apply)",) \
        if strategy_note else ()
    return DDPPlan(ranks=ranks, objective="throughput", backend="simulated", cluster="2x24GB",
                   model_name="Net", probes=probes, notes=notes)


@pytest.mark.parametrize("fsdp", [False, True])
def test_a_ddp_or_fsdp2_plan_page_names_its_strategy(fsdp):
    plan = _plan(fsdp)
    text = render_plan_html(plan)
    self_contained(text)
    name = "FSDP2" if fsdp else "DDP"
    assert f"<h1>dptune {name} plan: Net on 2x24GB</h1>" in text
    assert plan.summary().splitlines()[0] == f"{name} plan: Net on 2x24GB"
    assert ("DDP: buckets of" in plan.summary()) is not fsdp
    geo = row_geometry(text)
    assert [int(g["data"]["chunk"]) for g in geo] == [14, 16]
    assert 'id="step-time"' in text


def test_a_length_plan_page_draws_every_card_apart():
    buckets = (BucketPlan(0, 128, 50, (40, 40), (10 * GiB, 10 * GiB), 0, True, 5),
               BucketPlan(128, 512, 20, (10, 10), (10 * GiB, 10 * GiB), 1, True, 4))
    plan = LengthPlan(buckets=buckets, devices=("24GB", "24GB"), budget_bytes=(20 * GiB,) * 2,
                      cluster="2x24GB", model_name="Net")
    text = render_lengths_html(plan)
    self_contained(text)
    steps = re.findall(r'<polyline class="series steps" data-label="([^"]+)" points="([^"]+)"',
                       text)
    assert [label for label, _ in steps] == ["card 0 (24GB)", "card 1 (24GB)"]
    assert steps[0][1] != steps[1][1]       # identical cards, drawn one beside the other
    assert "(128, 512]" in text
