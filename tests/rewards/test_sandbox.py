"""The nsjail code sandbox: outcomes per test case, time limits, and hostile programs contained.

Every hostile program is written so that the attack *succeeding* makes its test case pass: a
sandbox that let it through would report PASSED, so each of these tests fails on a broken jail.
The ``no_leaks`` fixture checks after each test that no jailed process (uid 65534), no child of
this process and no file the jail could have made in the host's temp dir is left.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from rollpacker.core.errors import ConfigError, SandboxError
from rollpacker.rewards import sandbox as sandbox_mod
from rollpacker.rewards.sandbox import (
    JAIL_UID,
    Sandbox,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
)

PASSED, FAILED, TIMEOUT, ERROR, SKIPPED = (
    SandboxStatus.PASSED,
    SandboxStatus.FAILED,
    SandboxStatus.TIMEOUT,
    SandboxStatus.ERROR,
    SandboxStatus.SKIPPED,
)


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    sb = Sandbox(SandboxLimits(wall_s=15.0, cpu_s=15.0))
    probe = sb.run("x = 1", "assert x == 1")  # also makes nsjail's reusable mount-point dirs
    assert probe.status is PASSED, f"the sandbox does not work here: {probe.detail}"
    return sb


def _jail_procs() -> set[int]:
    out: set[int] = set()
    for p in psutil.process_iter(["uids"]):
        uids = p.info.get("uids")
        if uids is not None and JAIL_UID in (uids.real, uids.effective):
            out.add(p.pid)
    return out


def _describe(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} {p.status()} {p.name()}"
    except psutil.Error as e:
        return f"{pid} {e}"


def _tmp_entries() -> dict[str, int]:
    tmp = Path(tempfile.gettempdir())
    out = {}
    for e in tmp.iterdir():
        try:
            out[e.name] = e.lstat().st_uid
        except OSError:
            continue
    return out


@pytest.fixture
def no_leaks(sandbox: Sandbox) -> Iterator[None]:
    jail_before = _jail_procs()
    tmp_before = _tmp_entries()
    me = psutil.Process()
    # children that were there before the test (multiprocessing's resource tracker, a reward
    # worker pool of an earlier test) are not the sandbox's
    kids_before = {p.pid for p in me.children(recursive=True)}
    yield
    left = _jail_procs() - jail_before
    kids = [p for p in me.children(recursive=True) if p.pid not in kids_before]
    assert not left, f"jailed processes left behind: {[_describe(p) for p in left]}"
    assert not kids, f"child processes left behind: {kids}"
    new = {n: uid for n, uid in _tmp_entries().items() if n not in tmp_before}
    # the jail's user's files and nsjail's own; not every new name: other processes on the machine
    # (a trainer's `rollpacker-ckpt-*` of another session, once) write to the same /tmp meanwhile
    made_by_jail = {n for n, uid in new.items() if uid == JAIL_UID or n.startswith("nsjail")}
    assert not made_by_jail, f"files left in the temp dir: {made_by_jail}"


def _run(sb: Sandbox, code: str, tests: list[str] | str = "pass", **kw: object) -> SandboxResult:
    cases = textwrap.dedent(tests) if isinstance(tests, str) else [textwrap.dedent(t) for t in tests]
    r = sb.run(textwrap.dedent(code), cases, **kw)  # type: ignore[arg-type]
    assert len(r.tests) == (1 if isinstance(tests, str) else len(tests))
    return r


# ---------------------------------------------------------------------------------------------------
# Outcomes of well-behaved programs


def test_correct_program_passes_with_per_case_outcomes(sandbox: Sandbox, no_leaks: None) -> None:
    code = "def add(a, b):\n    return a + b\nprint('defined')\n"
    tests = [
        "assert add(1, 2) == 3",
        "assert add(-1, 1) == 0",
        "import time; time.sleep(0.2)\nassert add(0, 0) == 0",
    ]
    r = sandbox.run(code, tests)
    assert r.status is PASSED and r.passed, r.detail
    assert [t.index for t in r.tests] == [0, 1, 2]
    assert all(t.status is PASSED for t in r.tests)
    assert 0.2 <= r.tests[2].exec_s < 2.0, r.tests
    assert r.tests[0].exec_s < 0.2
    assert r.exec_s >= r.tests[2].exec_s
    assert r.stdout == "defined\n"
    assert r.failed_index is None
    assert r.tests[0].timeout_s == sandbox.limits.wall_s  # the default per-case timeout


def test_wrong_program_fails_with_failing_index(sandbox: Sandbox, no_leaks: None) -> None:
    code = "def add(a, b):\n    return a - b\n"
    tests = ["assert add(1, 0) == 1", "assert add(1, 2) == 3, 'sum'", "assert add(2, 0) == 2"]
    r = sandbox.run(code, tests)
    assert r.status is FAILED and not r.passed
    assert r.failed_index == 1
    assert [t.status for t in r.tests] == [PASSED, FAILED, SKIPPED]
    assert "AssertionError: sum" in r.tests[1].detail and "<test 1>:1" in r.tests[1].detail
    assert "test case 1 failed" in r.detail

    r = sandbox.run(code, tests, stop_on_failure=False)
    assert [t.status for t in r.tests] == [PASSED, FAILED, PASSED]
    assert r.status is FAILED and r.failed_index == 1


def test_tests_share_the_programs_globals_and_one_str_is_one_case(sandbox: Sandbox, no_leaks: None) -> None:
    r = sandbox.run("state = []", "state.append(1)\nassert state == [1]")
    assert r.status is PASSED and len(r.tests) == 1
    r = sandbox.run("state = []", ["state.append(1)", "assert state == [1]"])
    assert r.status is PASSED


def test_program_that_raises_fails_before_tests(sandbox: Sandbox, no_leaks: None) -> None:
    r = sandbox.run("def f(:\n", ["assert True"])
    assert r.status is FAILED and "SyntaxError" in r.detail
    assert r.tests[0].status is SKIPPED and r.failed_index is None
    r = sandbox.run("raise ValueError('boom')", ["assert True"])
    assert r.status is FAILED and "ValueError: boom" in r.detail


def test_per_case_timeout(sandbox: Sandbox, no_leaks: None) -> None:
    tests = ["pass", "import time\ntime.sleep(30)", "pass"]
    r = sandbox.run("", tests, timeouts_s=[5.0, 0.3, 5.0])
    assert r.status is TIMEOUT
    assert r.failed_index == 1
    assert [t.status for t in r.tests] == [PASSED, TIMEOUT, SKIPPED]
    assert 0.3 <= r.tests[1].exec_s < 1.5 and r.tests[1].timeout_s == 0.3
    assert r.exec_s < 3.0
    # the same case under a larger limit passes: the limit is per case
    r = sandbox.run("", ["import time\ntime.sleep(0.3)"], timeouts_s=2.0)
    assert r.status is PASSED and r.tests[0].exec_s >= 0.3


def test_program_itself_is_time_limited(no_leaks: None) -> None:
    sb = Sandbox(SandboxLimits(code_s=0.3))
    r = sb.run("while True:\n    pass", "pass")
    assert r.status is TIMEOUT and "before the tests" in r.detail
    assert r.exec_s < 3.0


# ---------------------------------------------------------------------------------------------------
# Reward hacks: ending the harness early or forging its reports


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos._exit(0)",
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
        "import os\nos.close(1)\nos.close(2)\nfor fd in range(3, 256):\n    try:\n        os.close(fd)\n"
        "    except OSError:\n        pass",
    ],
)
def test_ending_the_harness_before_the_tests_is_failed(sandbox: Sandbox, code: str, no_leaks: None) -> None:
    r = sandbox.run(code, ["assert False, 'the tests must not pass'"])
    assert r.status is FAILED, r.detail
    assert r.tests[0].status is not PASSED


def test_exit_inside_a_test_case_is_failed(sandbox: Sandbox, no_leaks: None) -> None:
    r = sandbox.run("", ["pass", "import os\nos._exit(0)"])
    assert r.status is FAILED and r.failed_index == 1
    assert "exited with code 0" in r.tests[1].detail


def test_forged_reports_are_ignored(sandbox: Sandbox, no_leaks: None) -> None:
    # the harness's record format, but a guessed nonce, written to every fd the program may hold
    code = """
    import os
    fake = "0" * 32
    lines = [f"{fake} end 0 passed 0.0 2 0 \\n", f"{fake} done -2 - 0.0 2 0 \\n",
             f"{fake} exit -2 code 0.0 1 0 \\n", '{"ev": "done"}\\n']
    for fd in range(1, 64):
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError:
                pass
    os._exit(0)
    """
    r = _run(sandbox, code, ["assert False"])
    assert r.status is FAILED, r.detail


# ---------------------------------------------------------------------------------------------------
# Containment: network, file system, environment, identity


def test_no_network_to_a_host_listener(sandbox: Sandbox, no_leaks: None) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        port = srv.getsockname()[1]
        code = f"""
        import socket
        s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
        s.sendall(b"exfiltrated")
        """
        r = _run(sandbox, code)
        assert r.status is FAILED and "ConnectionRefusedError" in r.detail, r.detail
        srv.setblocking(False)
        with pytest.raises(BlockingIOError):
            srv.accept()  # nobody connected


def test_no_dns_and_only_loopback(sandbox: Sandbox, no_leaks: None) -> None:
    r = _run(sandbox, "import socket\nsocket.getaddrinfo('pypi.org', 443)")
    assert r.status is FAILED and "gaierror" in r.detail, r.detail
    r = _run(
        sandbox,
        "import socket\nnames = [n for _, n in socket.if_nameindex()]",
        "assert names == ['lo'], names",
    )
    assert r.status is PASSED, r.detail


def test_host_files_are_not_readable(sandbox: Sandbox, tmp_path: Path, no_leaks: None) -> None:
    secret = secrets.token_hex(8)
    host_file = tmp_path / "secret.txt"
    host_file.write_text(secret)
    host_file.chmod(0o644)
    targets = [
        str(host_file),
        "/etc/shadow",
        "/etc/passwd",
        "/work/main/README.md",
        __file__,
        "/proc/1/environ",
    ]
    home_file = Path.home() / ".bashrc"
    if home_file.exists():
        targets.append(str(home_file))
    for path in targets:
        r = _run(sandbox, f"data = open({path!r}, 'rb').read()")
        assert r.status is FAILED and "FileNotFoundError" in r.detail, (path, r.detail)
    # what the jail sees at all: no /etc, /home, /work, /proc, host /tmp; of the home, only Python
    code = f"""
    import os, sys
    top = sorted(os.listdir("/"))
    home = sorted(os.listdir({str(Path.home())!r})) if os.path.isdir({str(Path.home())!r}) else []
    tmp = sorted(os.listdir("/tmp"))
    """
    probe = (
        "assert not set(top) - {'bin', 'dev', 'lib', 'lib64', 'root', 'sbin', 'scratch', 'tmp', 'usr'}, top\n"
    )
    devices = [Path(d).name for d in sandbox_mod._DEVICES if os.path.exists(d)]
    probe += f"assert all(sys.base_prefix.startswith(os.path.join({str(Path.home())!r}, h)) for h in home)\n"
    probe += f"assert tmp == [], tmp\nassert sorted(os.listdir('/dev')) == {sorted(devices)!r}\n"
    r = _run(sandbox, code, probe)
    assert r.status is PASSED, r.detail


def test_no_environment_leaks(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch, no_leaks: None) -> None:
    token = secrets.token_hex(8)
    monkeypatch.setenv("ROLLPACKER_TEST_SECRET", token)
    r = _run(sandbox, "import os\nprint(dict(os.environ))\nleaked = os.environ['ROLLPACKER_TEST_SECRET']")
    assert r.status is FAILED and "KeyError" in r.detail
    assert token not in r.stdout
    env = json.loads(_run(sandbox, "import os, json\nprint(json.dumps(dict(os.environ)))").stdout)
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE"}, env


def test_writes_outside_scratch_fail_and_scratch_is_private(sandbox: Sandbox, no_leaks: None) -> None:
    host_tmp = Path(tempfile.gettempdir()) / f"rollpacker-pwned-{secrets.token_hex(4)}"
    stdlib_file = Path(os.__file__).with_name("pwned_by_sandbox.py")
    for path in ["/pwned", "/usr/pwned", str(stdlib_file), "/dev/pwned", str(Path.home() / "pwned")]:
        r = _run(sandbox, f"open({path!r}, 'w').write('x')")
        assert r.status is FAILED and "Error" in r.detail, (path, r.detail)
        assert not Path(path).exists()
    # /tmp inside the jail is its scratch: writing there works, and nothing reaches the host's /tmp
    r = _run(
        sandbox,
        f"open({str(host_tmp)!r}, 'w').write('x')\nimport os\nfiles = os.listdir('/scratch')",
        f"assert files == [{host_tmp.name!r}], files",
    )
    assert r.status is PASSED, r.detail
    assert not host_tmp.exists()
    # each run has a fresh scratch
    r = _run(sandbox, "import os\nfiles = os.listdir('/scratch')", "assert files == [], files")
    assert r.status is PASSED, r.detail


def test_scratch_and_file_size_are_limited(sandbox: Sandbox, no_leaks: None) -> None:
    ok = _run(sandbox, "open('/scratch/a', 'wb').write(b'x' * (4 << 20))")
    assert ok.status is PASSED, ok.detail
    mb = sandbox.limits.scratch_mb
    code = (
        f"with open('/scratch/a', 'wb') as f:\n    for _ in range({mb + 4}):\n        f.write(bytes(1 << 20))"
    )
    r = _run(sandbox, code)
    assert r.status is FAILED, r.detail


def test_runs_as_nobody_without_privileges(sandbox: Sandbox, no_leaks: None) -> None:
    code = """
    import ctypes, os
    ids = (os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWUSER = 0x10000000
    unshared = libc.unshare(CLONE_NEWUSER)
    """
    tests = ["assert ids == (65534, 65534, 65534, []), ids", "assert unshared == 0, 'no new namespaces'"]
    r = _run(sandbox, code, tests, stop_on_failure=False)
    assert r.tests[0].status is PASSED, r.tests[0].detail
    assert r.tests[1].status is FAILED  # seccomp refuses unshare
    r = _run(sandbox, "import os\nos.setuid(0)")
    assert r.status is FAILED and "PermissionError" in r.detail


def test_only_the_stdlib_is_importable(sandbox: Sandbox, no_leaks: None) -> None:
    ok = _run(
        sandbox, "import json, hashlib, collections, itertools, math, re, heapq, ctypes, sqlite3, decimal"
    )
    assert ok.status is PASSED, ok.detail
    for mod in ("pytest", "psutil", "rollpacker"):
        r = _run(sandbox, f"import {mod}")
        assert r.status is FAILED and "ModuleNotFoundError" in r.detail, (mod, r.detail)


# ---------------------------------------------------------------------------------------------------
# Containment: resources


def test_fork_bomb_is_contained(sandbox: Sandbox, no_leaks: None) -> None:
    r = _run(sandbox, "import os\nwhile True:\n    os.fork()", timeouts_s=3.0)
    assert r.status is FAILED and "BlockingIOError" in r.detail, r.detail
    code = """
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """
    r = _run(sandbox, "x = 1", code, timeouts_s=1.0)
    assert r.status is TIMEOUT, r.detail
    assert r.exec_s < 8.0


def test_memory_bomb_is_contained(sandbox: Sandbox, no_leaks: None) -> None:
    r = _run(sandbox, "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))")
    assert r.status is FAILED and "MemoryError" in r.detail, r.detail
    r = _run(sandbox, "s = ' ' * (10 ** 10)")
    assert r.status is FAILED and "MemoryError" in r.detail, r.detail


def test_infinite_loops_time_out(sandbox: Sandbox, no_leaks: None) -> None:
    r = _run(sandbox, "x = 1", "while True:\n    pass", timeouts_s=0.5)
    assert r.status is TIMEOUT and r.failed_index == 0
    assert 0.5 <= r.tests[0].exec_s < 1.5
    # C-level: the timer's exception never gets a chance to run; the parent kills the jail
    r = _run(sandbox, "import itertools", "sum(itertools.count())", timeouts_s=0.5)
    assert r.status is TIMEOUT and r.failed_index == 0, r.detail
    assert r.exec_s < 4.0
    # a loop that swallows the timer's exception is killed by the parent too
    swallow = (
        "while True:\n    try:\n"
        "        while True:\n            pass\n    except BaseException:\n        x = 0"
    )
    r = _run(sandbox, "x = 1", swallow, timeouts_s=0.5)
    assert r.status is TIMEOUT and r.exec_s < 4.0


def test_cpu_limit(no_leaks: None) -> None:
    sb = Sandbox(SandboxLimits(cpu_s=1.0, wall_s=20.0))
    r = sb.run("import itertools", "sum(itertools.count())", timeouts_s=15.0)
    assert r.status is TIMEOUT and "CPU time limit" in r.detail, r.detail
    assert r.exec_s < 10.0
    # the CPU limit is per case: three cases of 0.4 s of CPU each pass under cpu_s=1
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass"
    r = sb.run("", [spin] * 3, timeouts_s=15.0)
    assert r.status is PASSED, r.detail


def test_wall_limit_caps_the_run(no_leaks: None) -> None:
    sb = Sandbox(SandboxLimits(wall_s=1.0))
    r = sb.run(
        "", ["import time\ntime.sleep(0.6)", "import itertools\nsum(itertools.count())"], timeouts_s=5.0
    )
    assert r.status is TIMEOUT and r.failed_index == 1
    assert "wall limit" in r.detail
    assert r.exec_s < 2.5


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_huge_output_is_capped_and_stopped(sandbox: Sandbox, stream: str, no_leaks: None) -> None:
    r = _run(sandbox, f"import sys\nwhile True:\n    sys.{stream}.write('y' * 4096)")
    assert r.status is FAILED and r.output_truncated
    assert f"more than {sandbox.limits.output_bytes} bytes to {stream}" in r.detail
    assert len(getattr(r, stream)) == sandbox.limits.output_bytes
    assert r.exec_s < 5.0


# ---------------------------------------------------------------------------------------------------
# Containment: processes


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.kill(os.getppid(), 9)",
        "import os\nos.kill(1, 9)",
        "import os\nos.kill(-1, 9)",
        "import os\nos.killpg(0, 9)",
    ],
)
def test_killing_the_parent_is_contained(sandbox: Sandbox, code: str, no_leaks: None) -> None:
    r = _run(sandbox, code, ["import os\nassert os.getppid() == 1", "pass"])
    assert r.status is not ERROR, r.detail
    assert psutil.Process().is_running()
    # and the host's processes are out of its sight
    r = _run(sandbox, f"import os\nos.kill({os.getpid()}, 0)")
    assert r.status is FAILED and "ProcessLookupError" in r.detail


def test_pid1_init_reaps_and_exits(sandbox: Sandbox, no_leaks: None) -> None:
    # a child that the program does not wait for, and its own process count
    code = "import os, time\nif os.fork() == 0:\n    os._exit(0)\ntime.sleep(0.1)"
    r = _run(sandbox, code)
    assert r.status is PASSED, r.detail


_DAEMONS = {
    "fork+setsid": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            time.sleep(60)
            os._exit(0)
    """,
    "double fork": """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            os._exit(0)
        os.wait()
    """,
    "subprocess sleep": """
        import subprocess
        subprocess.Popen(["/bin/sleep", "60"], start_new_session=True)
    """,
}


@pytest.mark.parametrize("name", sorted(_DAEMONS))
@pytest.mark.parametrize("ending", ["normal", "killed at timeout"])
def test_background_processes_do_not_survive(
    sandbox: Sandbox, name: str, ending: str, no_leaks: None
) -> None:
    tests = ["pass"] if ending == "normal" else ["import itertools\nsum(itertools.count())"]
    r = _run(sandbox, _DAEMONS[name], tests, timeouts_s=0.5)
    assert r.status is (PASSED if ending == "normal" else TIMEOUT), r.detail
    # no_leaks checks (right away, no waiting) that the sleeping daemon is gone


# ---------------------------------------------------------------------------------------------------
# Many runs: threads, fds


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_no_fd_leak_over_many_runs(sandbox: Sandbox, no_leaks: None) -> None:
    sandbox.run("", "pass")
    before = _fds()
    for i in range(20):
        code = ["", "import os\nos._exit(3)", "while True:\n    print('z' * 8192)"][i % 3]
        sandbox.run(code, "pass")
    assert _fds() <= before  # a leak only adds fds


def test_parallel_runs_from_threads(sandbox: Sandbox, no_leaks: None) -> None:
    cases = [
        ("def f(x):\n    return x * 2", "assert f(3) == 6", PASSED),
        ("def f(x):\n    return x * 3", "assert f(3) == 6", FAILED),
        ("import os\nos._exit(0)", "pass", FAILED),
        ("x = 1", "import time\ntime.sleep(5)", TIMEOUT),
    ]
    jobs = [cases[i % len(cases)] for i in range(32)]
    before = _fds()
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(lambda job: sandbox.run(job[0], job[1], timeouts_s=1.0), jobs))
    for (_, _, expected), r in zip(jobs, results, strict=True):
        assert r.status is expected, r.detail
    # no fd leaked (a leak only adds; an fd another test's background thread closes meanwhile
    # must not fail this one)
    assert _fds() <= before


# ---------------------------------------------------------------------------------------------------
# Errors and arguments


def test_missing_nsjail_raises_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SandboxError, match="make setup"):
        Sandbox(nsjail_path="/nonexistent/nsjail")
    monkeypatch.setattr(sandbox_mod.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None)
    with pytest.raises(SandboxError, match="make setup"):
        Sandbox()


def test_nsjail_that_cannot_start_is_error(tmp_path: Path, no_leaks: None) -> None:
    fake = tmp_path / "nsjail"
    fake.write_text("#!/bin/sh\necho '[E][x] cannot set up the jail' >&2\nexit 255\n")
    fake.chmod(0o755)
    sb = Sandbox(nsjail_path=fake)
    r = sb.run("x = 1", "pass")
    assert r.status is ERROR
    assert "could not start the jail" in r.detail and "user namespaces" in r.detail
    assert all(t.status is SKIPPED for t in r.tests)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ConfigError):
        SandboxLimits(wall_s=0)
    with pytest.raises(ConfigError):
        SandboxLimits(memory_mb=16)
    with pytest.raises(ConfigError):
        SandboxLimits(max_procs=1)
    sb = Sandbox()
    with pytest.raises(ConfigError, match="empty"):
        sb.run("x = 1", [])
    with pytest.raises(ConfigError, match="2 values for 1"):
        sb.run("x = 1", ["pass"], timeouts_s=[1.0, 2.0])
    with pytest.raises(ConfigError):
        sb.run("x = 1", ["pass"], timeouts_s=-1.0)
    with pytest.raises(ConfigError, match="seconds"):
        sb.run("x = 1", ["pass"], timeouts_s=["soon"])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        sb.run(b"x = 1", ["pass"])  # type: ignore[arg-type]


def test_to_dict_is_json(sandbox: Sandbox, no_leaks: None) -> None:
    r = sandbox.run("print('hi')", ["pass", "assert False"])
    d = json.loads(json.dumps(r.to_dict()))
    assert d["status"] == "failed" and d["failed_index"] == 1 and d["stdout"] == "hi\n"
    assert [t["status"] for t in d["tests"]] == ["passed", "failed"]


# ---------------------------------------------------------------------------------------------------
# The CLI


def test_cli_sandbox_run(tmp_path: Path, no_leaks: None) -> None:
    from typer.testing import CliRunner

    from rollpacker.cli import app

    code = tmp_path / "code.py"
    tests = tmp_path / "tests.py"
    code.write_text("def inc(x):\n    return x + 1\n")
    tests.write_text("assert inc(1) == 2\n")
    runner = CliRunner()
    res = runner.invoke(app, ["sandbox", "run", "--code", str(code), "--tests", str(tests), "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["status"] == "passed" and d["exec_s"] > 0 and d["tests"][0]["status"] == "passed"

    tests.write_text("assert inc(1) == 3\n")
    res = runner.invoke(app, ["sandbox", "run", "--code", str(code), "--tests", str(tests), "--json"])
    assert res.exit_code == 1 and json.loads(res.stdout)["status"] == "failed"

    tests.write_text("while True:\n    pass\n")
    res = runner.invoke(
        app, ["sandbox", "run", "--code", str(code), "--tests", str(tests), "--timeout-s", "0.5"]
    )
    assert res.exit_code == 1 and "timeout" in res.output

    res = runner.invoke(app, ["sandbox", "run", "--code", str(tmp_path / "nope.py"), "--tests", str(tests)])
    assert res.exit_code == 2 and "nope.py" in res.output


def test_cli_entry_point_runs_as_a_command(tmp_path: Path, no_leaks: None) -> None:
    code = tmp_path / "code.py"
    tests = tmp_path / "tests.py"
    code.write_text("x = 41\n")
    tests.write_text("assert x + 1 == 42\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollpacker.cli",
            "sandbox",
            "run",
            "--code",
            str(code),
            "--tests",
            str(tests),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "passed"


# ---------------------------------------------------------------------------------------------------
# HumanEval


@pytest.mark.slow
def test_humaneval_reference_solutions_pass_and_a_wrong_one_fails(no_leaks: None) -> None:
    from rollpacker.tasks.humaneval import load_humaneval

    examples = load_humaneval()
    assert len(examples) == 164
    sb = Sandbox()

    def check(ex):  # type: ignore[no-untyped-def]
        return ex.example_id, sb.run(ex.prompt + ex.metadata["canonical_solution"], list(ex.tests))

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(check, examples))
    wall = time.monotonic() - t0
    bad = {eid: r.detail for eid, r in results if r.status is not PASSED}
    assert not bad, bad
    assert wall < 120, wall

    ex = examples[0]  # has_close_elements: always False is wrong
    body = "    return False\n"
    r = sb.run(ex.prompt + body, list(ex.tests))
    assert r.status is FAILED and "AssertionError" in r.detail, r.detail
