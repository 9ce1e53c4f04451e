"""benchmarks.levels: the local check of an answer at a budget level, its table, and the page
writer's reserved-level markers (pure functions on a hand-built surface; no simulator)."""

from __future__ import annotations

import csv
import io

from benchmarks import levels, readme
from dptune.types import ProbeResult

# card i >= 1 holds 10 bytes per sample, card 0 holds 10 per own sample and 1 per sample of the batch
BUDGETS = [40, 55, 75]


def surface(bump: dict[tuple[int, int], int] | None = None, calls: list | None = None):
    """A probe function: card figures from the chunks, ``bump[(card, chunk)]`` added on top."""
    bump = bump or {}

    def probe(split):
        if calls is not None:
            calls.append(tuple(split))
        b = sum(split)
        peaks = [10 * split[0] + b] + [10 * c for c in split[1:]]
        peaks = [p + bump.get((i, c), 0) for i, (p, c) in enumerate(zip(peaks, split))]
        return ProbeResult(tuple(split), tuple(peaks))
    return probe


def test_an_answer_at_every_cap_passes():
    # caps: card 1 at 5 (50 <= 55 < 60), card 2 at 7, card 0 at 2 with batch 14 (34 <= 40 < 45)
    chk = levels.local_check(surface(), BUDGETS, [2, 5, 7], proven=[1, 2])
    assert chk.fits and chk.over == (1, 2) and not chk.not_monotone and not chk.larger and chk.ok
    # one probe for the answer, one per card at one more sample, then the shifts (-2, -1, +2
    # on cards 1.. together, and on card 0)
    assert chk.probes == 1 + 3 + 3 + 3


def test_a_card_left_one_short_of_its_cap_is_not_over():
    chk = levels.local_check(surface(), BUDGETS, [2, 4, 7], proven=[1, 2])
    assert chk.fits and chk.over == (2,) and not chk.ok
    # and the batch one larger, that card given one more sample, fits as a whole
    assert chk.larger == (1,)
    # the claim where the bracket puts it (card 1 proven over at 6, the answer one short):
    # over there, and still a larger batch that fits
    chk = levels.local_check(surface(), BUDGETS, [2, 4, 7], proven=[1, 2], claim_at={1: 6, 2: 8})
    assert chk.over == (1, 2) and chk.larger == (1,) and not chk.ok
    # not claimed proven: still a larger batch that fits
    chk = levels.local_check(surface(), BUDGETS, [2, 4, 7], proven=[2])
    assert chk.over == (2,) and chk.larger == (1,) and not chk.ok


def test_a_split_over_budget_does_not_fit():
    chk = levels.local_check(surface(), BUDGETS, [2, 6, 7], proven=[2])
    assert not chk.fits and not chk.ok


def test_a_fit_above_an_over_is_flagged():
    # card 2 fits again two samples above its cap (a dip, as fragmentation can give)
    probe = surface(bump={(2, 9): -20})
    chk = levels.local_check(probe, BUDGETS, [2, 5, 7], proven=[1, 2])
    assert chk.over == (1, 2) and chk.not_monotone == ("card 2: over at 8, fits at 9",)
    assert not chk.ok


def test_card0_capped_by_its_batch_term():
    # card 0 with no samples, capped by its batch term (0 + batch <= 30): one more sample on
    # card 0 is over card 0's budget, one more on another card does not fit either
    calls: list = []
    chk = levels.local_check(surface(calls=calls), [30, 1000, 1000], [0, 15, 15], proven=[0], near=1)
    assert chk.fits and chk.over == (0,) and chk.larger == () and chk.ok
    assert {(1, 15, 15), (0, 16, 15), (0, 15, 16)} <= set(calls)
    # a budget one byte larger: card 0 is still over at one more sample of its own, but the
    # batch one larger fits with the sample on card 1 or 2
    chk = levels.local_check(surface(), [31, 1000, 1000], [0, 15, 15], proven=[0], near=1)
    assert chk.over == (0,) and chk.larger == (1, 2) and not chk.ok


def test_batchnorm_chunks_stay_valid():
    calls: list = []
    levels.local_check(surface(calls=calls), [100, 55, 75], [0, 2, 7], proven=[0, 1], m=2)
    assert all(c == 0 or c >= 2 for split in calls for c in split)
    assert (2, 2, 7) in calls        # card 0 from 0 to the smallest chunk, 2


def _csv_rows(rows: list[levels.LevelRow]) -> list[dict]:
    """Through a CSV file and back, as benchmarks.readme reads them."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0].to_csv()))
    w.writeheader()
    w.writerows(r.to_csv() for r in rows)
    return list(csv.DictReader(io.StringIO(buf.getvalue())))


def _rows() -> list[dict]:
    ok = levels.LevelRow("GPT", "4x24GB", "reserved", 256 << 20, cards=4, max_batch=738,
                         max_split=[0, 246, 246, 246], max_certified=True, max_probes=9,
                         even_batch=471, bal_split=[0, 157, 157, 157], bal_certified=True,
                         bal_probes=3, check_run=True, check_fits=True, check_proven=[0],
                         check_over=[0], check_probes=7,
                         looked_past="over throughout (12 chunks)")
    bad = levels.LevelRow("MLP", "4x24GB", "reserved", 256 << 20, cards=4, max_batch=300,
                          max_split=[60, 80, 80, 80], max_probes=12,
                          max_notes="not certified: 12 of 12 probes run", even_batch=250,
                          even_open=True, even_at_most=260, bal_split=[55, 65, 65, 65],
                          bal_probes=4, bal_certified=True, check_run=True, check_fits=True,
                          check_proven=[1, 2], check_over=[1],
                          check_not_monotone="card 3: over at 81, fits at 82", check_larger=[0],
                          exp_batch=420, exp_certified=True, exp_probes=8)
    return _csv_rows([ok, bad])


def test_level_table_marks_uncertified_unchecked_and_not_run_cases():
    rows = _rows()
    cases = [("GPT", "4x24GB"), ("MLP", "4x24GB"), ("BERT", "2x80GB,2x40GB")]
    md = levels.level_table(rows, cases)
    lines = md.splitlines()
    assert len(lines) == 2 + 3
    assert ("| GPT | 4x24GB | 471 / 738 (+57%) | yes, 9 | over throughout (12 chunks) | - | yes, 3 "
            "| yes, 1/1, none, yes |") in md
    mlp = lines[3]
    assert "250 (open, at most 260) / 300 (+15% to +20%)" in mlp   # the gain proven: a range and "**no**: not certified: 12 of 12" in mlp
    assert "1/2 (card 2 **not over**), **cards 0** (301 fits)" in mlp and "**no**: card 3: over at 81, fits at 82" in mlp
    assert "| 420, yes, 8 |" in mlp      # the expandable segments' answer the tuner advised
    assert lines[4].startswith("| BERT | 2x80GB, 2x40GB | not run |")
    s = levels.summary(rows, cases)
    assert s.startswith("2 of 3 cases run; largest batch certified in 1 of 2")
    assert "monotone near the answer) in 1 of 2" in s
    assert "with expandable_segments:True advised in 1 (certified in 1)" in s
    assert "looked past the over points in 1 (over throughout in 1)" in s
    assert s.endswith("not run: 1.")


def test_readme_writes_the_reserved_table_between_its_own_markers(tmp_path):
    page = tmp_path / "benchmarks.md"
    start, end = readme.markers("reserved")
    page.write_text(f"# B\n{readme.START}\nallocated table\n{readme.END}\ntext\n{start}\nold\n{end}\ntail\n")
    readme.update(page, _rows(), "reserved")
    text = page.read_text()
    assert "allocated table" in text and "old" not in text and text.endswith(f"{end}\ntail\n")
    inside = text.split(start)[1].split(end)[0]
    assert "| GPT | 4x24GB | 471 / 738 (+57%)" in inside
    assert inside.count("not run") >= len(levels.all_cases()) - 2


def test_looked_words_says_what_the_look_past_found():
    from dptune.types import CardWindow, WindowCheck
    closed = WindowCheck((CardWindow(0, 561, 564), CardWindow(1, 569, 573)))
    assert levels.looked_words(closed) == "over throughout (7 chunks)"
    mixed = WindowCheck((CardWindow(0, 561, None, scaled=False), CardWindow(1, 569, None, fits=571),
                         CardWindow(2, 569, None)))
    assert levels.looked_words(mixed) == ("card 1 fits again at 571; card 0 not looked at; "
                                          "card 2 looked at only so far")
    assert levels.looked_words(None) == ""
