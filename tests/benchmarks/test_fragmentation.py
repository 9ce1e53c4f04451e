"""``benchmarks.fragmentation``: one card's allocated and reserved peaks chunk by chunk, with
the default allocator and with expandable segments, and the least memory the step runs in
when the allocator may retry, from the simulator's probes."""

from __future__ import annotations

import pytest

from benchmarks import fragmentation


@pytest.mark.slow      # four simulated steps of the CNN, twenty seconds of CPU
def test_figures_and_table(capsys):
    rows = fragmentation.figures("ResNet", "2x24GB", 1, [4, 6])
    assert [c for c, *_ in rows] == [4, 6]
    for _, allocated, reserved, grown, need in rows:
        # a segment holds what is allocated in it: both reserved figures at least the allocated
        # peak; retrying, the step runs in no more than its reserved peak without a limit
        assert 0 < allocated <= reserved and allocated <= grown
        assert allocated <= need <= reserved + 2 * 2**20
    assert rows[0][1] < rows[1][1]          # two more samples allocate more
    assert fragmentation.main(["--chunks", "4:4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[2].startswith("| 4 | ")
