"""``plan.scale_loss(loss)`` without ``batch_size=`` on the tail step of an epoch, in a real
2-rank gloo job: refused where the sampler makes a step of other sizes than the plan's (the
planned scale would be off there), exact on every step where it does not (``drop_last``)."""

from __future__ import annotations

import pytest

import ddp_workers as w

SIZES, N = [5, 3], 19          # 19 = 2 x 8 + 3: a tail step of 3 samples, [2, 1]

JOBS = [
    ("loop:planned", {"sizes": SIZES, "n": N, "how": "planned"}),
    ("loop:planned_drop", {"sizes": SIZES, "n": N, "how": "planned", "drop_last": True}),
    ("loop:tail", {"sizes": SIZES, "n": N}),                      # batch_size=len(batch)
]

pytestmark = pytest.mark.slow     # real gloo processes: several seconds


@pytest.fixture(scope="module")
def job():
    return w.launch(2, JOBS, timeout=240)


def every_step_exact(out, label) -> list:
    """Each step's gradient on both ranks is the single-process gradient of the mean over
    the samples the ranks got at that step; returns the steps' sizes."""
    steps = [out[r][label]["steps"] for r in range(2)]
    assert len(steps[0]) == len(steps[1])
    sizes = []
    for k in range(len(steps[0])):
        batch = [i for r in range(2) for i in steps[r][k]["indices"]]
        full = w.grads_of(batch, N)
        for r in range(2):
            for g, f in zip(steps[r][k]["grads"], full):
                assert all(abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(g, f)), (label, k, r)
        sizes.append([len(steps[r][k]["indices"]) for r in range(2)])
    return sizes


def test_the_planned_scale_is_refused_where_the_epoch_has_a_tail(job):
    for r in range(2):
        got = job[r]["loop:planned"]
        assert got.get("error") == "UsageError", got
        msg = got["message"]
        assert "\n" not in msg
        assert "a step of 3 samples [2, 1]" in msg and "batch_size=len(batch)" in msg, msg


def test_without_a_tail_the_planned_scale_is_exact_on_every_step(job):
    assert every_step_exact(job, "loop:planned_drop") == [SIZES, SIZES]


def test_the_step_sizes_given_make_the_tail_exact(job):
    assert every_step_exact(job, "loop:tail") == [SIZES, SIZES, [2, 1]]
