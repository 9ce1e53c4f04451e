"""The simulator against a real H200: the allocator's history of six training steps
(``benchmarks/measured/h200-2026-11-27/memory.json.gz``, torch 2.11, written by
``benchmarks/gpu_facts.py`` on the card) read by ``benchmarks/memory_gap.py``.

The reference is the card's ``max_memory_allocated`` over the measured (second) step. The
estimate may not be under it by more than 2%: the measured figure holds what the simulator
cannot know of, all of it read in the history: what earlier cases of the measuring process
left allocated beyond the workspaces (up to 8.4 MiB, HF-GPT2's 0.4%; SmallResNet's 1.8 MiB,
0.6%), the allocator's keeping a large block whole when the rest would be small (the rebuilt
peak, rounded to 512-byte blocks only, is up to 2.9 MB, 0.9%, under the measured one), and a
CUDA reduction's global buffer (4 MiB in BertClassifier's bias gradients, 1.2%). Over it by
at most 5%, validate_gpu's target: cuDNN's workspace is charged as a bound.
"""

from __future__ import annotations

import os
import warnings

import pytest

from benchmarks import memory_gap

UNDER, OVER = 0.02, 0.05
CASES = memory_gap.real_peaks() if os.path.exists(memory_gap.FACTS) else []


def test_the_history_holds_the_six_cases_and_rebuilds_their_peaks():
    assert [(r.label, r.batch) for r in CASES] == [
        ("MLP", 64), ("SmallResNet(BN)", 16), ("TinyGPT", 4), ("BertClassifier", 16),
        ("SegNet", 4), ("HF-GPT2+cache", 4)]
    for r in CASES:
        # the replay, with blocks rounded to 512 bytes, finds the card's own peak within 1%
        assert abs(r.rebuilt - r.measured) <= 0.01 * r.measured, r.label
        assert sum(r.by_category.values()) == r.rebuilt, r.label
    mlp = CASES[0]
    # MLP runs first: the three workspaces are made in its warm-up step and kept (two cuBLAS
    # workspaces of 32 MiB, the forward's thread's and the backward's, and cuBLASLt's 1 MiB),
    # on top of 1.5 MiB allocated before the history began
    assert mlp.by_category["workspaces"] - mlp.before == 65 * 2**20


@pytest.mark.parametrize("real", CASES, ids=[r.label for r in CASES])
def test_estimate_is_close_to_the_h200s_peak_and_never_far_under(real):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = memory_gap.simulated(real.label, real.batch)
    err = (est.peak_bytes[0] - real.measured) / real.measured
    assert -UNDER <= err <= OVER, f"{real.label}: {err:+.2%}"
    b = est.breakdown[0]
    # the weights and the optimizer's state are the card's, byte for byte
    assert b["weights"] == real.by_category["weights"]
    if real.by_category["optimizer"] and real.label != "MLP":
        # (MLP's peak is in Adam's step: its foreach temporaries are counted there on both
        # sides; elsewhere the peak is in the backward, with the state alone)
        assert b["optimizer"] == real.by_category["optimizer"]


def test_the_table_prints(capsys):
    assert memory_gap.main(["--only", "SegNet"]) == 0
    out = capsys.readouterr().out
    assert "SegNet b4" in out and "real" in out and "sim" in out
