"""The last inputs that slipped through the command line (issue 22), each case as a user types
it: one `dptune: error:` line naming the flag, file or path and what to do, with the
documented exit code (dptune/errors.py), never a traceback and never silence.

Where a check must come before any work, the model named does not exist: an error about the
model would mean the check came too late.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from fractions import Fraction

import pytest
import torch
from torch import nn

from dptune.cli import main
from dptune.cli.checks import accumulate_arg, check_cards, check_plan_out
from dptune.errors import EXIT_NO_FIT, EXIT_OK, EXIT_USAGE, NoFeasibleSplitError, UsageError
from dptune.report import write_report
from dptune.units import parse_bytes

from tests.report.test_report import make_result

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x)
'''

NOWHERE = ["--model", "no_such_module_anywhere:Net", "--input-shape", "16"]


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A one-layer model in a fresh module of the working directory (tmp_path)."""
    name = f"net_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(code: int, err: str, expected: int, *fragments: str) -> str:
    """The exit code, no traceback, and one `dptune: error:` line holding every fragment."""
    assert code == expected, err
    assert "Traceback" not in err and "usage:" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dptune: error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- `plan --out` into a search report, and the symmetric case -----------------------------

def test_plan_out_refuses_a_search_report_folder(tmp_path, capsys):
    report = write_report(make_result(), tmp_path / "rep", plots=False)
    before = {p.name: p.read_bytes() for p in report.iterdir()}
    code, _, err = run(capsys, "plan", *NOWHERE, "--batch-size", "8", "--simulate", "2x2GB",
                       "--out", str(report))
    one_line(code, err, EXIT_USAGE, f"--out '{report}' already holds files that are not a "
             "dptune plan", "report.json", "give a new or empty folder")
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before   # nothing touched
    code, _, err = run(capsys, "plan", *NOWHERE, "--batch-size", "8", "--simulate", "2x2GB",
                       "--out", str(report / "report.json"))
    one_line(code, err, EXIT_USAGE, "report.json' already exists and is not a dptune plan")
    assert {p.name: p.read_bytes() for p in report.iterdir()} == before


def test_search_out_refuses_a_plan_folder_and_plan_rewrites_its_own(model, tmp_path, capsys):
    args = ["--model", f"{model}:Net", "--input-shape", "16", "--batch-size", "8",
            "--simulate", "2x2GB", "--budget-level", "allocated"]   # 2 GB cards: no room for NCCL
    code, _, err = run(capsys, "plan", *args, "--out", "pl", "-q")
    assert code == EXIT_OK, err
    assert sorted(p.name for p in (tmp_path / "pl").iterdir()) == ["plan.json", "report.html", "summary.md"]
    code, _, err = run(capsys, "search", *NOWHERE, "--out", "pl")
    one_line(code, err, EXIT_USAGE, "--out 'pl' already holds files that are not a dptune "
             "report (plan.json)")
    check_plan_out("pl")                                  # a plan may be redone in place
    check_plan_out(str(tmp_path / "pl" / "plan.json"))


def test_plan_default_folder_holding_something_else_is_refused(model, tmp_path, capsys):
    other = tmp_path / "reports" / "ddp-Net-2x2GB"
    other.mkdir(parents=True)
    (other / "notes.txt").write_text("mine")
    code, _, err = run(capsys, "plan", "--model", f"{model}:Net", "--input-shape", "16",
                       "--batch-size", "8", "--simulate", "2x2GB", "-q", "--budget-level", "allocated")
    one_line(code, err, EXIT_USAGE, "the default folder 'reports/ddp-Net-2x2GB' already holds "
             "files that are not a dptune plan (notes.txt)", "give a new or empty folder with --out")
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


# ---- the bound plan gives for a batch beyond the cards -------------------------------------

def _rank_capacity(budget_cards: str = "1x2GB") -> int:
    """Oracle: the largest local batch of one rank of the test's model (AdamW, the CLI's
    default, and the default loss) within its budget, by bisection on the simulated card."""
    from dptune import parse_cluster
    from dptune.backends.simulated.ddp import SimulatedDDP
    from dptune.step.presets import adamw
    from dptune.step.workload import Workload

    wl = Workload(lambda: nn.Linear(16, 16), lambda b: torch.randn(b, 16), optimizer=adamw)
    budget = parse_cluster(budget_cards).devices[0].budget_bytes(2**30)
    sim = SimulatedDDP(wl, budget_cards)
    try:
        lo, hi = 1, 1 << 27
        assert sim.estimate([lo]).peak_bytes[0] <= budget < sim.estimate([hi]).peak_bytes[0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if sim.estimate([mid]).peak_bytes[0] <= budget:
                lo = mid
            else:
                hi = mid
        return lo
    finally:
        sim.close()


@pytest.mark.slow
def test_plan_beyond_the_cards_says_what_they_take(model, capsys):
    """Issue 22: 'at most 99999996' for 100000000 and 99999992 for 99999996 (batch - 4)."""
    cap = _rank_capacity()
    code, _, err = run(capsys, "plan", "--model", f"{model}:Net", "--input-shape", "16",
                       "--batch-size", "100000000", "--simulate", "2x2GB", "-q",
                       "--budget-level", "allocated")     # the oracle's figures are allocated
    line = one_line(code, err, EXIT_NO_FIT, "global batch 100000000",
                    f"the ranks take at most {2 * cap} samples together",
                    f"(rank 0: {cap}, rank 1: {cap})", f"at most {2 * cap} (--batch-size)")
    assert "99999998" not in line


@pytest.mark.slow
def test_plan_bound_is_the_same_for_another_batch_and_a_range_when_rounds_run_out():
    from dptune.ddp import plan
    from dptune.step.presets import adamw

    cap = _rank_capacity()
    with pytest.raises(NoFeasibleSplitError, match=f"at most {2 * cap} samples together"):
        plan(lambda: nn.Linear(16, 16), lambda b: torch.randn(b, 16), optimizer=adamw,
             global_batch=99999996, simulate="2x2GB", budget_level="allocated")
    # too few rounds to bracket the ranks: a range that holds the true figure
    with pytest.raises(NoFeasibleSplitError) as e:
        plan(lambda: nn.Linear(16, 16), lambda b: torch.randn(b, 16), optimizer=adamw,
             global_batch=10**8, simulate="2x2GB", max_rounds=3, budget_level="allocated")
    m = re.search(r"at most (\d+) samples together \((\d+) measured to fit; not every rank "
                  r"bracketed in 3 rounds\)", str(e.value))
    assert m is not None, str(e.value)
    assert int(m.group(2)) <= 2 * cap <= int(m.group(1)) < 10**8


# ---- flags out of any sensible range -------------------------------------------------------

def test_accumulate_beyond_the_bound_is_a_usage_error(capsys):
    code, _, err = run(capsys, "search", *NOWHERE, "--accumulate", str(10**30))
    one_line(code, err, EXIT_USAGE, "argument --accumulate", "at most 1024 micro-batches",
             "see 'dptune search --help'")
    assert accumulate_arg("1024") == 1024
    with pytest.raises(UsageError, match="at most 1024 micro-batches"):   # the API too
        from dptune.step.workload import StepSettings
        StepSettings(accumulate=1025)


def test_huge_headroom_is_a_usage_error_in_units(capsys):
    for command in ("search", "plan"):
        code, _, err = run(capsys, command, *NOWHERE, "--batch-size", "8",
                           "--headroom", str(10**30))
        line = one_line(code, err, EXIT_USAGE, "argument --headroom",
                        "more than any card holds (at most 1024.0 TiB)", "e.g. 1GiB")
        assert not re.search(r"\d{20}", line.replace(str(10**30), "")), line


def test_headroom_over_the_card_says_by_how_much_in_gib(model, capsys):
    code, _, err = run(capsys, "search", "--model", f"{model}:Net", "--input-shape", "16",
                       "--batch-size", "8", "--simulate", "2x2GB", "--max-probes", "4",
                       "--headroom", "3GB", "--out", "r", "-q")
    line = one_line(code, err, EXIT_NO_FIT, "no split of batch size 8 fits every card's budget",
                    "GiB over its budget")
    assert re.search(r"card \d is \d+\.\d GiB over", line), line
    assert " bytes over" not in line


def test_byte_sizes_are_read_exactly():
    assert parse_bytes(str(10**30)) == 10**30                        # not 1e30 through a float
    assert parse_bytes("0.1GB") == 10**8
    assert parse_bytes("1.1GiB") == round(Fraction(11, 10) * 2**30)
    assert parse_bytes("24GB", gb_is_gib=True) == 24 * 2**30


@pytest.mark.parametrize("command, extra", [
    ("search", []), ("plan", ["--batch-size", "8"]),
])
def test_out_name_too_long_is_one_line(command, extra, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    name = "a" * 300
    code, _, err = run(capsys, command, *NOWHERE, *extra, "--out", name)
    one_line(code, err, EXIT_USAGE, "--out 'aaaa", "has 300 characters",
             "this file system allows in one name", "give a shorter name")
    assert list(tmp_path.iterdir()) == []


def test_report_name_that_fits_alone_but_not_with_its_temporary_name(tmp_path, capsys,
                                                                     monkeypatch):
    """A report is first written beside its folder under '.NAME.xxxxxxxx.tmp': a name of 250
    characters passes the system's 255 alone but not then, so it is refused before probing."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "search", *NOWHERE, "--out", "b" * 250)
    one_line(code, err, EXIT_USAGE, "has 250 characters", "first written under a name 14 longer")


def test_plot_out_name_too_long(tmp_path, capsys):
    report = write_report(make_result(), tmp_path / "rep", plots=False)
    code, _, err = run(capsys, "plot", str(report), "--out", str(tmp_path / ("c" * 260)))
    one_line(code, err, EXIT_USAGE, "has 260 characters", "give a shorter name")


@pytest.mark.parametrize("command, extra", [
    ("search", []), ("plan", ["--batch-size", "8"]),
])
def test_simulate_more_cards_than_the_bound(command, extra, capsys):
    code, _, err = run(capsys, command, *NOWHERE, *extra, "--simulate", "100000x24GB")
    one_line(code, err, EXIT_USAGE, "--simulate '100000x24GB' has 100,000 cards",
             "more than the 1024 dptune simulates", "the time grows with their number")
    assert check_cards("1024x24GB") == 1024


# ---- inputs that used to pass silently -----------------------------------------------------

@pytest.mark.parametrize("simulate, k, what", [
    ("1x24GB", "1", "there is only card 0; leave --output-device out"),
    ("4x24GB", "7", "the cards are 0..3"),
])
def test_output_device_not_a_card_before_any_work(simulate, k, what, capsys):
    code, _, err = run(capsys, "search", *NOWHERE, "--simulate", simulate, "--output-device", k)
    one_line(code, err, EXIT_USAGE, f"--output-device {k} with --simulate '{simulate}'", what)


def test_output_device_not_a_card_through_the_api():
    """One simulated card and output_device=1 ran silently on card 0."""
    from dptune import Tuner

    tuner = Tuner(lambda: nn.Linear(16, 16), lambda b: torch.randn(b, 16), batch_size=4,
                  simulate="1x2GB", output_device=1, max_probes=3, verbose=False)
    with pytest.raises(UsageError, match=r"output_device=1: there are cards 0\.\.0"):
        tuner.fit()


@pytest.mark.parametrize("argv", [
    ["search", *NOWHERE, "--out", ""],
    ["plan", *NOWHERE, "--batch-size", "8", "--out", ""],
    ["plot", "somewhere", "--out", ""],
])
def test_empty_out_is_refused(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    one_line(code, err, EXIT_USAGE, "argument --out: '' is no path", "leave --out out")
    assert not (tmp_path / "reports").exists()


# ---- argparse's own errors: dptune's one line ----------------------------------------------

@pytest.mark.parametrize("argv, fragment, where", [
    (["search"], "one of the arguments --model --hf-trainer is required", "dptune search"),
    (["search", "--model", "m:N", "--batch-size", "0"], "argument --batch-size: expected a "
     "positive integer, got '0'", "dptune search"),
    (["search", "--model", "m:N", "--bogus"], "unrecognized arguments: --bogus", "dptune search"),
    (["plan", "--model", "m:N", "--objective", "fast"], "argument --objective: invalid choice",
     "dptune plan"),
    (["show"], "the following arguments are required: REPORT", "dptune show"),
    (["serch"], "argument COMMAND: invalid choice: 'serch'", "dptune"),
])
def test_argparse_errors_are_one_line(argv, fragment, where, capsys):
    code, out, err = run(capsys, *argv)
    line = one_line(code, err, EXIT_USAGE, fragment, f"see '{where} --help'")
    assert err.strip() == line and out == ""
    assert not re.search(r"dptune \w+: error", err)      # not argparse's "dptune search: error"


# ---- --hf-trainer: its notes on the terminal -----------------------------------------------

TRAINER_MODULE = '''
import transformers
from hf_models import TokenData, tiny_gpt2


class OwnLoss(transformers.Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)


def make_trainer():
    args = transformers.TrainingArguments(
        output_dir="out", per_device_train_batch_size=4, report_to=[], use_cpu=True,
        save_strategy="no")
    return OwnLoss(model=tiny_gpt2(), args=args, train_dataset=TokenData(),
                   data_collator=transformers.default_data_collator)
'''


def test_hf_trainer_notes_on_the_terminal(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    name = f"hfnotes_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(TRAINER_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + list(sys.path))
    try:
        code, out, err = run(capsys, "search", "--hf-trainer", f"{name}:make_trainer",
                             "--simulate", "2x24GB", "--max-probes", "4", "--out", "rep",
                             "--no-plots")
    finally:
        sys.modules.pop(name, None)
    assert code == EXIT_OK, err
    summary = (tmp_path / "rep" / "summary.md").read_text()
    # 4 per card (per_device_train_batch_size) x 2 simulated cards, by hand
    batch = "batch: 8 samples per forward pass (per_device_train_batch_size 4 x 2 cards)"
    # the probes run the Trainer's own compute_loss now: no note about the loss; the optimizer's
    # note (built as the Trainer builds it) is the other one shown
    optimizer = "optimizer: "
    assert "as the Trainer builds it" in summary
    for note in (batch, optimizer):
        assert note in summary
        assert [line for line in err.splitlines() if line.startswith(f"dptune: {note}")], err
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["batch_size"] == 8
