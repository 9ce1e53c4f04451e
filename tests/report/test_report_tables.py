"""The one table renderer (dptune.report.tables), against tables written out by hand, and the
package's tables that use it (issue 21: no hand-written column padding left)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dptune.report.tables import Align, markdown_table, text_table

L, R = Align.LEFT, Align.RIGHT
PACKAGE = Path(__file__).resolve().parents[2] / "dptune"


def test_text_table_pads_to_the_widest_cell():
    lines = text_table(["card", "batch", "peak"], [["A100", "7", "1.5 GiB"], ["T4", "120", ""]],
                       [L, R, R])
    assert lines == ["card  batch     peak",
                     "A100      7  1.5 GiB",
                     "T4      120"]          # no trailing spaces after an empty last cell


def test_text_table_rule_and_default_left():
    assert text_table(["a", "bb"], [["xyz", "1"]], rule=True) == ["a    bb",
                                                                  "---  --",
                                                                  "xyz  1"]
    assert text_table(["n"], []) == ["n"]


def test_markdown_table():
    assert markdown_table(["#", "split"], [["1", "[3, 4]"]], [R, L]) == [
        "| # | split |", "|---:|---|", "| 1 | [3, 4] |"]
    assert markdown_table(["a", "b"], [])[1] == "|---|---|"


def test_one_alignment_per_column():
    with pytest.raises(ValueError, match="1 alignments for 2 columns"):
        text_table(["a", "b"], [], [L])


def test_ddp_plan_and_devices_tables_line_up():
    from dptune.ddp.result import DDPPlan, RankPlan
    from dptune.cli.devices import GpuInfo, format_devices
    from dptune.types import Device

    GiB = 2**30
    plan = DDPPlan(ranks=(RankPlan(0, 12, 0.5, device=Device(0, "A10", 24 * GiB), budget_bytes=20 * GiB),
                          RankPlan(1, 120, 1.25)))
    assert plan.table().splitlines() == [
        "rank  batch  loss scale  card    budget  predicted  measured  share",
        "----  -----  ----------  ----  --------  ---------  --------  -----",
        "   0     12      0.5000  A10   20.0 GiB",
        "   1    120      1.2500"]
    assert format_devices([GpuInfo(0, "H100", 80 * GiB, 3 * GiB, "GPU-1"),
                           GpuInfo(11, "A10", 24 * GiB, None, None)]).splitlines() == [
        "index  name  total     used     uuid",
        "0      H100  80.0 GiB  3.0 GiB  GPU-1",
        "11     A10   24.0 GiB  n/a      n/a",
        "used: n/a where NVML cannot say (see the warning, if any)"]


def test_no_hand_written_table_left_in_the_package():
    """No ``ljust``/``rjust`` padding and no ``" | ".join`` rows outside the renderer."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "tables.py" and path.parent.name == "report":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("ljust", "rjust"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} .{node.attr}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "join" and isinstance(node.func.value, ast.Constant)
                  and node.func.value.value in (" | ", "|")):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.func.value.value!r}.join")
    assert found == []
