"""``dptune show``, ``dptune plot`` (a saved report folder, or a DDP plan) and
``dptune devices`` (the visible GPUs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any, Optional

from dptune.cli.arguments import EPILOG
from dptune.cli.checks import check_out, out_path
from dptune.errors import EXIT_OK, ReportError, UsageError

__all__ = ["show_parser", "plot_parser", "devices_parser"]


def show_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("show", help="print a saved report's (DDP plan's, monitored run's) summary",
                              description="Print the summary of a report folder written by "
                                          "`dptune search` (the table of a length plan written "
                                          "by `dptune search --lengths`, the plan of `dptune "
                                          "plan`, a run watched by dptune.MemoryMonitor and "
                                          "its timeline.png).", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT",
                   help="report folder (or its report.json, lengths.json or plan.json), or a "
                        "monitored run's folder")
    p.add_argument("--json", action="store_true", help="print the report's JSON instead")
    p.add_argument("--html", metavar="FILE", nargs="?", const="", default=None,
                   help="write the report as one self-contained HTML page (default: report.html "
                        "in the report's folder) and print where it went")
    p.set_defaults(func=_show_command)


def _report_folder(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    return p.parent if p.is_file() else p


def _show_command(args: argparse.Namespace) -> int:
    from dptune.ddp.result import DDPPlan, is_plan_path
    from dptune.monitor.record import is_run
    from dptune.report import PLOT_KINDS, read_report, render_summary, report_dict

    if args.html is not None and args.json:
        raise UsageError("--html writes a page and --json prints the JSON: give one of them")
    if is_run(args.report):         # a run watched by dptune.MemoryMonitor (every rank merged)
        from dptune.cli.monitor_command import show_run

        return show_run(args.report, args.json, args.html or None)
    if is_plan_path(args.report):   # a DDP plan written by `dptune plan`
        plan = DDPPlan.load(args.report)
        if args.html is not None:
            from dptune.report.html_plans import render_plan_html

            return _write_page(render_plan_html(plan), args)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
        return EXIT_OK

    lengths = _length_plan_file(args.report)
    if lengths is not None:         # a plan per length bucket, by `dptune search --lengths`
        if args.html is not None:
            from dptune.report.html_plans import render_lengths_html

            from dptune.lengths.budget import token_budgets

            plan = _read_length_plan(lengths)
            return _write_page(render_lengths_html(plan, token_budgets(plan).describe()), args)
        print(_length_plan_text(lengths, args.json))
        return EXIT_OK
    result = read_report(args.report)
    if args.html is not None:
        from dptune.report.html import render_result_html

        return _write_page(render_result_html(result), args)
    if args.json:
        print(json.dumps(report_dict(result), indent=2))
        return EXIT_OK
    folder = _report_folder(args.report)
    plots = [k for k in PLOT_KINDS if (folder / f"{k}.png").exists()]
    print(render_summary(result, plots=plots))
    return EXIT_OK


def _length_plan_file(path: str) -> Optional[str]:
    """The ``lengths.json`` of a report written by ``dptune search --lengths`` when ``path`` is
    one (its folder, without a report.json, or that file); ``None`` otherwise."""
    from dptune.lengths.plan import PLAN_FILE

    p = pathlib.Path(path)
    if p.is_dir():
        found = (p / PLAN_FILE).is_file() and not (p / "report.json").exists()
        return str(p / PLAN_FILE) if found else None
    return str(p) if p.name == PLAN_FILE and p.is_file() else None


def _write_page(text: str, args: argparse.Namespace) -> int:
    """``dptune show --html [FILE]``: the page into FILE, or report.html in the report's folder."""
    from dptune.errors import OutputError
    from dptune.report.html import HTML_FILE, write_html

    target = pathlib.Path(args.html) if args.html else _report_folder(args.report) / HTML_FILE
    if target.is_dir():
        target = target / HTML_FILE
    try:
        write_html(text, str(target))
    except OSError as e:
        raise OutputError(f"cannot write {str(target)!r} ({e.strerror or e}); give --html a "
                          "file you can write to") from None
    print(f"wrote {target}")
    return EXIT_OK


def _read_length_plan(path: str) -> Any:
    """The length plan in ``path``, read and checked in one line on error."""
    from dptune.lengths.plan import LengthPlan
    from dptune.result.read import read_json

    file, data = read_json(path, "", "length plan", "dptune search --lengths FILE")
    try:
        return LengthPlan.from_dict(data)
    except ReportError as e:
        raise ReportError(f"{file!r}: {e}") from None


def _length_plan_text(path: str, as_json: bool) -> str:
    """What ``dptune search --lengths`` printed for the plan in ``path`` (one line per bucket
    and the token budget; with ``as_json`` its JSON), read and checked in one line on error."""
    from dptune.lengths.budget import token_budgets
    from dptune.lengths.render import render_text

    plan = _read_length_plan(path)
    if as_json:
        return json.dumps({**plan.to_dict(), "token_budget": token_budgets(plan).to_dict()},
                          indent=2)
    return render_text(plan)


def plot_parser(subparsers: Any) -> None:
    from dptune.report import PLOT_KINDS

    p = subparsers.add_parser("plot", help="redraw a saved report's plots",
                              description="Redraw the PNG plots of a report folder written by "
                                          "`dptune search`.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT", help="report folder (or its report.json)")
    p.add_argument("--kind", choices=PLOT_KINDS, action="append",
                   help="which plot (repeatable; default: every plot the report has)")
    p.add_argument("--out", metavar="DIR", type=out_path,
                   help="where to write the PNGs (default: the report folder)")
    p.set_defaults(func=_plot_command)


def _plot_command(args: argparse.Namespace) -> int:
    from dptune.report import read_report, write_plots

    if args.out:
        check_out(args.out, "--out")
    if _length_plan_file(args.report) is not None:
        raise UsageError(f"{args.report!r} is a length plan (`dptune search --lengths`): its "
                         "lengths.png needs the lengths, so re-run that command to draw it again")
    result = read_report(args.report)
    folder = pathlib.Path(args.out) if args.out else _report_folder(args.report)
    for kind in write_plots(result, folder, args.kind, flag="--out" if args.out else "REPORT"):
        print(f"wrote {folder / f'{kind}.png'}")
    return EXIT_OK


def devices_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("devices", help="list the visible GPUs",
                              description="List the CUDA GPUs this process can see, with the "
                                          "memory others use on them (from NVML).")
    p.set_defaults(func=_devices_command)


def _devices_command(args: argparse.Namespace) -> int:
    from dptune.cli.devices import devices, format_devices

    print(format_devices(devices()))
    return EXIT_OK
