"""Report folders: :func:`write_report` (atomic), :func:`write_plots`, :func:`read_report`.

A report folder holds::

    report.json    report_dict(result): result.to_dict(), versioned (read back with
                   read_report / load_result), plus budget_level and, where known, per card
                   of dptune's split memory_stats under torch's key names
    probes.csv     one row per probe (numbered from 1): split, within budget and by how much,
                   per-card peaks in bytes, OOM card, seconds
    summary.md     the Markdown summary (render_summary)
    report.html    one self-contained page: the split, every card's bars against its budget,
                   the fits, the probes, the advice (dptune.report.html; no script, offline)
    peaks.png      per-card peak memory, even split beside dptune's, against each budget
    fits.png       per-card memory against chunk size: probes, fitted lines, chosen split
    max_batch.png  (objective max_batch) largest batch that fits, even split vs dptune
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Optional, Sequence

from dptune.errors import OutputError, ReportError
from dptune.report.html import HTML_FILE, render_result_html
from dptune.report.levels import budget_level, memory_stats
from dptune.report.plots import plot_result
from dptune.report.text import PLOT_KINDS, plot_kinds, probes_table, render_summary

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from dptune.result.model import TuneResult

__all__ = ["REPORT_FILES", "check_output_folder", "write_report", "write_plots", "read_report",
           "figure_dpi", "report_dict", "default_folder"]

def default_folder(model: str, cluster: str, *, prefix: str = "", suffix: str = "",
                   strip_remark: bool = True) -> pathlib.Path:
    """``reports/<prefix><Model>-<cluster><suffix>`` in characters safe for a file name, e.g.
    ``reports/TinyGPT-4x24GB``; ``strip_remark``: the cluster's description without its
    parenthesised remark (``" (simulated, sm 8.0 assumed)"``). The one naming rule of the
    folders ``dptune search`` and ``dptune plan`` write without ``--out``."""
    import re

    if strip_remark:
        cluster = re.sub(r"\s*\(.*\)\s*$", "", cluster)
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", cluster).strip("_") or "cluster"
    name = re.sub(r"[^A-Za-z0-9.+-]+", "_", model).strip("_") or "model"
    return pathlib.Path("reports") / f"{prefix}{name}-{slug}{suffix}"


#: What a report folder holds; an existing folder with only these (or nothing) is replaced.
REPORT_FILES = ("report.json", "probes.csv", "summary.md", "report.html") + tuple(
    f"{k}.png" for k in PLOT_KINDS)


def check_output_folder(directory: str | pathlib.Path, flag: str = "--out", *,
                        report: bool = False) -> pathlib.Path:
    """Check early that ``directory`` can become a folder of files (before minutes of probing).

    Raises :class:`OutputError` in one line when it is an existing file, lies under a file,
    or its nearest existing parent is not writable; with ``report``, also when it is a folder
    holding anything but a report's files (which :func:`write_report` would replace).
    Returns the path.
    """
    out = pathlib.Path(directory)
    what = f"{flag} {str(out)!r}"
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} is an existing file, not a folder; give a folder path "
                          "(it is created if missing)")
    parent = out
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise OutputError(f"{what} lies under {str(parent)!r}, which is a file; give a folder "
                          "path that is not inside a file")
    if parent.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: {str(parent)!r} is not writable; give a folder you can "
                          "write to")
    if report and out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise OutputError(f"{what} already holds files that are not a dptune report "
                              f"({shown}); give a new or empty folder")
    return out


def report_dict(result: TuneResult) -> dict[str, Any]:
    """What report.json holds (and ``--json`` prints): ``result.to_dict()`` plus two derived
    keys the reader does not need: ``budget_level`` (``"allocated"`` or ``"reserved"``) and
    ``memory_stats``, per card of dptune's split, ``allocated_bytes.all.peak``,
    ``reserved_bytes.all.peak``, ``num_alloc_retries`` (torch's key names) and
    ``total_bytes`` (the card's total use), or ``None`` where only the allocated peak is known
    (:mod:`dptune.report.levels`)."""
    d = result.to_dict()
    d["budget_level"] = budget_level(result)
    d["memory_stats"] = memory_stats(result)
    return d


def _output_error(e: OSError, out: pathlib.Path, flag: str) -> OutputError:
    reason = e.strerror or type(e).__name__
    return OutputError(f"cannot write to {flag} {str(out)!r}: {reason}"
                       f"{f' ({e.filename})' if e.filename and str(e.filename) != str(out) else ''}"
                       "; give a folder you can write to")


def write_report(result: TuneResult, directory: str | pathlib.Path, *,
                 plots: bool = True, flag: str = "--out") -> pathlib.Path:
    """Write report.json, probes.csv, summary.md, report.html and (unless ``plots=False``) the PNG plots
    into ``directory``; returns the folder.

    Atomic: everything is written into a temporary folder beside it, which is renamed into
    place at the end, so an error or Ctrl-C leaves either the old folder or the new one,
    never a partial one. An existing folder is replaced only when it holds nothing but a
    report's files; a folder with anything else raises :class:`OutputError`, as does a
    path that cannot be written (``flag`` names the option in the message).
    """
    out = check_output_folder(directory, flag, report=True)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    except OSError as e:
        raise _output_error(e, out, flag) from None
    old: Optional[pathlib.Path] = None
    try:
        (tmp / "report.json").write_text(json.dumps(report_dict(result), indent=2) + "\n",
                                         encoding="utf-8")
        probes_table(result).to_csv(tmp / "probes.csv", index=False)
        kinds = write_plots(result, tmp) if plots else []
        (tmp / "summary.md").write_text(render_summary(result, plots=kinds), encoding="utf-8")
        (tmp / HTML_FILE).write_text(render_result_html(result), encoding="utf-8")
        os.chmod(tmp, 0o777 & ~_umask())   # mkdtemp makes it private; a report is not
        if out.exists():
            old = out.with_name(f".{out.name}.{os.getpid()}.old")
            shutil.rmtree(old, ignore_errors=True)   # left by a run that was killed
            os.replace(out, old)
        os.replace(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
            old = None
        raise _output_error(e, out, flag) from None
    except BaseException:  # Ctrl-C, or an error while rendering: no partial folder is left
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out.exists():
            os.replace(old, out)
            old = None
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_plots(result: TuneResult, directory: str | pathlib.Path,
                kinds: Optional[Sequence[str]] = None, *, flag: str = "--out") -> list[str]:
    """Draw ``kinds`` (default: every plot of :func:`plot_kinds`) into ``<directory>/<kind>.png``
    and return them. Each file is written beside its final name and renamed into place."""
    out = check_output_folder(directory, flag)
    kinds = plot_kinds(result) if kinds is None else list(kinds)
    figures = {kind: plot_result(result, kind=kind) for kind in kinds}  # refusals come first
    try:
        out.mkdir(parents=True, exist_ok=True)
        for kind, fig in figures.items():
            tmp = out / f".{kind}.png.tmp"
            try:
                fig.savefig(tmp, dpi=figure_dpi(fig), format="png")
                os.replace(tmp, out / f"{kind}.png")
            finally:
                if tmp.exists():
                    tmp.unlink()
    except OSError as e:
        raise _output_error(e, out, flag) from None
    return kinds


#: Largest PNG side in pixels: a figure is drawn at a lower resolution rather than wider.
_MAX_PIXELS = 4000


def figure_dpi(fig: "Figure") -> float:
    """The resolution a plot is written at (120 dpi, less for a figure wider than 4000 px)."""
    w, h = fig.get_size_inches()
    return min(120.0, _MAX_PIXELS / max(w, h, 1.0))


def read_report(path: str | pathlib.Path) -> TuneResult:
    """Read and check a result from a report folder or its ``report.json``: the one reader,
    :func:`dptune.result.model.load_result` (also ``TuneResult.load``), plus the derived
    ``budget_level`` a report writes, which must be the level its probes were checked at
    (:class:`ReportError` otherwise: an edited report is not shown as it is)."""
    from dptune.result.model import load_result   # the data layer below; kept out of import time
    from dptune.result.read import read_json

    result = load_result(path)
    _, data = read_json(result.source or path, "report.json", "report", "dptune search")
    stored, level = data.get("budget_level"), budget_level(result)
    if stored is not None and stored != level:   # derived from the probes when written
        raise ReportError(f"the report {result.source!r} is not valid: budget_level is "
                          f"{stored!r} but its probes were checked at the {level!r} level; "
                          "re-run `dptune search` to write it again")
    return result

