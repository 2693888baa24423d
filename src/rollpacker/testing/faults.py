"""Fault injection for the pipeline's crash tests: SIGKILL the process running a stage.

Enable with ``ROLLPACKER_STAGE_HOOK=rollpacker.testing.faults:kill_at`` and
``ROLLPACKER_FAULT=<point>@<step>[,...]``; each spec fires once: a file ``<point>-at-<step>`` in the
directory ``$ROLLPACKER_FAULT_MARK`` records that it fired, so the re-run goes through.
"""

from __future__ import annotations

import os
import signal
import threading

HOOK = "rollpacker.testing.faults:kill_at"


def kill_at(point: str, step: int, delay_s: float = 0.0) -> None:
    specs = [x.strip() for x in os.environ.get("ROLLPACKER_FAULT", "").split(",") if x.strip()]
    mark_dir = os.environ.get("ROLLPACKER_FAULT_MARK", "")
    if f"{point}@{step}" not in specs or not mark_dir:
        return
    try:
        fd = os.open(os.path.join(mark_dir, f"{point}-at-{step}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # already fired once: the re-run goes through
    os.write(fd, f"pid {os.getpid()}\n".encode())
    os.close(fd)

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if delay_s <= 0:
        die()
    threading.Timer(delay_s, die).start()
