"""The sandbox under load: many concurrent runs, a share of them hostile, nothing escapes or stays.

``rollpacker lab bench sandbox-load`` runs ``--runs`` programs (256 by default) through the code
sandbox, ``--concurrency`` at a time from a thread pool (the way ``CodeReward`` drives it for the
reward service: one thread per run in flight). ``--hostile-share`` of them (a quarter) are hostile
programs, cycling through ``HOSTILE``: the attacks of the hostile-program suite
(``tests/rewards/test_sandbox.py``), each written so that the attack *succeeding* makes the run
PASS. The rest are benign responses of the synthetic code task (correct or wrong), whose verdicts
must not change under load.

A hostile run is an **escape** when it PASSED, or when its host-side check failed: a connection
reached the host listener, the canary file or environment variable was read, a file appeared
outside the jail, a host process was killed, the run outlived its wall limit, or it printed more
than the output cap. After the load, **leftovers** are: processes carrying the run's tag (a
daemon a hostile program started), jailed processes (uid 65534) started during the load, outside
any running jail and still alive a second later, child processes of this process, open file
descriptors beyond the count before, and files the jail could have made in the host's temp dir.

Reported: escapes (by attack), leftovers, benign runs misjudged, throughput (runs per second of
the load phase), per-run latency percentiles, and the **per-run overhead**: the median seconds of a
trivial run (``pass`` against ``pass``) in the jail minus that of a bare ``python -I -S -c pass``,
measured idle before the load; and under load, each benign run's seconds minus the time its
program and cases spent running (what the jail, the interpreter start and the queueing for CPU
add).

Invariants (tests/rewards/test_sandbox_load.py):
- every run is accounted for: ``benign + hostile == runs``; each hostile run is one attack of
  ``HOSTILE`` and is checked on the host;
- ``escapes`` counts a hostile run whose attack succeeded by any of the checks above; a sandbox
  with an attack let through (the test's broken jail) is caught.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.lab.bench.tables import clip, legend, wrap

CANARY_ENV = "ROLLPACKER_LOAD_CANARY"


@dataclass(frozen=True)
class Attack:
    """One hostile program: ``code`` then ``tests`` (formatted with the run's ``Host``); a run
    that PASSES means the attack worked."""

    name: str
    code: str
    tests: str = "pass"
    host_judged: bool = False  # it PASSES when contained too; only the host-side checks judge it


@dataclass(frozen=True)
class Host:
    """What the host side of one load offers as bait: a listener, a canary file and variable, a
    path outside the jail, a process of ours, and the tag every daemon carries."""

    tag: str  # digits: the sleep seconds' fraction of a daemon, findable in its command line
    port: int
    canary_path: str
    canary: str
    outside_path: str
    victim_pid: int

    def fields(self) -> dict[str, object]:
        return {
            "tag": self.tag,
            "port": self.port,
            "canary_path": self.canary_path,
            "canary": self.canary,
            "outside": self.outside_path,
            "victim": self.victim_pid,
            "env": CANARY_ENV,
        }


def _a(name: str, code: str, tests: str = "pass", host_judged: bool = False) -> Attack:
    return Attack(
        name, textwrap.dedent(code).strip() + "\n", textwrap.dedent(tests).strip() + "\n", host_judged
    )


# The hostile-program suite's attacks as load: each PASSES only when it got through.
HOSTILE: tuple[Attack, ...] = (
    _a(
        "network",
        """
        import socket
        s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
        s.sendall(b"exfiltrated")
        """,
    ),
    _a("dns", "import socket\nsocket.getaddrinfo('pypi.org', 443)"),
    _a("host file", "data = open({canary_path!r}).read()", "assert {canary!r} in data"),
    _a("host /etc", "data = open('/etc/passwd').read()", "assert 'root' in data"),
    _a("environment", "import os\nv = os.environ.get({env!r}, '')\nprint(v)", "assert v == {canary!r}"),
    _a("write outside", "open({outside!r}, 'w').write('x')"),
    _a(
        "forged report",
        "import os\nfor fd in range(1, 64):\n    try:\n        os.write(fd, b'x end 0 passed')\n"
        "    except OSError:\n        pass\nos._exit(0)",
        "assert False",
    ),
    _a("exit early", "import sys\nsys.exit(0)", "assert False"),
    _a(
        "kill host",
        """
        import os
        for pid in ({victim}, -1):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        """,
        host_judged=True,
    ),
    _a(
        "fork bomb",
        """
        import os
        n = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    import time
                    time.sleep(5)
                    os._exit(0)
                n += 1
            except OSError:
                break
        """,
        "assert n >= 200, n",
    ),
    _a("memory bomb", "b = bytearray(2 << 30)", "assert len(b) == 2 << 30"),
    _a(
        "daemon",
        """
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv("/bin/sleep", ["sleep", "60.{tag}"])
            os._exit(0)
        os.wait()
        """,
        host_judged=True,
    ),
    _a("setuid root", "import os\nos.setuid(0)"),
    _a(
        "new namespace",
        "import ctypes\nr = ctypes.CDLL(None).unshare(0x10000000)",
        "assert r == 0",
    ),
    _a("output flood", "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)"),
    _a(
        "swallow timer",
        "x = 1",
        """
        while True:
            try:
                while True:
                    pass
            except BaseException:
                pass
        """,
    ),
    _a(
        "fill scratch",
        "f = open('/scratch/big', 'wb')\nfor _ in range(64):\n    f.write(bytes(1 << 20))\nf.close()",
    ),
)


@dataclass(frozen=True)
class Job:
    index: int
    kind: str  # "benign" or "hostile"
    name: str  # the attack, or "correct" / "wrong"
    code: str
    tests: tuple[str, ...]
    expect_pass: bool  # benign only: the verdict it must get
    host_judged: bool = False  # hostile only: a PASS is not an escape (Attack.host_judged)


@dataclass(frozen=True)
class Outcome:
    job: Job
    status: str
    exec_s: float  # the run's seconds, measured by the parent
    work_s: float  # seconds the program and its cases ran (the harness's clock)
    escaped: str  # why the attack counts as an escape ("" when it did not)
    detail: str


def make_jobs(runs: int, hostile_share: float, seed: int, host: Host) -> list[Job]:
    """``runs`` jobs, a ``hostile_share`` of them attacks (cycling through ``HOSTILE``), the rest
    benign synthetic-code responses (every other one wrong), in a seeded order."""
    import random

    from rollpacker.tasks import synthetic_code

    n_hostile = round(runs * hostile_share)
    examples = synthetic_code.generate(
        synthetic_code.SyntheticCodeSpec(num_examples=max(1, runs - n_hostile)), seed=seed
    )
    jobs: list[Job] = []
    for i in range(n_hostile):
        atk = HOSTILE[i % len(HOSTILE)]
        f = host.fields()
        tests = (atk.tests.format(**f),)
        jobs.append(Job(0, "hostile", atk.name, atk.code.format(**f), tests, False, atk.host_judged))
    for i in range(runs - n_hostile):
        ex = examples[i]
        right = i % 2 == 0
        code = synthetic_code.reference_solution(ex) if right else synthetic_code.wrong_variant(ex)
        jobs.append(Job(0, "benign", "correct" if right else "wrong", code, tuple(ex.tests), right))
    random.Random(f"sandbox-load:{seed}").shuffle(jobs)
    return [dataclasses.replace(j, index=i) for i, j in enumerate(jobs)]


class _Bait:
    """The host side of a load: starts the listener and the victim process, makes the canaries;
    ``check`` tells what a hostile run got through; ``close`` removes it all."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rollpacker-load-"))
        self.dir.chmod(0o755)  # reachable by the jail's uid, were a host path visible at all
        canary = secrets.token_hex(12)
        path = self.dir / "canary.txt"
        path.write_text(canary)
        path.chmod(0o644)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.victim = subprocess.Popen(["sleep", "3600"], stdin=subprocess.DEVNULL)
        # beside the canary: a host directory of ours, writable by the user the jail maps to
        self.outside = self.dir / "written-from-the-jail"
        self.host = Host(
            tag=str(secrets.randbelow(10**9)).rjust(9, "1"),
            port=self.listener.getsockname()[1],
            canary_path=str(path),
            canary=canary,
            outside_path=str(self.outside),
            victim_pid=self.victim.pid,
        )
        self._old_env = os.environ.get(CANARY_ENV)
        os.environ[CANARY_ENV] = canary
        self.connections = 0
        self._lock = threading.Lock()

    def check(self, job: Job, result: Any, wall_s: float, output_cap: int) -> str:
        """Why a hostile run counts as an escape ("" when it does not)."""
        h = self.host
        if result.status.value == "passed" and not job.host_judged:
            return "its attack passed"
        try:
            conn, _ = self.listener.accept()
            conn.close()
            with self._lock:
                self.connections += 1
            return "a connection reached the host listener"
        except BlockingIOError:
            pass
        if h.canary in result.stdout or h.canary in result.stderr or h.canary in result.detail:
            return "the canary reached its output"
        if self.outside.exists():
            return f"{self.outside} was written"
        if self.victim.poll() is not None:
            return f"the host process {self.victim.pid} was killed"
        if result.exec_s > wall_s + 5.0:
            return f"ran {result.exec_s:.1f} s, past the wall limit {wall_s:g} s"
        if len(result.stdout) > output_cap or len(result.stderr) > output_cap:
            return "its output went past the cap"
        return ""

    def close(self) -> None:
        self.listener.close()
        self.victim.kill()
        self.victim.wait()
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()
        if self._old_env is None:
            os.environ.pop(CANARY_ENV, None)
        else:
            os.environ[CANARY_ENV] = self._old_env


def _jailed_since(t0: float) -> set[int]:
    """Jailed processes (uid 65534) alive now that started at or after ``t0`` (epoch seconds) and
    are not inside a running jail (no ``nsjail`` among their ancestors): a run of another user's
    sandbox on this machine is inside its jail; a process that outlived its jail is not."""
    import psutil

    from rollpacker.rewards.sandbox import JAIL_UID

    out = set()
    for p in psutil.process_iter(["uids", "create_time"]):
        u, ct = p.info.get("uids"), p.info.get("create_time") or 0.0
        if u is None or JAIL_UID not in (u.real, u.effective) or ct < t0 - 1.0:
            continue
        try:
            if any(a.name() == "nsjail" for a in p.parents()):
                continue
        except psutil.Error:
            continue  # gone meanwhile
        out.add(p.pid)
    return out


def _tagged(tag: str) -> list[int]:
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        if any(tag in a for a in (p.info.get("cmdline") or [])):
            out.append(p.pid)
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _tmp_names() -> set[str]:
    return {e.name for e in Path(tempfile.gettempdir()).iterdir()}


def leftovers(
    tag: str, t0: float, kids_before: set[int], fds_before: int, tmp_before: set[str], settle_s: float
) -> dict[str, Any]:
    """What the load left behind (see the module docstring); empty lists and 0 when nothing."""
    import psutil

    jailed = _jailed_since(t0)
    if jailed:  # another user's run may be finishing: only what outlives ``settle_s`` counts
        time.sleep(settle_s)
        jailed &= _jailed_since(t0)
    me = psutil.Process()
    kids = sorted(p.pid for p in me.children(recursive=True) if p.pid not in kids_before)
    tmp = sorted(n for n in _tmp_names() - tmp_before if n.startswith(("nsjail", "rollpacker-load")))
    return {
        "tagged_processes": _tagged(tag),
        "jailed_processes": sorted(jailed),
        "child_processes": kids,
        "fds_added": max(0, _fds() - fds_before),
        "tmp_files": tmp,
    }


def _overhead_idle(sandbox: Any, repeats: int) -> dict[str, float]:
    """Median seconds of a trivial jailed run and of a bare interpreter start, idle."""
    jail = [sandbox.run("pass", "pass").exec_s for _ in range(repeats)]
    bare = []
    exe = str(sandbox.interpreter)
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([exe, "-I", "-S", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - t0)
    j, b = statistics.median(jail), statistics.median(bare)
    return {"jail_trivial_s": j, "bare_python_s": b, "overhead_s": j - b}


def run_sandbox_load(
    runs: int = 256,
    concurrency: int = 32,
    hostile_share: float = 0.25,
    wall_s: float = 10.0,
    seed: int = 0,
    sandbox: Any = None,
    progress: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Run the load and return the report (see the module docstring)."""
    import psutil

    from rollpacker.core.errors import ConfigError
    from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

    if runs < 1 or concurrency < 1 or not 0.0 <= hostile_share <= 1.0 or wall_s <= 0:
        raise ConfigError(
            f"--runs {runs} --concurrency {concurrency} --hostile-share {hostile_share} --wall-s {wall_s}: "
            "runs and concurrency >= 1, a share in [0, 1], wall seconds > 0"
        )
    sb = sandbox if sandbox is not None else Sandbox(SandboxLimits(wall_s=wall_s, cpu_s=wall_s, code_s=5.0))
    idle = _overhead_idle(sb, repeats=5)
    bait = _Bait()
    try:
        jobs = make_jobs(runs, hostile_share, seed, bait.host)
        kids_before = {p.pid for p in psutil.Process().children(recursive=True)}
        fds_before, tmp_before, t_epoch = _fds(), _tmp_names(), time.time()
        hostile_s = min(2.0, sb.limits.wall_s)  # a spinning attack's case limit; benign: the wall limit

        def one(job: Job) -> Outcome:
            r = sb.run(job.code, list(job.tests), timeouts_s=hostile_s if job.kind == "hostile" else None)
            work = r.code_exec_s + sum(t.exec_s for t in r.tests)
            why = (
                bait.check(job, r, sb.limits.wall_s, sb.limits.output_bytes) if job.kind == "hostile" else ""
            )
            if progress is not None:
                progress(1)
            return Outcome(job, r.status.value, r.exec_s, work, why, r.detail)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox-load") as pool:
            outcomes = list(pool.map(one, jobs))
        load_s = time.perf_counter() - t0
        left = leftovers(bait.host.tag, t_epoch, kids_before | {bait.victim.pid}, fds_before, tmp_before, 1.0)
    finally:
        bait.close()
    return _report(outcomes, left, load_s, idle, runs, concurrency, hostile_share, sb.limits.wall_s, seed)


def _report(
    outcomes: list[Outcome],
    left: dict[str, Any],
    load_s: float,
    idle: dict[str, float],
    runs: int,
    concurrency: int,
    hostile_share: float,
    wall_s: float,
    seed: int,
) -> dict[str, Any]:
    hostile = [o for o in outcomes if o.job.kind == "hostile"]
    benign = [o for o in outcomes if o.job.kind == "benign"]
    by_attack: dict[str, dict[str, Any]] = {}
    for o in hostile:
        a = by_attack.setdefault(o.job.name, {"runs": 0, "escapes": 0, "statuses": {}, "why": []})
        a["runs"] += 1
        a["statuses"][o.status] = a["statuses"].get(o.status, 0) + 1
        if o.escaped:
            a["escapes"] += 1
            a["why"].append(o.escaped)
    misjudged = [
        {
            "index": o.job.index,
            "expected": "passed" if o.job.expect_pass else "failed",
            "got": o.status,
            "detail": o.detail,
        }
        for o in benign
        if (o.status == "passed") != o.job.expect_pass
    ]
    lat = sorted(o.exec_s for o in outcomes)
    over = sorted(max(0.0, o.exec_s - o.work_s) for o in benign)
    n_left = sum(len(v) if isinstance(v, list) else int(v) for v in left.values())
    return {
        "workload": {
            "runs": runs,
            "concurrency": concurrency,
            "hostile_share": hostile_share,
            "hostile": len(hostile),
            "benign": len(benign),
            "wall_s": wall_s,
            "seed": seed,
            "attacks": len(by_attack),
        },
        "escapes": sum(1 for o in hostile if o.escaped),
        "by_attack": by_attack,
        "leftovers": left,
        "leftovers_total": n_left,
        "benign_misjudged": misjudged,
        "load_s": load_s,
        "throughput_runs_per_s": len(outcomes) / load_s if load_s > 0 else 0.0,
        "latency_s": {"p50": _pct(lat, 0.5), "p90": _pct(lat, 0.9), "p99": _pct(lat, 0.99), "max": lat[-1]},
        "overhead_idle": idle,
        "overhead_under_load_s": {"p50": _pct(over, 0.5), "p90": _pct(over, 0.9)} if over else {},
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


_LEGEND = (
    ("attack", "hostile program (each PASSES only if its attack got through)"),
    ("runs", "runs of it in the load"),
    ("escapes", "runs that PASSED or got through a host-side check"),
    ("statuses", "sandbox verdicts: passed, failed, timeout, error"),
    ("throughput", "runs finished per second of the load phase, all kinds together"),
    (
        "overhead",
        "idle: trivial jailed run minus bare `python -I -S -c pass` (median); under load: a "
        "benign run's seconds minus its program's and cases' own seconds",
    ),
)


def render(d: dict[str, Any]) -> str:
    """Per-attack table, the totals, throughput and overhead, a legend."""
    w = d["workload"]
    lines = wrap(
        f"sandbox load: {w['runs']} runs, {w['concurrency']} at a time ({w['hostile']} hostile of "
        f"{w['attacks']} kinds, {w['benign']} benign), wall limit {w['wall_s']:g} s, {d['cpus']} CPUs"
    )
    hdr = f"{'attack':<16}  {'runs':>5}  {'escapes':>7}  statuses"
    lines += [hdr, "-" * len(hdr)]
    for name, a in sorted(d["by_attack"].items()):
        st = ", ".join(f"{k} {v}" for k, v in sorted(a["statuses"].items()))
        lines.append(f"{name:<16}  {a['runs']:>5}  {a['escapes']:>7}  {clip(st, 80)}")
    left = d["leftovers"]
    o, lat = d["overhead_idle"], d["latency_s"]
    ul = d["overhead_under_load_s"]
    lines += [""]
    lines += wrap(
        f"escapes: {d['escapes']}   leftovers: {d['leftovers_total']} (tagged processes "
        f"{len(left['tagged_processes'])}, jailed {len(left['jailed_processes'])}, children "
        f"{len(left['child_processes'])}, fds {left['fds_added']}, temp files {len(left['tmp_files'])})   "
        f"benign misjudged: {len(d['benign_misjudged'])} of {w['benign']}"
    )
    lines += wrap(
        f"throughput: {d['throughput_runs_per_s']:.1f} runs/s ({w['runs']} in {d['load_s']:.1f} s); latency "
        f"p50 {lat['p50']:.3f} s, p90 {lat['p90']:.3f} s, p99 {lat['p99']:.3f} s, max {lat['max']:.2f} s"
    )
    under = f"; under load p50 {ul['p50']:.3f} s, p90 {ul['p90']:.3f} s" if ul else ""
    lines += wrap(
        f"per-run overhead: idle {1000 * o['overhead_s']:.1f} ms (jailed trivial run "
        f"{1000 * o['jail_trivial_s']:.1f} ms, bare python {1000 * o['bare_python_s']:.1f} ms){under}"
    )
    return "\n".join(lines + legend(_LEGEND))
