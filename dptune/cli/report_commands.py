"""``dptune show``, ``dptune plot`` (a saved report folder, or a DDP plan) and
``dptune devices`` (the visible GPUs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from dptune.cli.arguments import EPILOG
from dptune.cli_checks import check_out, out_path
from dptune.errors import EXIT_OK

__all__ = ["show_parser", "plot_parser", "devices_parser"]

def show_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("show", help="print a saved report's (or DDP plan's) summary",
                              description="Print the summary of a report folder written by "
                                          "`dptune search`.", epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", metavar="REPORT", help="report folder (or its report.json)")
    p.add_argument("--json", action="store_true", help="print report.json's content instead")
    p.set_defaults(func=_show_command)


def _report_folder(path: str) -> pathlib.Path:
    p = pathlib.Path(path)
    return p.parent if p.is_file() else p


def _show_command(args: argparse.Namespace) -> int:
    from dptune.ddp.result import DDPPlan, is_plan_path
    from dptune.report import PLOT_KINDS, read_report, render_summary, report_dict

    if is_plan_path(args.report):   # a DDP plan written by `dptune plan`
        plan = DDPPlan.load(args.report)
        print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.summary())
        return EXIT_OK

    result = read_report(args.report)
    if args.json:
        print(json.dumps(report_dict(result), indent=2))
        return EXIT_OK
    folder = _report_folder(args.report)
    plots = [k for k in PLOT_KINDS if (folder / f"{k}.png").exists()]
    print(render_summary(result, plots=plots))
    return EXIT_OK


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
    from dptune.gpus import devices, format_devices

    print(format_devices(devices()))
    return EXIT_OK
