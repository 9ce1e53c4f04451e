"""The tests' layout mirrors the package's (tests/backends/ for dptune/backends/, ...), one
package per folder, so two test files may share a base name and import each other by their
full name (``from tests.report.test_report import make_result``).

The helpers that several folders use (oracles, the gloo workers, the golden and plot checks,
small models) live in tests/support/, which is put on ``sys.path`` here, before any test
module is imported: ``import oracles`` works from every folder, and the spawned worker
processes, which get the parent's ``sys.path``, import ``ddp_workers`` the same way."""

from __future__ import annotations

import sys
from pathlib import Path

SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
