"""One-way imports in the bottom layers: types, the backends' protocol, cluster specs and
the backends themselves import nothing above them (read from the source, imports inside
functions included)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import dptune

ROOT = pathlib.Path(dptune.__file__).parent
#: what sits above the backends: the search, the planners, the result and its rendering, the CLI
ABOVE_BACKENDS = ("dptune.tuner", "dptune.cli", "dptune.result.model", "dptune.report", "dptune.search",
                  "dptune.ddp", "dptune.integrations", "dptune.lengths", "dptune.solve.memory")


def dptune_imports(path: pathlib.Path) -> set[str]:
    """Every dptune module a file imports, at any depth of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dptune")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dptune"):
            # from dptune.step import tree: the module dptune.step.tree (a package's submodule)
            subs = {f"{node.module}.{a.name}" for a in node.names
                    if (ROOT.parent / f"{node.module}.{a.name}".replace(".", "/")).with_suffix(".py").exists()}
            if node.module == "dptune":   # from dptune import errors
                found |= {f"dptune.{a.name}" for a in node.names}
            else:
                found |= subs or {node.module}
    return found


def under(names: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


BACKEND_FILES = sorted((ROOT / "backends").rglob("*.py"))


@pytest.mark.parametrize("path", BACKEND_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_backends_import_nothing_above_them(path):
    assert under(dptune_imports(path), ABOVE_BACKENDS) == set()


@pytest.mark.parametrize("path", BACKEND_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_two_backends_do_not_import_each_other(path):
    rel = path.relative_to(ROOT / "backends").parts
    names = dptune_imports(path)
    if rel[0] == "simulated":
        assert under(names, ("dptune.backends.cuda",)) == set()
    if rel[0] == "cuda":
        assert under(names, ("dptune.backends.simulated",)) == set()


def test_the_bottom_modules_stay_at_the_bottom():
    assert dptune_imports(ROOT / "types.py") == {"dptune.errors"}     # StepTime lives here too
    # the one card table, and the speeds and time model read from it: nothing of dptune above units
    assert dptune_imports(ROOT / "hardware" / "cards.py") == {"dptune.units"}
    assert dptune_imports(ROOT / "hardware" / "speeds.py") == {"dptune.hardware.cards"}
    assert dptune_imports(ROOT / "backends" / "base.py") == {"dptune.types"}
    assert dptune_imports(ROOT / "hardware" / "cluster.py") == {
        "dptune.types", "dptune.errors", "dptune.units", "dptune.hardware.speeds", "dptune.hardware.cards"}
    # (the table of `dptune devices` is rendered above, in dptune.cli.devices)
    assert dptune_imports(ROOT / "hardware" / "devices.py") == {"dptune.hardware.nvml"}
