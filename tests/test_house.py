"""The house's shape (issue 34): the top of ``dptune/`` reads as its layers, bottom-up.

Read from the source (imports inside functions count; ``TYPE_CHECKING`` blocks are for the
type checker only and do not): each top-level module or package imports only what sits on
its own floor or below; at most 16 loose modules sit at the top; private torch API lives in
``dptune/_torch_private.py`` alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dptune"

#: bottom-up; a unit imports units of its floor or below (a floor's units may import each other)
FLOORS: list[tuple[str, ...]] = [
    ("errors", "units", "split", "_torch_private", "_lazy"),
    ("types",),                          # Device, ProbeResult, StepTime, the enums
    ("hardware", "budget"),              # the card table and card readers; the budget policy
    ("checkpoint", "solve"),             # pure arithmetic: memory and time fits, integer splits
    ("step",),                           # the user's training step, described once
    ("parallel",),                       # BalancedDataParallel
    ("backends",),                       # simulated/ and cuda/ behind one protocol
    ("settings", "search"),
    ("result",),
    ("report",),
    ("ddp",),
    ("lengths",),
    ("tuner", "monitor"),
    ("integrations",),
    ("cli",),
    ("__main__",),
]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imported_units(path: Path) -> set[str]:
    """The top-level units of dptune a file imports (``dptune.step.spec`` -> ``step``)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking(node):
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            if node.module == "dptune":
                names = [f"dptune.{a.name}" for a in node.names]
        found.update(n.split(".")[1] for n in names if n.startswith("dptune."))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def unit_of(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if unit_of(p) not in ("__init__", "examples"))


def test_every_unit_has_a_floor():
    units = {unit_of(p) for p in SOURCES}
    assert sorted(units - set(FLOOR)) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down_the_floors(path):
    me = unit_of(path)
    up = sorted(u for u in imported_units(path) - {me}
                if u in FLOOR and FLOOR[u] > FLOOR[me])
    assert up == [], f"{path.relative_to(PACKAGE)} ({me}, floor {FLOOR[me]}) imports from above: {up}"


def test_the_top_level_is_short():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 16, loose


def test_the_budget_policy_has_one_home():
    """BudgetLevel, the default level and headroom, at_level: defined in dptune/budget.py
    alone, and imported from there (the simulator's reserved model re-exports nothing)."""
    defined = re.compile(r"^(class BudgetLevel|DEFAULT_LEVEL =|DEFAULT_HEADROOM =|def at_level|"
                         r"def parse_level)", re.M)
    homes = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if defined.search(p.read_text(encoding="utf-8")))
    assert homes == ["budget.py"]


def test_private_aten_ops_only_in_torch_private():
    pattern = re.compile(r"torch\.ops\.aten\._\w")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name != "_torch_private.py" and pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
