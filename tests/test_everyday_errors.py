"""Everyday mistakes, through the command line's entry point and the API: each gets its exit
code and one line that says what is wrong and what to do, never a traceback of dptune's own.

Reports are checked when read, by the one reader that `show`, `plot` and
`load_result(path).wrap(model)` share; reports are written atomically.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from dptune.cli import main
from dptune.errors import DptuneWarning, OutputError, ReportError, SpecError, UsageError
from dptune.parallel import BalancedDataParallel
from dptune.report import files as report_mod
from dptune.report import plot_result, write_report
from dptune.result.model import TuneResult, load_result

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


def wrapped_dp():
    return nn.DataParallel(Net())


def wrapped_balanced():
    from dptune import BalancedDataParallel
    return BalancedDataParallel(Net())
'''

FAST = ["--simulate", "2x2GB", "--max-probes", "4", "--input-shape", "16", "--batch-size", "8",
        "--budget-level", "allocated"]    # 2 GB cards: NCCL's 1.6 GB (reserved level) leaves no room


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh module name in the working directory; returns (tmp_path, write(name, text))."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    names: list[str] = []

    def write(text: str, name: str = "") -> str:
        name = name or f"m_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(text, encoding="utf-8")
        names.append(name)
        return name

    yield tmp_path, write
    for name in names:
        sys.modules.pop(name, None)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(code: int, err: str, expected_code: int, *fragments: str) -> str:
    """The exit code, no traceback, and exactly one `dptune: error:` line holding fragments."""
    assert code == expected_code, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("dptune: error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ---- --out ---------------------------------------------------------------------------------

def test_out_at_an_existing_file(workdir, capsys):
    tmp, write = workdir
    name = write(MODEL)
    (tmp / "taken").write_text("x")
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST, "--out", "taken")
    one_line_error(code, err, 2, "--out 'taken' is an existing file", "give a folder path")
    assert (tmp / "taken").read_text() == "x"


def test_out_under_a_file(workdir, capsys):
    tmp, write = workdir
    name = write(MODEL)
    (tmp / "taken").write_text("x")
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST,
                       "--out", "taken/sub/report")
    one_line_error(code, err, 2, "lies under 'taken', which is a file")


def test_out_in_a_read_only_folder(workdir, capsys, monkeypatch):
    """(Root may write anywhere, so the folder's permission bits are stood in for.)"""
    tmp, write = workdir
    name = write(MODEL)
    (tmp / "ro").mkdir()
    real_access = os.access
    monkeypatch.setattr(report_mod.os, "access",
                        lambda p, mode: False if Path(p).name == "ro" else real_access(p, mode))
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST, "--out", "ro/rep")
    one_line_error(code, err, 2, "--out 'ro/rep': 'ro' is not writable")


def test_out_where_the_system_refuses(workdir, capsys):
    """/proc refuses new folders even to root: the OS's reason, in one line, exit 2."""
    _, write = workdir
    name = write(MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST,
                       "--out", "/proc/dptune-report")
    one_line_error(code, err, 2, "'/proc/dptune-report'", "give a folder you can write to")


def test_write_report_to_a_read_only_place_api(tmp_path, monkeypatch):
    """The API: an OSError while writing becomes OutputError, and nothing is left behind."""
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(report_mod.tempfile, "mkdtemp", refuse)
    with pytest.raises(OutputError, match=r"cannot write to --out .*Permission denied.*you can write"):
        write_report(make_result(), tmp_path / "rep", plots=False)
    assert list(tmp_path.iterdir()) == []


def test_out_folder_with_other_files_is_not_replaced(workdir, capsys):
    tmp, write = workdir
    name = write(MODEL)
    (tmp / "mine").mkdir()
    (tmp / "mine" / "thesis.tex").write_text("keep me")
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST, "--out", "mine")
    one_line_error(code, err, 2, "already holds files that are not a dptune report (thesis.tex)")
    assert (tmp / "mine" / "thesis.tex").read_text() == "keep me"


def test_plot_out_at_an_existing_file(tmp_path, capsys):
    folder = write_report(make_result(), tmp_path / "rep", plots=False)
    (tmp_path / "file.png").write_bytes(b"x")
    code, _, err = run(capsys, "plot", str(folder), "--out", str(tmp_path / "file.png"))
    one_line_error(code, err, 2, "is an existing file")
    assert (tmp_path / "file.png").read_bytes() == b"x"


# ---- atomic report writing ----------------------------------------------------------------

def test_interrupt_while_writing_leaves_no_partial_folder(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_mod, "render_summary", interrupted)  # the last file written
    with pytest.raises(KeyboardInterrupt):
        write_report(make_result(), tmp_path / "rep", plots=False)
    assert list(tmp_path.iterdir()) == []


def test_interrupt_while_rewriting_keeps_the_old_report(tmp_path, monkeypatch):
    old = make_result()
    folder = write_report(old, tmp_path / "rep", plots=False)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_mod, "probes_table", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_report(make_result("max_batch"), folder, plots=False)
    assert [p.name for p in tmp_path.iterdir()] == ["rep"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_rewriting_a_report_replaces_it_whole(tmp_path):
    folder = write_report(make_result("max_batch"), tmp_path / "rep")
    assert (folder / "max_batch.png").exists()
    write_report(make_result("balance"), folder, plots=False)
    assert sorted(p.name for p in folder.iterdir()) == ["probes.csv", "report.html", "report.json",
                                                         "summary.md"]
    assert TuneResult.load(str(folder)).objective == "balance"
    assert [p.name for p in tmp_path.iterdir()] == ["rep"]   # no temporary folder left


# ---- reports read back: one checked reader -------------------------------------------------

def _edit(folder: Path, change) -> None:
    data = json.loads((folder / "report.json").read_text())
    data = change(data)
    (folder / "report.json").write_text(json.dumps(data))


def _drop(key):
    def change(d):
        d.pop(key)
        return d
    return change


def _set(key, value):
    def change(d):
        d[key] = value
        return d
    return change


def _probe0(key, value):
    def change(d):
        d["probes"][0][key] = value
        return d
    return change


BAD_REPORTS = [
    (_drop("chunk_sizes"), "chunk_sizes is missing"),
    (_drop("probes"), "probes is missing"),
    (lambda d: [d], "holds a JSON array, expected a JSON object"),
    (_set("chunk_sizes", [1, 22, 41]), "chunk_sizes has 3 entries for 4 cards"),
    (_set("peak_bytes", ["1GB", 2, 3, 4]), "peak_bytes[0] is a string ('1GB'), expected an integer >= 0"),
    (_set("chunk_sizes", [1, 22, -1, 21]), "chunk_sizes[2] is int -1, expected an integer >= 0"),
    (_set("batch_size", 65), "batch_size is 65 but chunk_sizes [1, 22, 22, 19] sum to 64"),
    (_set("headroom_bytes", "1GiB"), "headroom_bytes is a string ('1GiB'), expected an integer"),
    (_set("devices", {}), "devices is a JSON object, expected a list"),
    (_probe0("peak_bytes", [1, 2]), "probes[0].peak_bytes has 2 entries for 4 cards"),
    (_probe0("oom_device", 7), "probes[0].oom_device is 7, but there are only 4 cards"),
    (_set("objective", "fastest"), "objective is 'fastest', expected one of balance, max_batch"),
    # issue 22: these three were read without a word
    (_set("brackets", [dict(card=i, lo=8, hi=9) for i in range(3)]),
     "brackets has 3 entries for 4 cards"),
    (_set("brackets", [dict(card=7 if i == 3 else i, lo=8, hi=9) for i in range(4)]),
     "brackets[3].card is 7, but there are only 4 cards"),
    (lambda d: {**d, "even": {**d["even"], "implied_by": [2, 99]}},
     "even.implied_by names probe #99, but the report has 3 probe(s) (#1..#3)"),
    (lambda d: {**d, "probes": [{**d["probes"][0], "peak_bytes": [1, 2, 3, -4]}] + d["probes"][1:]},
     "probes[0].peak_bytes[3] is int -4, expected an integer >= 0"),
]


@pytest.fixture
def saved(tmp_path):
    return write_report(make_result(), tmp_path / "rep", plots=False)


@pytest.mark.parametrize("change, message", BAD_REPORTS)
def test_show_and_plot_refuse_a_bad_report(saved, capsys, change, message):
    _edit(saved, change)
    for command in ("show", "plot"):
        code, _, err = run(capsys, command, str(saved))
        line = one_line_error(code, err, 2, message, "re-run `dptune search`")
        assert str(saved / "report.json") in line


@pytest.mark.parametrize("change, message", BAD_REPORTS[:6])
def test_from_report_refuses_a_bad_report(saved, change, message):
    _edit(saved, change)
    with pytest.raises(ReportError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)").replace("]", r"\]")):
        load_result(saved).wrap(nn.Linear(2, 2))


def test_truncated_report_is_one_line(saved, capsys):
    text = (saved / "report.json").read_text()
    (saved / "report.json").write_text(text[: len(text) // 2])
    code, _, err = run(capsys, "show", str(saved))
    one_line_error(code, err, 2, "is not valid JSON", "re-run `dptune search`")


def test_brackets_one_per_card_and_implied_probes_in_the_report_read_fine(saved, capsys):
    """The checks above refuse only what is wrong: four brackets for four cards and an even
    split implied by probes #1 and #3 of three are read and shown."""
    _edit(saved, lambda d: {**d, "brackets": [dict(card=i, lo=8, hi=9) for i in range(4)],
                            "even": {**d["even"], "implied_by": [1, 3]}})
    result = TuneResult.load(str(saved))
    assert [b.card for b in result.brackets] == [0, 1, 2, 3]
    assert result.even.implied_by == (1, 3)
    code, out, err = run(capsys, "show", str(saved))
    assert code == 0 and "dptune: error" not in err


def test_a_valid_report_reads_back_equal(saved):
    assert TuneResult.load(str(saved)) == make_result()


def test_max_batch_plot_of_a_balance_report_is_refused(saved, capsys):
    code, _, err = run(capsys, "plot", str(saved), "--kind", "max_batch")
    one_line_error(code, err, 2, "only a search with --objective max-batch finds",
                   "choose peaks or fits")
    assert not (saved / "max_batch.png").exists()
    with pytest.raises(UsageError, match="objective is balance"):
        plot_result(make_result("balance"), kind="max_batch")


# ---- sizes and specs -----------------------------------------------------------------------

def test_absurd_batch_size_is_a_usage_error(workdir, capsys):
    _, write = workdir
    name = write(MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", "--simulate", "2x2GB",
                       "--input-shape", "16", "--batch-size", str(10**18))
    assert code == 2 and "Traceback" not in err
    assert "argument --batch-size" in err and "beyond what any cluster holds" in err
    assert "raised" not in err   # not blamed on the user's code


def test_input_shape_with_an_empty_dimension(workdir, capsys):
    _, write = workdir
    name = write(MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", "--simulate", "2x2GB",
                       "--input-shape", "3,,224")
    assert code == 2 and "Traceback" not in err
    assert "argument --input-shape: '3,,224': give one sample's shape as positive ints" in err


def test_context_larger_than_the_card_is_a_spec_error(workdir, capsys):
    _, write = workdir
    name = write(MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", "--input-shape", "16",
                       "--simulate", "4x24GB,context=30GB")
    one_line_error(code, err, 2, "context=30.0 GiB leaves nothing of card 0's 24.0 GiB")
    from dptune.backends.simulated import parse_cluster

    with pytest.raises(SpecError, match="context="):
        parse_cluster("4x24GB,context=30GB")


def test_unicode_module_and_class_names(workdir, capsys):
    tmp, write = workdir
    write(MODEL.replace("class Net(", "class Nét(").replace("Net()", "Nét()"), name="modèle_ü")
    code, out, err = run(capsys, "search", "--model", "modèle_ü:Nét", *FAST, "--out", "rep", "-q")
    assert code == 0, err
    assert TuneResult.load(str(tmp / "rep")).model_name == "Nét"


# ---- the user's module at import -------------------------------------------------------------

def test_module_calling_sys_exit_at_import(workdir, capsys):
    _, write = workdir
    name = write("import sys\nsys.exit(3)\n")
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST)
    line = one_line_error(code, err, 1, f"importing '{name}:Net' (--model)",
                          "the module exited (sys.exit(3)) while being imported",
                          'if __name__ == "__main__":')
    assert "no split" not in line


def test_module_parsing_argv_at_import(workdir, capsys):
    _, write = workdir
    name = write("import argparse\np = argparse.ArgumentParser()\n"
                 "p.add_argument('--lr', required=True)\np.parse_args()\n" + MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST)
    one_line_error(code, err, 1, "the module exited (sys.exit(2))", "the module's own",
                   "not dptune's")
    # argparse's own lines name the user's module, not `dptune`
    assert f"usage: {name} [-h] --lr LR" in err
    assert "dptune: error: the following arguments" not in err


def test_module_parsing_argv_with_defaults_imports_fine(workdir, capsys):
    """A module that parses the command line at import sees no arguments, not dptune's."""
    _, write = workdir
    name = write("import argparse\np = argparse.ArgumentParser()\n"
                 "p.add_argument('--lr', default=1.0)\nARGS = p.parse_args()\n" + MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST, "--out", "rep", "-q")
    assert code == 0, err


# ---- already wrapped models -------------------------------------------------------------------

@pytest.mark.parametrize("factory, wrapper", [("wrapped_dp", "DataParallel"),
                                              ("wrapped_balanced", "BalancedDataParallel")])
def test_cli_unwraps_a_wrapped_model_and_says_so(workdir, capsys, factory, wrapper):
    tmp, write = workdir
    name = write(MODEL)
    code, _, err = run(capsys, "search", "--model", f"{name}:{factory}", *FAST, "--out", "rep", "-q")
    assert code == 0, err
    notes = [line for line in err.splitlines() if "wrapped" in line]
    assert notes == [f"dptune: the model is wrapped in {wrapper}; dptune tunes the module inside "
                     "it (model.module, a Net) and wraps that in its own BalancedDataParallel"]
    assert TuneResult.load(str(tmp / "rep")).chunk_sizes


def test_tuner_unwraps_a_wrapped_module_and_a_wrapped_factory():
    from dptune import Tuner

    net = nn.Sequential(nn.Linear(16, 16))
    before = {k: v.clone() for k, v in net.state_dict().items()}
    for model in (nn.DataParallel(net), lambda: BalancedDataParallel(nn.Linear(16, 16))):
        with pytest.warns(DptuneWarning, match="the model is wrapped in"):
            result = Tuner(model, lambda n: torch.randn(n, 16), batch_size=8, simulate="2x24GB",
                           verbose=False, max_probes=4).fit()
        assert result.batch_size == 8
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DptuneWarning)   # a plain module: no warning
        Tuner(net, lambda n: torch.randn(n, 16), batch_size=8, simulate="2x24GB",
              verbose=False, max_probes=4).fit()


# ---- plots -----------------------------------------------------------------------------------

def _texts(fig) -> list[str]:
    ax = fig.axes[0]
    return ([t.get_text() for t in ax.get_xticklabels(minor=True)]
            + [t.get_text() for t in ax.texts])


def test_peaks_labels_say_samples_and_share_of_budget():
    fig = plot_result(make_result("balance"), "peaks")
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels(minor=True)]
    # under each bar: the split, its samples, its share; the rows are named once at the left
    # ("samples" under every bar made 8-digit counts run into each other)
    assert ticks[0] == "even\n16\n" + ticks[0].splitlines()[2]
    assert ticks[1].startswith("dptune\n1\n") and ticks[1].endswith("%")
    assert not any("smp" in t for t in _texts(fig))
    assert "split\nsamples on the card\nshare of budget" in _texts(fig)


def test_peaks_show_memory_used_by_other_processes():
    """make_result's card 3 has 2 GiB taken by another process: drawn at the top of that card."""
    from dptune.units import GiB

    result = make_result("balance")
    fig = plot_result(result, "peaks")
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "used by other processes" in labels
    others = [p for p in ax.patches if p.get_hatch() == "xx"]
    assert len(others) == 1
    bar = others[0]
    assert bar.get_x() + bar.get_width() / 2 == pytest.approx(3)
    assert bar.get_y() == pytest.approx(22) and bar.get_height() == pytest.approx(2)
    assert result.devices[3].used_bytes == 2 * GiB


def test_card0_fit_panel_draws_probes_where_they_were_measured():
    """A probe that fitted at a smaller batch is never drawn above card 0's budget."""
    from dptune.units import GiB

    result = make_result("max_batch")
    fig = plot_result(result, "fits")
    ax0 = fig.axes[0]
    budget = result.budget_bytes[0] / GiB
    measured = {(p.chunk_sizes[0], p.peak_bytes[0] / GiB) for p in result.probes}
    measured.add((result.chunk_sizes[0], result.peak_bytes[0] / GiB))
    drawn = [tuple(xy) for coll in ax0.collections for xy in coll.get_offsets()]
    assert drawn and all(any(x == c and y == pytest.approx(m) for c, m in measured)
                         for x, y in drawn)
    fitted = [p for p in result.probes if p.feasible]
    assert all(p.peak_bytes[0] / GiB <= budget for p in fitted)
    assert "probe at another batch size" in [t.get_text() for t in fig.legends[0].get_texts()]


def many_cards(n: int, objective: str = "balance") -> TuneResult:
    """A hand-built result over n 24 GiB cards (a few with memory taken by others)."""
    from dptune.backends.base import Device, ProbeResult
    from dptune.result.model import Fit, SplitFigures, imbalance
    from dptune.split import even_split
    from dptune.units import GiB

    devices = [Device(index=i, name="Virtual 24GB", total_bytes=24 * GiB,
                      used_bytes=GiB if i % 97 == 5 else 0) for i in range(n)]
    budgets = [d.budget_bytes(GiB) for d in devices]
    batch = 8 * n

    def peaks(chunks):
        return tuple(2 * GiB + c * GiB // 2 + (4 * GiB if i == 0 else 0)
                     for i, c in enumerate(chunks))

    even = even_split(batch, n)
    ours = [4] + [8 + (1 if i <= 4 * (n - 1) % (n - 1) and i else 0) for i in range(1, n)]
    ours[-1] += batch - sum(ours)
    probes = [ProbeResult(tuple(even), peaks(even), purpose="even"),
              ProbeResult(tuple(ours), peaks(ours), purpose="verify")]
    return TuneResult(
        objective=objective, backend="simulated", cluster=f"{n}x24GB (simulated)",
        model_name="Net", devices=devices, headroom_bytes=GiB, budget_bytes=budgets,
        chunk_sizes=ours, peak_bytes=list(peaks(ours)),
        even=SplitFigures(tuple(even), peaks(even), imbalance(peaks(even), budgets, even)),
        probes=probes, fits=[Fit(2 * GiB + (4 * GiB if i == 0 else 0), GiB / 2, points=2)
                             for i in range(n)])


# 256 cards in `make test`; 1000 (the same bounded-size drawing, seconds more) in `make test-slow`
@pytest.mark.parametrize("n", [256, pytest.param(1000, marks=pytest.mark.slow)])
def test_many_cards_plots_stay_readable_and_quick(tmp_path, n):
    from PIL import Image

    result = many_cards(n, "max_batch")
    folder = write_report(result, tmp_path / "rep")
    # it took minutes, for a 228,300-pixel-wide PNG: the size is bounded (no wall clock here)
    for kind in ("peaks", "fits", "max_batch"):
        with Image.open(folder / f"{kind}.png") as im:
            assert max(im.size) <= 4000, (kind, im.size)
    fig = plot_result(result, "peaks")
    assert fig.get_size_inches()[0] <= 12
    assert f"{n} cards" in fig.axes[0].get_title()
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines[:2]] == [n, n]   # one point per card
    fits = plot_result(result, "fits")
    panels = [a for a in fits.axes if a.get_visible()]
    assert len(panels) == 8 and panels[0].get_title().startswith("0: ")
    assert f"8 of {n} cards" in fits.get_suptitle()



# ---- messages --------------------------------------------------------------------------------

VALUE_READING = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum() if y.sum().item() > 0 else y
'''


def test_value_reading_model_is_refused_in_one_line(workdir, capsys):
    _, write = workdir
    name = write(VALUE_READING)
    code, _, err = run(capsys, "search", "--model", f"{name}:Net", *FAST, "-q")
    line = one_line_error(code, err, 4, f"the model reads tensor values at {name}.py:13",
                          "y.sum().item()", "tune on real GPUs (--devices)")
    assert err.strip() == line          # nothing else: no FakeTensor internals
    assert "fake_tensor" not in err


# ---- the README's commands -------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    """The `dptune ...` lines of the quickstart's "From the shell" blocks, as argument lists."""
    import shlex

    text = (ROOT / "docs" / "getting-started" / "quickstart.md").read_text(encoding="utf-8")
    section = text.split("## From the shell", 1)[1].split("\n## ", 1)[0]
    block = "\n".join(b.split("```", 1)[0] for b in section.split("```bash")[1:])
    joined = block.replace("\\\n", " ")
    return [shlex.split(line.split(" #", 1)[0])[1:] for line in joined.splitlines()
            if line.startswith("dptune ")]


def test_readme_show_and_plot_commands_work_as_written(tmp_path, monkeypatch, capsys):
    """Run from a copy of the repository's reports/, so the committed example is untouched."""
    import shutil

    shutil.copytree(ROOT / "reports" / "TinyGPT-4x24GB", tmp_path / "reports" / "TinyGPT-4x24GB")
    monkeypatch.chdir(tmp_path)
    commands = [c for c in readme_commands() if c[0] in ("show", "plot")]
    assert [c[0] for c in commands] == ["show", "plot"]
    before = {p.name: p.read_bytes() for p in (tmp_path / "reports" / "TinyGPT-4x24GB").iterdir()}
    for argv in commands:
        code, out, err = run(capsys, *argv)
        assert code == 0, (argv, err)
    assert out.count("wrote reports/_scratch/plots/") == 3
    after = {p.name: p.read_bytes() for p in (tmp_path / "reports" / "TinyGPT-4x24GB").iterdir()}
    assert after == before      # the README's commands leave the example as committed


def test_readme_simulated_search_writes_to_scratch(monkeypatch):
    """The README's simulated search writes under reports/_scratch (git-ignored), as `make
    demo` does: neither rewrites the committed example."""
    search = [c for c in readme_commands() if c[0] == "search" and "--simulate" in c]
    assert len(search) == 1 and search[0][search[0].index("--out") + 1].startswith("reports/_scratch/")
    makefile = (ROOT / "Makefile").read_text()
    demo = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert "--out $(DEMO)" in demo and "DEMO   := reports/_scratch/" in makefile
    assert "reports/_scratch/" in (ROOT / ".gitignore").read_text().split()


def test_a_ddp_wrapped_model_is_unwrapped_with_one_line():
    """DDP needs a process group to be built; its wrapper shape (a module under .module) is
    all unwrapping reads, so one is assembled without one."""
    from torch.nn.parallel import DistributedDataParallel

    from dptune.step.workload import unwrap_parallel

    net = nn.Linear(4, 4)
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = net
    with pytest.warns(DptuneWarning) as caught:
        assert unwrap_parallel(ddp) is net
    assert [str(w.message) for w in caught] == [
        "the model is wrapped in DistributedDataParallel; dptune tunes the module inside it "
        "(model.module, a Linear) and wraps that in its own BalancedDataParallel"]


# ---- exit 3 says by how much, and blames only what is there -------------------------------------

BIG = '''
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])

    def forward(self, x):
        return self.layers(x)
'''


def test_no_fit_says_by_how_much_and_names_no_optimizer_without_one(workdir, capsys):
    """4 x 4 MiB of weights (and as much of gradients on card 0) on 24 MiB cards, headroom 0."""
    _, write = workdir
    name = write(BIG)
    for optimizer in ("none", "adamw"):
        code, _, err = run(capsys, "search", "--model", f"{name}:Net", "--input-shape", "1024",
                           "--batch-size", "8", "--simulate", "2x24MiB,context=1MiB",
                           "--headroom", "0", "--optimizer", optimizer, "-q",
                           "--budget-level", "allocated")   # the figures pinned are allocated
        line = one_line_error(code, err, 3, "no split of batch size 8 fits every card's budget",
                              "MiB over", "Try a smaller batch_size")
        if optimizer == "none":
            assert "optimizer" not in line


def test_every_probe_out_of_memory_still_gives_the_amount():
    """The message takes the amount from the closest out-of-memory probe (a lower bound)."""
    from dptune.backends.base import ProbeResult
    from dptune.search.messages import card0_holdings, infeasible_error
    from dptune.units import MiB

    probes = [ProbeResult((4, 4), (900 * MiB, 700 * MiB), oom_device=0,
                          breakdown=({"weights": 1, "optimizer": 0}, {"weights": 1})),
              ProbeResult((0, 8), (650 * MiB, 900 * MiB), oom_device=1)]
    e = infeasible_error(0, None, 8, "every one of 2 probes ran out of memory",
                         probes=probes, budgets=[512 * MiB, 512 * MiB])
    assert ("the closest probe, split [4, 4], is at least 388.0 MiB over card 0's budget"
            in str(e)), str(e)
    assert e.shortfall_bytes == 388 * MiB
    assert card0_holdings(probes[:1]) == "master weights, gradients and the gathered outputs"
    assert "optimizer state" in card0_holdings(probes[1:])   # no breakdown: cannot tell


def test_progress_bar_total_does_not_change(capsys):
    """The bar counts up to the most probes the search may run and keeps that total."""
    import re

    from dptune import Tuner

    Tuner(nn.Linear(16, 16), lambda n: torch.randn(n, 16), batch_size=8, simulate="2x24GB",
          verbose=True, max_probes=6).fit()
    err = capsys.readouterr().err
    totals = set(re.findall(r"\| ?\d+/(\d+) \[", err))
    assert totals == {"6"}, err


def test_absurd_batch_size_through_the_api():
    from dptune import Tuner

    with pytest.raises(UsageError, match=r"batch_size=1000000000000000000 is beyond what any "
                                         r"cluster holds \(at most 1,099,511,627,776 samples\)"):
        Tuner(nn.Linear(8, 8), lambda n: torch.randn(n, 8), batch_size=10**18, simulate="2x24GB")
