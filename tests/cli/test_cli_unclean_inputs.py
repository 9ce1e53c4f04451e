"""The inputs issue 37 found slipping through, each built from its case: one line that says
what is wrong and what to do, a documented exit code (2: usage), no traceback, and nothing
silently changed or ignored."""

from __future__ import annotations

import pytest

from dptune.errors import EXIT_NO_FIT, EXIT_USAGE, UsageError
from dptune.lengths import search as length_search
from tests.cli.test_cli import run_main, tiny  # noqa: F401 (tiny: a fixture)


def one_line_usage(code: int, err: str, *fragments: str) -> None:
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for fragment in fragments:
        assert fragment in err, err


def test_a_global_batch_beyond_any_cluster_is_refused_at_once(capsys):
    """It printed nothing for 300 s (listing the micro-batch counts of 10^15)."""
    for command in (["search", "--model", "dptune.examples.models:TinyGPT", "--objective",
                     "throughput"], ["plan", "--model", "dptune.examples.models:TinyGPT"]):
        code, out, err = run_main(capsys, *command, "--simulate", "2x24GB", "--global-batch",
                                  "1000000000000000")
        one_line_usage(code, err, "--global-batch", "1000000000000000 is beyond what any "
                       "cluster trains in one optimizer step", "e.g. 4096")
        assert out == ""


def test_a_binary_lengths_file_is_one_line(tiny, capsys, tmp_path):  # noqa: F811
    """It exited 1 with dptune's own UnicodeDecodeError traceback."""
    (tmp_path / "lengths.bin").write_bytes(bytes(range(256)) * 4)
    code, out, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--input-shape", "16",
                              "--vocab-size", "100", "--simulate", "2x24GB", "--lengths",
                              str(tmp_path / "lengths.bin"))
    one_line_usage(code, err, "--lengths", "is not a text file", "one integer length per line")


@pytest.mark.parametrize("size, cards", [("100GB", "2x24GB"), ("24GiB", "2x24GB"),
                                         ("12GiB", "1x24GB,1x12GB")])
def test_nccl_bytes_beyond_a_card_names_the_flag(capsys, size, cards):
    """100GB ended in exit 5, "unexpected AssertionError in dptune's own code"."""
    for command in (["search", "--model", "dptune.examples.models:TinyGPT",
                     "--batch-size", "64"], ["plan", "--model", "dptune.examples.models:TinyGPT",
                                             "--batch-size", "64"]):
        code, out, err = run_main(capsys, *command, "--simulate", cards, "--nccl-bytes", size)
        one_line_usage(code, err, "--nccl-bytes", "whole budget", "NCCL's buffers per card")
        assert out == ""


@pytest.mark.slow
def test_nccl_bytes_that_leave_no_split_are_named(capsys):
    """Within the budget but leaving no room for the batch: it said "try a smaller batch"
    and never named the flag."""
    code, _, err = run_main(capsys, "search", "--model", "dptune.examples.models:TinyGPT",
                            "--batch-size", "64", "--simulate", "2x24GB", "--nccl-bytes",
                            "23GiB", "--quiet")
    assert code == EXIT_NO_FIT, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    # the search's own line: fixed costs, not the model, fill the card; the flags named
    assert "fixed costs, not the model, fill card" in err and "--nccl-bytes" in err, err


def test_output_device_auto_is_refused_where_it_does_nothing(capsys):
    """With --objective balance 'auto' was silently ignored."""
    for objective in ("balance", "throughput"):
        code, _, err = run_main(capsys, "search", "--model", "dptune.examples.models:TinyGPT",
                                "--simulate", "2x24GB", "--objective", objective,
                                "--output-device", "auto")
        one_line_usage(code, err, "--output-device auto", f"--objective {objective}",
                       "only --objective max-batch")


@pytest.mark.parametrize("given, expected", [(["--max-probes", "5"], 5), ([], 16),
                                             (["--max-probes", "40"], 40)])
def test_max_probes_with_lengths_is_honoured(tiny, capsys, tmp_path, monkeypatch,  # noqa: F811
                                             given, expected):
    """Below 16 it was silently raised to 16 per bucket, although --help says "at most"."""
    seen = {}

    def spy(*args, **kwargs):
        seen["max_probes"] = kwargs["max_probes"]
        raise UsageError("stopped by the test")

    monkeypatch.setattr(length_search, "plan_lengths", spy)
    (tmp_path / "lengths.txt").write_text("\n".join(str(8 + k % 8) for k in range(64)))
    code, _, err = run_main(capsys, "search", "--model", f"{tiny}:Net", "--input-shape", "256",
                            "--simulate", "2x24GB", "--lengths",
                            str(tmp_path / "lengths.txt"), *given)
    assert "stopped by the test" in err
    assert seen == {"max_probes": expected}
