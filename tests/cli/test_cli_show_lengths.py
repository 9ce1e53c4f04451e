"""``dptune show DIR`` on a report written by ``dptune search --lengths`` (issue 23): it prints
the plan's table, as search printed it, end to end on a built-in model (TinyGPT from
dptune.examples) on a simulated cluster (slow: the search takes 5-12 s here), and for a plan
written by hand; a broken plan and ``dptune plot`` say so in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dptune.cli import main
from dptune.errors import EXIT_OK, EXIT_USAGE
from dptune.lengths.plan import BucketPlan, LengthPlan

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--model", "dptune.examples.models:TinyGPT", "--model-kwargs",
         '{"vocab_size": 500, "d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 128}',
         "--input-shape", "128", "--vocab-size", "500", "--optimizer", "none"]
CARDS = ["--simulate", "2x403.125MB,context=384MiB", "--headroom", "0",
         "--budget-level", "allocated"]      # cards of ~10 MiB beyond the workspaces: no room for NCCL's buffers
LENGTHS = [20] * 6 + [32] * 3 + [64] * 3 + [100]


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """A length report folder and what `dptune search --lengths` printed for it."""
    tmp = tmp_path_factory.mktemp("show_lengths")
    lengths = tmp / "lengths.txt"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    folder = tmp / "rep"
    code, out, err = run("search", *MODEL, *CARDS, "--lengths", str(lengths), "--buckets", "32,64",
                         "--out", str(folder), "--no-plots")
    assert code == EXIT_OK, err
    return folder, out


@pytest.mark.slow
def test_show_prints_the_table_search_printed(searched):
    folder, printed = searched
    code, out, err = run("show", str(folder))
    assert code == EXIT_OK and err == ""
    table = printed.splitlines()[:-1]            # all but "report written to ..."
    assert printed.splitlines()[-1].startswith("report written to")
    assert out.splitlines() == table
    # one line per bucket of the saved plan, with its batch and per-card split
    buckets = json.loads((folder / "lengths.json").read_text())["buckets"]
    assert [b["length"] for b in buckets] == [32, 64, 100]
    lines = [ln for ln in out.splitlines() if ln.startswith("length <= ")]
    assert len(lines) == len(buckets)
    for line, b in zip(lines, buckets):
        assert sum(b["chunk_sizes"]) == b["batch_size"] > 0
        assert line.startswith(f"length <= {b['length']}: batch {b['batch_size']} = "
                               f"{b['chunk_sizes']}, ")
    assert "max_tokens=" in out


@pytest.mark.slow
def test_show_the_plan_file_and_json(searched):
    folder, _ = searched
    by_folder = run("show", str(folder))
    assert run("show", str(folder / "lengths.json")) == by_folder
    code, out, err = run("show", str(folder), "--json")
    assert code == EXIT_OK and err == ""
    data = json.loads(out)                       # stdout holds the JSON and nothing else
    budget = data.pop("token_budget")
    assert data == json.loads((folder / "lengths.json").read_text())
    assert f"max_tokens={budget['max_tokens']}" in by_folder[1]


@pytest.mark.slow
def test_show_with_python_m_dptune(searched):
    folder, _ = searched
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "dptune", "show", str(folder)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_OK, proc.stderr
    assert proc.stdout == run("show", str(folder))[1]


def test_show_a_plan_written_by_hand(tmp_path):
    plan = LengthPlan(
        buckets=(BucketPlan(lo=0, length=32, samples=9, chunk_sizes=(5, 12),
                            peak_bytes=(10, 10), binding_card=0, certified=True, probes=5),
                 BucketPlan(lo=32, length=64, samples=3, chunk_sizes=(2, 5),
                            peak_bytes=(10, 10), binding_card=1, certified=False, probes=3)),
        devices=("24GB", "24GB"), budget_bytes=(2**30, 2**30), cluster="2x24GB",
        model_name="Net", seconds=1.25)
    (tmp_path / "rep").mkdir()
    plan.save(str(tmp_path / "rep"))
    code, out, err = run("show", str(tmp_path / "rep"))
    assert code == EXIT_OK and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("Net on 2x24GB: 2 buckets, 8 probes")
    assert lines[1:3] == ["length <= 32: batch 17 = [5, 12], 544 tokens/step",
                          "length <= 64: batch 7 = [2, 5], 448 tokens/step (not certified)"]
    # both buckets' batches hold more than their samples: said, not left to be found
    assert lines[3] == ("note: lengths <= 32: the batch that fits (17) is larger than the "
                        "bucket's 9 samples; its steps take every sample of the bucket, fewer "
                        "than fit")
    assert lines[4].startswith("note: lengths <= 64: the batch that fits (7) is larger than the "
                               "bucket's 3 samples")
    assert "max_tokens=" in lines[5] and len(lines) == 6
    code, out, err = run("show", str(tmp_path / "rep"), "--html")
    assert code == EXIT_OK and out == f"wrote {tmp_path / 'rep' / 'report.html'}\n", err
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<h1>dptune length plan: Net on 2x24GB</h1>" in page and "(32, 64]" in page
    # a folder holding an ordinary report too is that report (a missing report.json is named)
    (tmp_path / "rep" / "report.json").write_text("{}")
    code, _, err = run("show", str(tmp_path / "rep"))
    assert code == EXIT_USAGE and "report" in err and "length plan" not in err


@pytest.mark.parametrize("content, match", [
    ('{"kind": "length_plan"}', "not a dptune length plan"),
    ('{"buckets": [', "is not valid JSON"),
    ('{"buckets": [], "devices": [], "budget_bytes": []}', "needs at least one bucket"),
])
def test_a_broken_length_plan_is_one_line(tmp_path, content, match):
    (tmp_path / "lengths.json").write_text(content)
    code, out, err = run("show", str(tmp_path))
    assert code == EXIT_USAGE and out == ""
    assert match in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.slow
def test_plot_on_a_length_report_says_what_to_do(searched):
    folder, _ = searched
    code, out, err = run("plot", str(folder))
    assert code == EXIT_USAGE and out == ""
    assert "length plan" in err and "--lengths" in err and err.count("\n") == 1


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["buckets"][0]["chunk_sizes"].__setitem__(1, -3),
     "buckets[0].chunk_sizes [5, -3] must be 2 integers >= 0"),
    (lambda d: d["buckets"][1].__setitem__("chunk_sizes", [1]),
     "buckets[1].chunk_sizes [1] must be 2 integers >= 0"),
    (lambda d: d.__setitem__("budget_bytes", [-1, 5]), "budget_bytes [-1, 5] must be 2 figures"),
    (lambda d: d["buckets"][0].__setitem__("binding_card", 7), "binding card 7"),
])
def test_an_edited_length_plan_is_refused_in_one_line(tmp_path, edit, match):
    """A negative chunk edited into lengths.json (the issue's case) is not shown as it is."""
    plan = LengthPlan(
        buckets=(BucketPlan(0, 32, 90, (5, 12), (10, 10), 0, True, 5),
                 BucketPlan(32, 64, 30, (2, 5), (10, 10), 1, True, 3)),
        devices=("24GB", "24GB"), budget_bytes=(2**30, 2**30), cluster="2x24GB", model_name="Net")
    d = plan.to_dict()
    edit(d)
    (tmp_path / "lengths.json").write_text(json.dumps(d))
    for argv in (("show", str(tmp_path)), ("show", str(tmp_path), "--html")):
        code, out, err = run(*argv)
        assert code == EXIT_USAGE and out == "", err
        assert match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "report.html").exists()
