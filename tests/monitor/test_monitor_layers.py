"""The monitor's place among the layers: the data and the monitor below rendering, the CLI
and the integrations; rendering (report.timeline) never imports the monitor's machinery;
``dptune.MemoryMonitor`` is cheap to import (no torch, NVML, matplotlib)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_layers import imports

UP = ["dptune.report", "dptune.cli", "dptune.integrations", "dptune.tuner"]


@pytest.mark.parametrize("module", ["dptune.monitor", "dptune.monitor.monitor", "dptune.monitor.cards",
                                    "dptune.monitor.expect", "dptune.monitor.events",
                                    "dptune.monitor.record", "dptune.monitor.forensics"])
def test_the_monitor_imports_nothing_above_it(module):
    found = imports(module)
    assert not [m for m in found if any(m == u or m.startswith(u + ".") for u in UP)], found


def test_the_timeline_renderer_reads_the_record_for_typing_only():
    found = imports("dptune.report.timeline")
    assert not [m for m in found if m.startswith(("dptune.monitor", "dptune.cli"))], found


def test_the_monitor_reads_cards_through_one_runtime_import():
    """The runtime protocol's one link to the card readers (the CUDA runtime, in
    dptune/hardware/ beside NVML, where the CUDA backend reads cards too), and none to the
    CUDA backend itself."""
    modules = ("dptune.monitor.monitor", "dptune.monitor.cards", "dptune.monitor.expect",
               "dptune.monitor.events", "dptune.monitor.record", "dptune.monitor.forensics")
    users = [m for m in modules if any(i.startswith("dptune.hardware.runtime") for i in imports(m))]
    assert users == ["dptune.monitor.cards"]
    assert [m for m in modules if any(i.startswith("dptune.backends.cuda") for i in imports(m))] == []


def test_the_monitor_is_cheap_to_import():
    code = ("import json, sys, dptune; dptune.MemoryMonitor; "
            "print(json.dumps([m for m in ('torch', 'pynvml', 'matplotlib', 'pandas', 'transformers') "
            "if m in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
