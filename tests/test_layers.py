"""The arrows drawn from the imports of the result, its renderer and the wrapper (issue 21):
every ``import`` counts, at module level or inside a function (a lazy import is an arrow too),
except those under ``if TYPE_CHECKING:``, which only type-checkers follow.

- ``dptune.result.model`` (the data) never imports ``dptune.report`` (its renderer) nor the CLI; its
  figures, its checked reader and its model wrapping sit below it and never import it;
- ``dptune.parallel`` (the wrapper, below the backends) imports nothing that reads reports:
  neither the result, the report, the workload, the tuner nor the CLI;
- ``dptune.report``'s text and plots import the result for typing only;
- no circle among these modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dptune"


def module_file(module: str) -> Path:
    path = PACKAGE.parent / Path(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"))


def imports(module: str) -> set[str]:
    """The dptune modules ``module`` imports anywhere in its code, TYPE_CHECKING blocks aside."""
    tree = ast.parse(module_file(module).read_text(encoding="utf-8"))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _type_checking_block(node):
            for child in getattr(node, "orelse", []):
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m.startswith("dptune") and
            (module_file(m).exists() or m == "dptune")}


def test_the_parser_sees_lazy_imports_and_skips_type_checking():
    found = imports("dptune.result.wrap")
    assert "dptune.parallel" in found          # wrap_model's lazy import (downward: fine)
    assert "dptune.step.workload" in found
    assert "dptune.result.model" not in found        # only under TYPE_CHECKING there
    text = imports("dptune.report.text")
    assert "dptune.result.model" not in text         # only under TYPE_CHECKING there


@pytest.mark.parametrize("module, forbidden", [
    ("dptune.result.model", ["dptune.report", "dptune.cli", "dptune.tuner"]),
    ("dptune.result.figures", ["dptune.result.model", "dptune.report", "dptune.cli", "dptune.tuner"]),
    ("dptune.result.read", ["dptune.result.model", "dptune.result.wrap", "dptune.report", "dptune.cli",
                            "dptune.tuner"]),
    ("dptune.result.wrap", ["dptune.result.model", "dptune.result.read", "dptune.report", "dptune.cli",
                            "dptune.tuner"]),
    ("dptune.parallel", ["dptune.result.model", "dptune.report", "dptune.step.workload", "dptune.tuner",
                         "dptune.cli"]),
    ("dptune.report.text", ["dptune.result.model", "dptune.cli", "dptune.tuner"]),
    ("dptune.report.plots", ["dptune.result.model", "dptune.cli", "dptune.tuner"]),
    ("dptune.report.files", ["dptune.cli", "dptune.tuner"]),
])
def test_no_arrow_up(module, forbidden):
    found = imports(module)
    assert [m for m in found if any(m == f or m.startswith(f + ".") for f in forbidden)] == []


def test_no_circle_among_result_report_parallel_and_integrations():
    nodes = ["dptune.result.model", "dptune.result.figures", "dptune.result.read", "dptune.result.wrap",
             "dptune.parallel", "dptune.report", "dptune.report.text",
             "dptune.report.plots", "dptune.report.files",
             "dptune.integrations.transformers", "dptune.integrations.trainer_lengths",
             "dptune.integrations.trainer_buckets", "dptune.integrations.trainer_workload",
             "dptune.integrations.dataparallel"]
    edges = {n: {m for m in imports(n) if m in nodes and m != n} for n in nodes}

    def reaches(start: str, goal: str, seen: frozenset = frozenset()) -> bool:
        return any(m == goal or (m not in seen and reaches(m, goal, seen | {m}))
                   for m in edges[start])

    assert [n for n in nodes if reaches(n, n)] == []


def test_the_cli_is_on_top():
    """Only ``python -m dptune`` imports the command line; its modules import one another one
    way (the app on the subcommands, the subcommands on the shared flags)."""
    cli_modules = sorted(f"dptune.cli.{p.stem}" for p in (PACKAGE / "cli").glob("*.py")
                         if p.stem not in ("__init__", "__main__"))
    importers = [f"dptune.{'.'.join(p.relative_to(PACKAGE).with_suffix('').parts)}"
                 for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts[:1]]
    up = {m: [x for x in imports(m) if x == "dptune.cli" or x.startswith("dptune.cli.")]
          for m in importers if m not in ("dptune.__main__",)}
    assert {m: found for m, found in up.items() if found} == {}
    below_app = [m for m in cli_modules if m != "dptune.cli.app"]
    assert [m for m in below_app if "dptune.cli.app" in imports(m)] == []
    # the shared flags sit on the flags' types and checks (cli.checks), nothing else of the CLI
    assert [m for m in cli_modules if m not in ("dptune.cli.arguments", "dptune.cli.checks")
            and m in imports("dptune.cli.arguments")] == []
    assert [m for m in cli_modules if m in imports("dptune.cli.checks")] == []
