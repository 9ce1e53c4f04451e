"""``dptune show RUN`` for a monitored run's folder (:class:`dptune.MemoryMonitor`): every
rank's files merged, the summary printed and ``timeline.png`` drawn beside them."""

from __future__ import annotations

import json

from dptune.errors import EXIT_OK

__all__ = ["show_run"]


def show_run(path: str, as_json: bool) -> int:
    from dptune.monitor.record import load_run
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
    return EXIT_OK
