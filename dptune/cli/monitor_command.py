"""``dptune show RUN`` for a monitored run's folder (:class:`dptune.MemoryMonitor`): every
rank's files merged, the summary printed and ``timeline.png`` drawn beside them."""

from __future__ import annotations

import json
from typing import Optional

from dptune.errors import EXIT_OK, OutputError

__all__ = ["show_run"]


def show_run(path: str, as_json: bool, html: Optional[str] = None) -> int:
    """Print the run's summary, draw ``timeline.png`` and write ``report.html`` beside it
    (``html``: another file or folder for the page)."""
    import os

    from dptune.monitor.record import load_run
    from dptune.report.html import write_html
    from dptune.report.html_run import render_run_html
    from dptune.report.timeline import render_run, write_timeline

    record = load_run(path)
    if as_json:
        print(json.dumps(dict(folder=record.folder, runs=list(record.metas), rows=list(record.rows),
                              events=[e.to_dict() for e in record.events], ooms=list(record.ooms)),
                         indent=2))
        return EXIT_OK
    print(render_run(record))
    try:
        drawn = write_timeline(record)
    except OSError as e:        # a read-only folder: the summary stands without the picture
        print(f"\n(timeline.png not drawn: {e.strerror or e}; copy the folder somewhere writable)")
    else:
        print(f"\ndrew {drawn}")
    target = html or os.path.join(record.folder, "report.html")
    if os.path.isdir(target):
        target = os.path.join(target, "report.html")
    try:
        write_html(render_run_html(record), target)
    except OSError as e:
        if html:        # asked for by name: the user's path cannot be written
            raise OutputError(f"cannot write {target!r} ({e.strerror or e}); give --html a file "
                              "you can write to") from None
        print(f"(report.html not written: {e.strerror or e})")
    else:
        print(f"wrote {target}")
    return EXIT_OK
