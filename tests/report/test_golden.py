"""The text renderers' whole output for fixed hand-made results (test_report.make_result):
the terminal table and summary.md, for both objectives, with an even split implied by a
probe and one that ran out of memory, and a balance at the reserved budget level (the
three figures per card). Rewrite with DPTUNE_UPDATE_GOLDEN=1 (tests/support/golden_check.py)."""

from __future__ import annotations

import dataclasses

import pytest

from dptune.report import render_summary, render_table
from dptune.search.observations import Bracket
from golden_check import assert_golden
from tests.report.test_report import make_result
from tests.report.test_report_levels import reserved_result


def certified(r):
    """``r`` with closed brackets, as a finished search leaves them."""
    brackets = [Bracket(card=i, lo=c, hi=c + 1) for i, c in enumerate(r.chunk_sizes)]
    return dataclasses.replace(r, certified=True, brackets=brackets)


CASES = {
    "balance": lambda: make_result("balance"),
    "max_batch": lambda: certified(make_result("max_batch")),
    "max_batch_implied_even": lambda: dataclasses.replace(
        make_result("max_batch"), even=dataclasses.replace(make_result("max_batch").even,
                                                           implied_by=(4,))),
    "balance_even_oom": lambda: dataclasses.replace(
        make_result("balance"), even=dataclasses.replace(make_result("balance").even,
                                                         feasible=False, oom_device=0)),
    "balance_reserved": lambda: reserved_result("balance"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_render_table_golden(case):
    assert_golden(f"table_{case}.txt", render_table(CASES[case]()) + "\n")


@pytest.mark.parametrize("case", list(CASES))
def test_render_summary_golden(case):
    assert_golden(f"summary_{case}.md", render_summary(CASES[case]()))
