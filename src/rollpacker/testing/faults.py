"""Fault injection for the pipeline's crash tests: SIGKILL the process running a stage, or a
service's process while the stage waits on it.

Enable with ``ROLLPACKER_STAGE_HOOK=rollpacker.testing.faults:kill_at`` and
``ROLLPACKER_FAULT=<spec>[,...]``, a spec being ``<point>@<step>`` (the stage process at that hook
point, after the point's delay) or ``<point>:<ServiceClass>@<step>`` (at once at that point, every
Ray actor process of that service class: ``ray::RolloutService``, ``ray::RewardService`` (both the
reward and the judge service), ``ray::TrainerService``). Each spec fires
once: a file named after it in the directory ``$ROLLPACKER_FAULT_MARK`` records that it fired, so
the re-run goes through.
"""

from __future__ import annotations

import os
import signal
import threading

HOOK = "rollpacker.testing.faults:kill_at"


def kill_at(point: str, step: int, delay_s: float = 0.0) -> None:
    specs = [x.strip() for x in os.environ.get("ROLLPACKER_FAULT", "").split(",") if x.strip()]
    mark_dir = os.environ.get("ROLLPACKER_FAULT_MARK", "")
    if not mark_dir:
        return
    for spec in specs:
        where, _, at_step = spec.rpartition("@")
        at_point, _, service = where.partition(":")
        if at_point == point and at_step == str(step) and _first_time(mark_dir, spec):
            _kill(service, delay_s)


def mark_name(spec: str) -> str:
    """The file that records that ``spec`` fired."""
    return spec.replace("@", "-at-").replace(":", "-")


def _first_time(mark_dir: str, spec: str) -> bool:
    try:
        fd = os.open(os.path.join(mark_dir, mark_name(spec)), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False  # already fired once: the re-run goes through
    os.write(fd, f"pid {os.getpid()}\n".encode())
    os.close(fd)
    return True


def service_pids(service: str) -> list[int]:
    """The processes of Ray actors of class ``service`` (their title: ``ray::<Class>[.<method>]``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd and (cmd[0] == f"ray::{service}" or cmd[0].startswith(f"ray::{service}.")):
            out.append(p.pid)
    return out


def _kill(service: str, delay_s: float) -> None:
    def die() -> None:
        if not service:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        pids = service_pids(service)
        if not pids:
            raise RuntimeError(f"fault injection: no process of ray::{service} to kill")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    if delay_s <= 0 or service:  # a service dies at once: the stage is about to wait on it
        die()
        return
    threading.Timer(delay_s, die).start()
