"""``dptune search --lengths``: the table, the report files and bad input's exit codes."""

from __future__ import annotations

import json

import pytest

from dptune.cli import main
from dptune.errors import EXIT_NO_FIT, EXIT_OK, EXIT_USAGE

BASE = ["search", "--model", "tests.support.lengths_models:gpt", "--simulate",
        "2x403.125MB,context=384MiB", "--headroom", "0", "--optimizer", "none",
        "--budget-level", "allocated"]     # budgets of ~10 MiB beyond the 17.25 MiB of workspaces, checked against allocated peaks
SHAPE = ["--input-shape", "128", "--dtype", "long", "--vocab-size", "500"]


@pytest.fixture
def lengths_file(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(str(x) for x in [20] * 6 + [32] * 3 + [64] * 3 + [100]))
    return p


@pytest.mark.slow
def test_table_and_report(tmp_path, lengths_file, capsys):
    out = tmp_path / "rep"
    code = main(BASE + SHAPE + ["--lengths", str(lengths_file), "--buckets", "32,64",
                                "--out", str(out), "-q"])
    assert code == EXIT_OK
    plan = json.loads((out / "lengths.json").read_text())
    assert [b["length"] for b in plan["buckets"]] == [32, 64, 100]
    assert [b["samples"] for b in plan["buckets"]] == [9, 3, 1]
    assert all(b["certified"] for b in plan["buckets"])
    for name in ("lengths.csv", "summary.md", "lengths.png", "report.html"):
        assert (out / name).stat().st_size > 0
    page = (out / "report.html").read_text()
    assert 'id="staircase"' in page and "(64, 100]" in page
    csv_rows = (out / "lengths.csv").read_text().splitlines()
    assert csv_rows[0].startswith("bucket,lengths,samples,batch,per_card")
    assert len(csv_rows) == 4
    summary = (out / "summary.md").read_text()
    assert "max_tokens=" in summary and "BucketBatchSampler" in summary


@pytest.mark.slow
def test_printed_lines_one_per_bucket(tmp_path, lengths_file, capsys):
    code = main(BASE + ["--sample", "tests.support.lengths_models:batch", "--lengths", str(lengths_file),
                        "--buckets", "2", "--out", str(tmp_path / "r"), "--no-plots"])
    assert code == EXIT_OK
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("length <= ")]
    assert len(lines) == 2 and lines[-1].startswith("length <= 100: batch ")
    assert "tokens/step" in lines[0]


@pytest.mark.parametrize("content,match", [("", "empty"), ("5\n-3\n", ">= 1"),
                                           ("5\nfive\n", "not an integer")])
def test_bad_lengths_exit_2(tmp_path, capsys, content, match):
    p = tmp_path / "l.txt"
    p.write_text(content)
    code = main(BASE + SHAPE + ["--lengths", str(p), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and match in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_sample_ignoring_the_length_exits_2(tmp_path, lengths_file, capsys):
    code = main(BASE + ["--sample", "tests.support.lengths_models:ignores_length",
                        "--lengths", str(lengths_file), "--out", str(tmp_path / "r")])
    assert code == EXIT_USAGE
    assert "must build its batch at the length" in capsys.readouterr().err


def test_lengths_beyond_the_input_shape_exit_2(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("20\n300\n")
    code = main(BASE + SHAPE + ["--lengths", str(p), "--out", str(tmp_path / "r")])
    assert code == EXIT_USAGE and "at most 128 positions" in capsys.readouterr().err


@pytest.mark.slow
def test_nothing_fits_at_the_longest_exits_3(tmp_path, capsys):
    p = tmp_path / "l.txt"
    p.write_text("8\n128\n")
    args = list(BASE)   # budgets of 9.1 MiB beyond the workspaces: one sequence of 8 tokens fits, one of 128 does not
    args[args.index("--simulate") + 1] = "2x402.125MB,context=384MiB"
    args[args.index("--headroom") + 1] = str(9 * 2**20 - 9_100_000)
    code = main(args + SHAPE + ["--lengths", str(p), "--buckets", "8", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == EXIT_NO_FIT and "at length 128" in err


@pytest.mark.slow
def test_the_default_headroom_plans(tmp_path, lengths_file, capsys):
    """No --headroom, no --budget-level: the reserved level and its default headroom (256 MiB),
    as the single-shape search takes them; found by running the README's command without the
    flags. With --budget-level allocated: that level's 1 GiB. One bucket: the headroom does
    not depend on their number (64 buckets took minutes)."""
    base = [a for a in BASE if a not in ("--headroom", "0", "--budget-level", "allocated")]
    base[base.index("2x403.125MB,context=384MiB")] = "2x4GB"
    for extra, headroom in (([], 256 * 2**20), (["--budget-level", "allocated"], 2**30)):
        out = tmp_path / f"rep{headroom}"
        code = main(base + SHAPE + extra + ["--lengths", str(lengths_file), "--buckets", "1",
                                            "--out", str(out), "-q"])
        assert code == EXIT_OK, capsys.readouterr().err
        plan = json.loads((out / "lengths.json").read_text())
        assert plan["headroom_bytes"] == headroom
        assert any("reserved level" in n for n in plan["notes"]) == (not extra)
        # what a certified bucket rests on at the reserved level, said there only
        assert any(n.startswith("a bucket certified") and "does not fall as the batch grows" in n
                   for n in plan["notes"]) == (not extra)


def test_a_sample_function_without_length_is_one_line(tmp_path, lengths_file, capsys):
    code = main(["search", "--model", "dptune.examples.models:TinyGPT", "--simulate", "2x2GB",
                 "--lengths", str(lengths_file), "--out", str(tmp_path / "rep"), "-q"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert err.count("\n") == 1 and "takes no length= argument" in err and "--input-shape" in err
