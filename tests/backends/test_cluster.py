"""The cluster spec lives below the simulator: parsing ``'4x24GB'`` imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from dptune.backends import simulated
from dptune.hardware import cluster
from dptune.units import GiB, MiB


def run_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_parsing_a_spec_imports_no_torch():
    info = run_python("""
        import json, sys
        from dptune.hardware.cluster import parse_cluster
        c = parse_cluster("2xA100-80GB,2x40GB,used=0:6GB")
        d = c.devices
        import dptune
        dptune.parse_cluster("4x24GB"); dptune.Cluster
        print(json.dumps({"torch": "torch" in sys.modules, "cards": len(d),
                          "used0": d[0].used_bytes}))
    """)
    assert info == {"torch": False, "cards": 4, "used0": 6 * 2**30}


def test_spec_by_hand():
    c = cluster.parse_cluster("2x40GB,1xH100,used=2:1GiB,context=256MiB")
    assert c.names == ("40GB", "40GB", "H100-80GB")
    assert c.total_bytes == (40 * GiB, 40 * GiB, cluster.CARD_TYPES["H100-80GB"])
    assert c.used_bytes == (0, 0, GiB)
    assert c.context_bytes == 256 * MiB
    assert c.capabilities == ((8, 0), (8, 0), (9, 0))   # size-only cards assume sm 8.0
    assert c.assumed_capability and c.describe_capability() == "sm 8.0 assumed"
    assert [d.available_bytes for d in c.devices] == [
        40 * GiB - 256 * MiB, 40 * GiB - 256 * MiB, cluster.CARD_TYPES["H100-80GB"] - GiB - 256 * MiB]


def test_the_simulator_still_exports_the_cluster_names():
    """``from dptune.backends.simulated import parse_cluster, Cluster, ...`` keeps working."""
    for name in ("Cluster", "parse_cluster", "CARD_TYPES", "CARD_CAPABILITY", "DEFAULT_CAPABILITY",
                 "DEFAULT_CLUSTER", "DEFAULT_CONTEXT_BYTES"):
        assert getattr(simulated, name) is getattr(cluster, name)
