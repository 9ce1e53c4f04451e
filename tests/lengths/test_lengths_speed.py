"""Tokens per second with the variable-length plan (:mod:`dptune.lengths.speed`): the
arithmetic by hand, and the throughput objective per bucket on the simulated cluster."""

from __future__ import annotations

import pytest

from dptune.lengths.speed import BucketSpeed, LengthSpeed


def test_bucket_and_epoch_rates_by_hand():
    """Bucket 32: 20 samples (500 tokens) in batches of 8, 100 ms a step: 3 steps, 2,560
    padded tokens/s. Bucket 64: 5 samples (300 tokens) in batches of 4, 200 ms: 2 steps.
    Epoch: 0.3 + 0.4 = 0.7 s; 800 tokens / 0.7 s; padded 20 x 32 + 5 x 64 = 960 tokens."""
    a = BucketSpeed(32, 8, 20, 500, 0.1, "estimated")
    b = BucketSpeed(64, 4, 5, 300, 0.2, "estimated")
    speed = LengthSpeed((a, b))
    assert (a.steps, b.steps) == (3, 2)
    assert a.tokens_per_second == pytest.approx(2560.0)
    assert b.tokens_per_second == pytest.approx(1280.0)
    assert speed.epoch_seconds == pytest.approx(0.7)
    assert speed.tokens_per_second == pytest.approx(800 / 0.7)
    assert speed.padded_tokens == 960
    lines = speed.lines()
    assert lines[0].startswith("speed: length <= 32: step 100.00 ms, 2,560 padded tokens/s (estimated)")
    assert "epoch: 5 steps, 700.00 ms, 1,143 tokens/s" in lines[1]
    d = speed.to_dict()
    assert d["epoch_seconds"] == pytest.approx(0.7) and d["buckets"][1]["steps"] == 2


def test_a_bucket_without_a_time_leaves_the_epoch_unknown():
    speed = LengthSpeed((BucketSpeed(32, 8, 20, 500, 0.1, "measured"),
                         BucketSpeed(64, 4, 5, 300, None, "unknown")))
    assert speed.epoch_seconds is None and speed.tokens_per_second is None
    assert "time unknown" in speed.lines()[1]


@pytest.mark.slow
def test_throughput_per_bucket_is_faster_than_the_largest_batch_and_fits():
    """Card 1 at 2 TFLOPS beside card 0 at 100: the throughput plan's split of the one bucket
    is measured within every budget and moves more tokens per second than the largest batch's
    split, both timed by the same simulated backend here (the oracle: two probes)."""
    from dptune.backends.simulated import SimulatedBackend
    from dptune.backends.simulated.timing import TimedBackend
    from dptune.lengths import plan_lengths
    from dptune.step.workload import Workload

    from tests.lengths.test_lengths_search import LENGTHS, gpt, gpt_sample

    spec = "2x1GB,context=384MiB,tflops=0:100,tflops=1:2,bandwidth=1:50GB/s"
    # the allocated level: 1 GB cards (no room for NCCL), and the oracle's budgets are allocated
    largest = plan_lengths(gpt, gpt_sample, LENGTHS, [128], simulate=spec, headroom=0,
                           budget_level="allocated")
    fast = plan_lengths(gpt, gpt_sample, LENGTHS, [128], simulate=spec, headroom=0,
                        objective="throughput", budget_level="allocated")
    assert any(n.startswith("epoch: ") and "estimated" in n for n in fast.notes)
    backend = TimedBackend(SimulatedBackend(Workload(gpt, lambda n: gpt_sample(n, 128)), spec))
    budgets = [d.budget_bytes(0) for d in backend.devices]

    def rate(split):
        r = backend.probe(list(split))
        assert r.feasible and all(p <= b for i, (p, b, c) in enumerate(
            zip(r.peak_bytes, budgets, split)) if i == 0 or c > 0)
        return sum(split) * 128 / r.time.step_seconds

    assert rate(fast.buckets[0].chunk_sizes) > 2 * rate(largest.buckets[0].chunk_sizes)
    backend.close()


@pytest.mark.slow
def test_the_command_line_plans_lengths_for_throughput(tmp_path):
    """``dptune search --lengths ... --objective throughput``: the plan's notes give the
    tokens per second of each bucket and of the epoch, in the JSON report."""
    import json

    from dptune.cli import main
    from dptune.errors import EXIT_OK

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [20] * 6 + [100] * 2))
    out = tmp_path / "rep"
    code = main(["search", "--model", "tests.support.lengths_models:gpt", "--simulate",
                 "2x1GB,context=384MiB,tflops=1:2", "--headroom", "0", "--optimizer", "none",
                 "--budget-level", "allocated",
                 "--sample", "tests.support.lengths_models:batch", "--lengths", str(lengths),
                 "--buckets", "32", "--objective", "throughput", "--out", str(out), "-q",
                 "--no-plots"])
    assert code == EXIT_OK
    notes = json.loads((out / "lengths.json").read_text())["notes"]
    assert any(n.startswith("speed: length <= 20: step") and "length <= 100: step" in n
               for n in notes)
    assert any(n.startswith("epoch: 2 steps") for n in notes)
