"""Fault injection for the pipeline's crash tests and the chaos suite: SIGKILL the process running
a stage, or a service's process while the stage waits on it; restart the S3 server; take MLflow
down for a step; hang a sandbox run.

Enable with ``ROLLPACKER_STAGE_HOOK=rollpacker.testing.faults:kill_at`` and
``ROLLPACKER_FAULT=<spec>[,...]``, a spec being ``<point>[:<target>]@<step>`` (``point`` a stage
hook point: ``plan``, ``rollout``, ``reward``, ``judge``, ``train``, ``commit``; and the
experiment's own, at step -1: ``setup`` once the local services are up, before the checks of the
store, MLflow and Ray, and ``compare`` after the comparison is read, before it is logged):

- no target: SIGKILL of the stage process at that point (after the point's delay);
- ``SIGINT``: a SIGINT (Ctrl-C) to the stage process at that point, at once;
- ``ctrl-c`` / ``kill-run``: a SIGINT / SIGKILL, at once, to the stage process's whole process
  group: the run's driver and, under the KFP runner, the ``kfp.local`` task running the stage
  (its subprocess), as a terminal's Ctrl-C or a ``kill -9`` of the run's group would;
- ``RolloutService``, ``RewardService`` (both the reward and the judge service),
  ``TrainerService``, ...: at once, SIGKILL of every Ray actor process of that class
  (``ray::<Class>``);
- ``EngineCore``: SIGKILL of the vLLM engine core processes inside the rollout service (they are
  processes of their own only with engine layouts, ``planner.devices >= 1``) the next time they
  are busy (decoding a round or loading weights): a watcher process the hook starts waits for
  that, as a crash under load would come (the stage goes on; the outcome goes into the spec's
  mark file as JSON);
- ``s3-restart``: the S3 server (SeaweedFS) is stopped, kept down ``$ROLLPACKER_FAULT_OUTAGE_S``
  seconds (default 3) and started again on the same ports and data, while the stage goes on;
- ``mlflow-down``: the MLflow server is stopped, and started again at the first hook point of a
  later step (it misses at least this step's logging);
- ``node-down``: a Ray worker node's raylet is SIGKILLed (its workers die with it), and the node
  is started again (the two-node test's controller);
- ``sandbox-hang``: the next sandbox run of the reward service is frozen (SIGSTOP of its
  ``nsjail``), as a hung worker would be, by a watcher process the hook starts (the stage goes
  on); the watcher waits until the sandbox's own wall limit has ended the run.

Each spec fires once: a file named after it in the directory ``$ROLLPACKER_FAULT_MARK`` records
that it fired (and when: its modification time), so the re-run goes through. The S3 and MLflow
faults are carried out by a fault controller in the process that owns the local services
(``rollpacker.lab.bench.chaos``): the hook writes a request under ``<mark dir>/requests/`` and waits
for the controller to acknowledge that the server is down. With ``$ROLLPACKER_FAULT_SERVICES`` set
to the local services' directory, only processes of that directory's Ray session are killed
(other Ray clusters on the machine are left alone).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

HOOK = "rollpacker.testing.faults:kill_at"
SERVICES_ENV = "ROLLPACKER_FAULT_SERVICES"
OUTAGE_ENV = "ROLLPACKER_FAULT_OUTAGE_S"
ENGINE_CORE = "EngineCore"
# carried out by the fault controller (node-down: the two-node test's, tests/experiment/test_two_nodes.py)
CONTROLLED = ("s3-restart", "mlflow-down", "node-down")
SANDBOX_HANG = "sandbox-hang"
INTERRUPT = "SIGINT"
GROUP_SIGNALS = {"ctrl-c": signal.SIGINT, "kill-run": signal.SIGKILL}  # to the process group
ACK_TIMEOUT_S = 90.0


def kill_at(point: str, step: int, delay_s: float = 0.0) -> None:
    specs = [x.strip() for x in os.environ.get("ROLLPACKER_FAULT", "").split(",") if x.strip()]
    mark_dir = os.environ.get("ROLLPACKER_FAULT_MARK", "")
    if not mark_dir:
        return
    _bring_back(mark_dir, step)
    for spec in specs:
        where, _, at_step = spec.rpartition("@")
        at_point, _, target = where.partition(":")
        if at_point == point and at_step == str(step) and _first_time(mark_dir, spec):
            if target in CONTROLLED:
                _request(mark_dir, spec, target, step)
            elif target == SANDBOX_HANG:
                _start_watcher(mark_dir, spec, "_hang_sandbox")
            elif target == ENGINE_CORE:
                _start_watcher(mark_dir, spec, "_kill_busy_core")
            elif target == INTERRUPT:
                os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C: KeyboardInterrupt in the main thread
            elif target in GROUP_SIGNALS:
                os.killpg(os.getpgrp(), GROUP_SIGNALS[target])
            else:
                _kill(target, delay_s)


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


def _in_session(pids: list[int]) -> list[int]:
    """``pids`` limited to the Ray session of ``$ROLLPACKER_FAULT_SERVICES`` (all when unset)."""
    root = os.environ.get(SERVICES_ENV, "")
    if not root:
        return pids
    try:
        sid = int(json.loads((Path(root) / "pids" / "ray.json").read_text())["sid"])
    except (OSError, ValueError, KeyError):
        return pids
    out = []
    for pid in pids:
        try:
            if os.getsid(pid) == sid:
                out.append(pid)
        except OSError:
            continue
    return out


def service_pids(service: str) -> list[int]:
    """The processes of Ray actors of class ``service`` (their title: ``ray::<Class>[.<method>]``)."""
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd and (cmd[0] == f"ray::{service}" or cmd[0].startswith(f"ray::{service}.")):
            out.append(p.pid)
    return _in_session(out)


def engine_core_pids() -> list[int]:
    """The vLLM engine core processes (``VLLM::EngineCore...``) under the rollout service."""
    import psutil

    out = []
    for pid in service_pids("RolloutService"):
        try:
            kids = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            continue
        for k in kids:
            try:
                if k.cmdline()[:1] and k.cmdline()[0].startswith(f"VLLM::{ENGINE_CORE}"):
                    out.append(k.pid)
            except (psutil.Error, IndexError):
                continue
    return out


def _kill(service: str, delay_s: float) -> None:
    def die() -> None:
        if not service:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        pids = engine_core_pids() if service == ENGINE_CORE else service_pids(service)
        if not pids:
            raise RuntimeError(f"fault injection: no process of {service} to kill")
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    if delay_s <= 0 or service:  # a service dies at once: the stage is about to wait on it
        die()
        return
    threading.Timer(delay_s, die).start()


# -- faults the controller carries out (S3, MLflow) ------------------------------------------------


def requests_dir(mark_dir: str | Path) -> Path:
    return Path(mark_dir) / "requests"


def _request(mark_dir: str, spec: str, action: str, step: int) -> None:
    """Ask the controller for ``action`` and wait until it says the server is down."""
    req = requests_dir(mark_dir)
    req.mkdir(exist_ok=True)
    name = mark_name(spec)
    doc = {"spec": spec, "action": action, "step": step, "t": time.time()}
    tmp = req / f"{name}.tmp"
    tmp.write_text(json.dumps(doc))
    tmp.replace(req / f"{name}.json")
    if action == "mlflow-down":  # up again at the first hook point of a later step
        (Path(mark_dir) / f"mlflow-up-after-{step}").write_text(spec)
    t0 = time.monotonic()
    while not (req / f"{name}.ack").exists():
        if time.monotonic() - t0 > ACK_TIMEOUT_S:
            raise RuntimeError(f"fault injection: no fault controller acknowledged {spec} ({req})")
        time.sleep(0.1)


def _bring_back(mark_dir: str, step: int) -> None:
    """At a later step than an MLflow outage began, ask the controller to start MLflow again."""
    for f in Path(mark_dir).glob("mlflow-up-after-*"):
        down_step = int(f.name.rsplit("-", 1)[1])
        if step > down_step and _first_time(mark_dir, f"mlflow-up@{down_step}"):
            req = requests_dir(mark_dir)
            doc = {"spec": f.read_text(), "action": "mlflow-up", "step": step, "t": time.time()}
            (req / f"mlflow-up-{down_step}.json").write_text(json.dumps(doc))


# -- a hung sandbox run ----------------------------------------------------------------------------


def _start_watcher(mark_dir: str, spec: str, fn: str) -> None:
    """``fn(mark_dir, spec)`` of this module in a detached process: the stage goes on (its round
    may be over already), and the watcher acts on the next sandbox run or busy engine core, this
    step's or the next's."""
    import subprocess
    import sys

    code = f"from rollpacker.testing.faults import {fn}; {fn}({mark_dir!r}, {spec!r})"
    subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _hang_sandbox(mark_dir: str, spec: str, wait_s: float = 180.0, limit_s: float = 300.0) -> None:
    """SIGSTOP the first sandbox run (``nsjail``) of the reward service seen within ``wait_s``,
    then wait until it is gone (the sandbox's wall limit kills it); the outcome goes into the
    spec's mark file as JSON."""
    import psutil

    t0 = time.monotonic()
    victim = None
    root = os.environ.get(SERVICES_ENV, "")
    while victim is None and time.monotonic() - t0 < wait_s:
        if root and not (Path(root) / "pids" / "ray.json").exists():
            break  # the services were stopped: nothing left to freeze
        for pid in service_pids("RewardService"):
            try:
                kids = psutil.Process(pid).children(recursive=True)
            except psutil.Error:
                continue
            victim = next((k for k in kids if _is_nsjail(k)), None)
            if victim is not None:
                break
        else:
            time.sleep(0.05)
    doc: dict[str, object] = {"spec": spec, "stopped": False}
    if victim is not None:
        try:
            victim.send_signal(signal.SIGSTOP)
            doc.update(stopped=True, pid=victim.pid, t_stop=time.time())
            while victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() - t0 > limit_s:
                    victim.send_signal(signal.SIGCONT)
                    break
                time.sleep(0.1)
        except psutil.Error:
            pass
        doc["t_gone"] = time.time()
    Path(mark_dir, mark_name(spec)).write_text(json.dumps(doc))


def _kill_busy_core(
    mark_dir: str,
    spec: str,
    wait_s: float = 300.0,
    every_s: float = 0.05,
    busy: float = 0.15,
    window: int = 5,
) -> None:
    """SIGKILL the rollout service's vLLM engine cores the first time, within ``wait_s``, that
    they use more than ``busy`` of a CPU over the last ``window`` samples ``every_s`` apart (an
    idle core waits on its socket and uses none; a working one on a loaded machine may get a
    fifth of a CPU, in 10 ms ticks, so one short sample is too coarse a judge); the outcome goes
    into the spec's mark file as JSON."""
    import psutil

    t0 = time.monotonic()
    doc: dict[str, object] = {"spec": spec, "killed": False}
    seen: list[dict[int, float]] = []  # the last window + 1 samples: pid -> CPU seconds
    root = os.environ.get(SERVICES_ENV, "")
    while time.monotonic() - t0 < wait_s:
        if root and not (Path(root) / "pids" / "ray.json").exists():
            break  # the services were stopped: nothing left to kill
        now: dict[int, float] = {}
        for pid in engine_core_pids():
            try:
                t = psutil.Process(pid).cpu_times()
                now[pid] = t.user + t.system
            except psutil.Error:
                continue
        seen = [*seen[-window:], now]
        first = seen[0]
        span_s = every_s * (len(seen) - 1)
        hot = [pid for pid, c in now.items() if pid in first and span_s and c - first[pid] > busy * span_s]
        if hot:
            for pid in now:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
            doc.update(killed=True, pids=sorted(now), t_kill=time.time(), waited_s=time.monotonic() - t0)
            break
        time.sleep(every_s)
    tmp = Path(mark_dir, mark_name(spec) + ".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(Path(mark_dir, mark_name(spec)))


def _is_nsjail(p: object) -> bool:
    import psutil

    try:
        return p.name() == "nsjail"  # type: ignore[attr-defined,no-any-return]
    except psutil.Error:
        return False
