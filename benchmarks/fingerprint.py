"""The simulator's fingerprint: every figure of a fixed set of simulated probes, as JSON.

``python -m benchmarks.fingerprint OUT.json`` probes each benchmark model (:mod:`benchmarks.config`)
on three clusters at three uneven splits and writes every :class:`~dptune.types.ProbeResult`
field but the wall time. Run it before and after a change that should not change results (a
move of code, a merge) and compare the files byte for byte (``cmp``): any difference is a
changed figure. About 40 s on a 2-core machine.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

import torch

from benchmarks import config
from dptune.hardware.cluster import parse_cluster
from dptune.backends.simulated import SimulatedBackend
from dptune.step.workload import Workload

MODELS = ("MLP", "GPT", "ResNet", "BERT", "SegNet")
CLUSTERS = ("4x24GB", "2x80GB,2x40GB", "4x24GB,used=0:6GB")
PER_CARD = (1, 3, 8)        # card i gets PER_CARD * (i + 1) samples: uneven on purpose


def fingerprint() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in MODELS:
        spec = config.MODELS[name]
        for cluster in CLUSTERS:
            torch.manual_seed(0)
            model, sample = spec.workload_args()
            backend = SimulatedBackend(Workload(model, sample, None, config.optimizer,
                                                amp="bf16" if name == "GPT" else None), cluster)
            n = len(parse_cluster(cluster))
            try:
                for per in PER_CARD:
                    sizes = [per * (i + 1) for i in range(n)]
                    d = backend.probe(sizes).to_dict()
                    d.pop("seconds", None)
                    if d.get("time") is None:   # no time estimate here: as before the field
                        d.pop("time", None)
                    out[f"{name}|{cluster}|{sizes}"] = d
            finally:
                backend.close()
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.fingerprint OUT.json", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = fingerprint()
    with open(argv[0], "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    print(f"{len(data)} probes written to {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
