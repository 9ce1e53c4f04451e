"""Run many small import checks in one Python process, each in a fresh forked child.

``python fresh_imports.py`` reads a JSON list of jobs on stdin, each ``{"torch": bool, "code":
str}``, and writes a JSON list of ``{"returncode", "stdout", "stderr"}`` in the same order. Each
job's code runs in its own child, forked from a parent that has imported nothing of dptune: the
jobs with ``torch`` false are forked before the parent imports anything beyond the standard
library (the state of ``python -c``), the others after the parent ran ``import torch`` (the
state of ``python -c "import torch; ..."``), so that no job sees a module another job imported
and torch's import is paid once instead of once per job. Each child's file descriptors 1 and 2
go to files of their own, so what the code prints (Python or C level) is read back whole.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def _run_child(code: str, out: int, err: int) -> None:
    os.dup2(out, 1)
    os.dup2(err, 2)
    status = 0
    try:
        exec(compile(code, "<job>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(code: str) -> dict:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(code, out.fileno(), err.fileno())
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {"returncode": os.waitstatus_to_exitcode(status),
                "stdout": out.read().decode(errors="replace"),
                "stderr": err.read().decode(errors="replace")}


def main() -> None:
    jobs = json.load(sys.stdin)
    results: list = [None] * len(jobs)
    for i, job in enumerate(jobs):
        if not job["torch"]:
            results[i] = _run(job["code"])
    if any(job["torch"] for job in jobs):
        import torch  # noqa: F401  (the state every remaining job starts from)

    for i, job in enumerate(jobs):
        if job["torch"]:
            results[i] = _run(job["code"])
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
