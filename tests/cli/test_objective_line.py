"""`dptune search` and `dptune plan` keep their own default objectives (balance, throughput);
the first line each prints says which objective it answered and how to ask for the others."""

from __future__ import annotations

import pytest

from dptune.cli import main
from dptune.cli.objectives import objective_line
from dptune.errors import EXIT_USAGE

OBJECTIVES = ("balance", "max-batch", "throughput")
NOWHERE = ["--model", "no_such_module_anywhere:Net", "--input-shape", "16", "--simulate", "2x2GB",
           "--batch-size", "8"]


@pytest.mark.parametrize("command, default", [("search", "balance"), ("plan", "throughput")])
def test_the_line_names_the_default_and_every_other_objective(command, default):
    line = objective_line(command, None if command == "plan" else default)
    assert line.startswith(f"dptune: objective {default}: ")
    assert f"the default of dptune {command}" in line
    for other in OBJECTIVES:
        if other != default:
            assert f"--objective {other}: " in line, line
    assert f"--objective {default}:" not in line


@pytest.mark.parametrize("command", ["search", "plan"])
@pytest.mark.parametrize("asked", OBJECTIVES)
def test_an_objective_asked_for_is_said_as_asked(command, asked):
    line = objective_line(command, asked)
    assert line.startswith(f"dptune: objective {asked}: ")
    default = "balance" if command == "search" else "throughput"
    assert ("as asked" in line) == (asked != default)


def test_with_lengths_balance_is_never_offered():
    # search --lengths plans each bucket's largest batch; its default flag value is balance
    assert objective_line("search", "balance", lengths=True).startswith("dptune: objective max-batch: ")
    assert objective_line("plan", None, lengths=True).startswith("dptune: objective throughput: ")
    for command in ("search", "plan"):
        for asked in (None, "max-batch", "throughput"):
            assert "balance" not in objective_line(command, asked, lengths=True)


@pytest.mark.parametrize("command, default", [("search", "balance"), ("plan", "throughput")])
def test_the_command_prints_it_first_and_quiet_leaves_it_out(command, default, capsys):
    code = main([command, *NOWHERE])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE and out == ""       # the module does not exist: one error line
    lines = err.splitlines()
    assert lines[0] == objective_line(command, None if command == "plan" else default), err
    assert [line for line in lines if line.startswith("dptune: error:")] == [lines[-1]]
    code = main([command, *NOWHERE, "--objective", "max-batch", "--quiet"])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE and "objective" not in err and err.startswith("dptune: error:")
