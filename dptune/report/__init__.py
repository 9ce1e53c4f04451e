"""Rendering of a :class:`~dptune.result.model.TuneResult`: text, plots and report folders.

Rendering sits above the result: these modules import :mod:`dptune.result.model` for typing only
(``read_report`` reads through :func:`dptune.result.model.load_result` when called), and the result
never imports them. Render functions are pure: they return text, a ``pandas.DataFrame`` or a
matplotlib ``Figure``; :func:`write_report` and :func:`write_plots` write files. pandas and
matplotlib are imported inside the functions that need them, so importing this is cheap.

- :mod:`dptune.report.text`: :func:`render_table` (the terminal table), :func:`render_summary`
  (summary.md), :func:`result_table` and :func:`probes_table` (DataFrames; probes.csv)
- :mod:`dptune.report.plots`: :func:`plot_result` (``peaks``, ``fits``, ``max_batch``)
- :mod:`dptune.report.files`: :func:`write_report`, :func:`write_plots`, :func:`read_report`,
  :func:`check_output_folder`, :func:`report_dict` (report.json)
- :mod:`dptune.report.levels`: the budget level and the three figures per card (allocated,
  reserved, total use)
- :mod:`dptune.report.tables`: the one renderer of text and Markdown tables (:func:`text_table`,
  :func:`markdown_table`), also for DDP plans, length plans and ``dptune devices``

What ``TuneResult.table/plot/save/summary`` did::

    result_table(result)             # was result.table
    plot_result(result, "peaks")     # was result.plot("peaks")
    write_report(result, "reports/mynet")   # was result.save(...)
    render_summary(result)           # was result.summary()
    render_table(result)             # was str(result)
"""

from dptune.report.files import (REPORT_FILES, check_output_folder, figure_dpi, read_report,
                                 report_dict, write_plots, write_report)
from dptune.report.levels import CardMemory, budget_level, level_lines, memory_stats
from dptune.report.plots import DETAIL_CARDS, FIT_PANELS, fit_cards, highest_peak, plot_result
from dptune.report.tables import Align, markdown_table, text_table
from dptune.report.text import (PLOT_KINDS, budget_text, device_label, plot_kinds, probes_table,
                                render_summary, render_table, result_table)

__all__ = [
    "PLOT_KINDS", "plot_kinds", "device_label", "result_table", "probes_table", "render_table",
    "render_summary", "plot_result", "write_report", "write_plots", "read_report",
    "check_output_folder", "REPORT_FILES", "DETAIL_CARDS", "FIT_PANELS", "fit_cards",
    "highest_peak", "budget_text", "figure_dpi", "report_dict", "CardMemory", "budget_level",
    "level_lines", "memory_stats", "Align", "text_table", "markdown_table",
]
