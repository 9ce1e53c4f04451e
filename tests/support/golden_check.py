"""Golden text files (tests/report/golden/*): the renderers' whole output, compared line by line.

``DPTUNE_UPDATE_GOLDEN=1 pytest tests/report/test_golden.py`` rewrites them from the current code;
read the diff (``git diff tests/report/golden``) before committing it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parents[1] / "report" / "golden"
UPDATE = os.environ.get("DPTUNE_UPDATE_GOLDEN") == "1"


def assert_golden(name: str, text: str) -> None:
    """``text`` equals tests/report/golden/``name`` (or rewrites it when DPTUNE_UPDATE_GOLDEN=1)."""
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"{path} is missing: run with DPTUNE_UPDATE_GOLDEN=1 to write it"
    want = path.read_text(encoding="utf-8")
    if text != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), text.splitlines(),
                                              f"golden/{name}", "rendered", lineterm=""))
        raise AssertionError(f"rendered text differs from golden/{name} "
                             f"(DPTUNE_UPDATE_GOLDEN=1 rewrites it):\n{diff}")
