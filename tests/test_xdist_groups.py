"""The suite's units of work under pytest-xdist (`make test` runs two workers with the scheduler
of tests/conftest.py): a module goes to one worker whole; every module with a slow test (or one that
starts real services from fast tests, or runs the sandbox) is in one of two serial units: the whole
runs with the sandbox's modules, and the rest; the fast modules are units of their own."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SERIAL_ENGINES, SERIAL_RUNS, scope_of, serial_module, serial_unit

ROOT = Path(__file__).resolve().parents[1]


def test_a_module_with_a_slow_test_is_serial_and_a_fast_one_is_its_own_unit(tmp_path: Path) -> None:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests/a/test_slow.py").write_text("import pytest\n@pytest.mark.slow\ndef test_x(): pass\n")
    (tmp_path / "tests/a/test_fast.py").write_text("def test_y(): pass\n")
    cache: dict[str, str] = {}
    assert scope_of("tests/a/test_slow.py::test_x[p1]", tmp_path, cache) == SERIAL_ENGINES
    assert scope_of("tests/a/test_fast.py::test_y", tmp_path, cache) == "tests/a/test_fast.py"
    assert scope_of("tests/a/test_fast.py::Cls::test_z", tmp_path, cache) == "tests/a/test_fast.py"


def test_the_sandbox_and_the_fast_modules_that_start_services_are_serial() -> None:
    assert serial_module("tests/rewards/test_sandbox.py", "")
    assert serial_module("tests/services/test_placement.py", "")
    assert not serial_module("tests/core/test_serde.py", "def test(): pass")
    # the sandbox's modules run in the unit of the whole runs (their code rewards jail processes
    # the sandbox's leak check would see), never beside them
    assert serial_unit("tests/rewards/test_sandbox.py", "") == SERIAL_RUNS
    assert serial_unit("tests/lab/bench/test_reward_bench.py", "pytest.mark.slow") == SERIAL_RUNS
    assert serial_unit("tests/services/test_placement.py", "") == SERIAL_ENGINES
    assert serial_unit("tests/core/test_serde.py", "def test(): pass") is None


def test_the_real_tree_puts_the_end_to_end_runs_in_the_serial_unit() -> None:
    cache: dict[str, str] = {}
    for nodeid, unit in (
        ("tests/experiment/test_chaos.py::test_faults", SERIAL_RUNS),
        ("tests/experiment/test_inline_runner.py::test_x", SERIAL_RUNS),
        ("tests/rewards/test_sandbox.py::test_x", SERIAL_RUNS),
        ("tests/trainers/megatron/test_gang.py::test_x", SERIAL_ENGINES),
        ("tests/engines/test_speculation.py::test_x", SERIAL_ENGINES),
    ):
        assert scope_of(nodeid, ROOT, cache) == unit, nodeid
    assert scope_of("tests/core/test_serde.py::test_x", ROOT, cache) == "tests/core/test_serde.py"


PLANTED_CONFTEST = "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n"
RECORD = """
import os, pathlib, pytest
{mark}
@pytest.mark.parametrize("i", range({n}))
def test_t(i):
    out = pathlib.Path(os.environ["PLANTED_OUT"])
    with out.open("a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{__name__}} {{i}}\\n")
"""


def test_each_worker_starts_with_a_serial_unit_of_its_own(tmp_path: Path) -> None:
    """A planted tree run on two real xdist workers: the two serial units go one to each worker
    (not both to one, one after the other, which xdist's order by test count would do here: the
    fast module has the most tests), and each unit's tests run in order on its worker."""
    import os
    import subprocess
    import sys

    modules = {
        "tests/experiment/test_run.py": ("@pytest.mark.slow", 3),
        "tests/rewards/test_box.py": ("", 2),
        "tests/engines/test_eng.py": ("@pytest.mark.slow", 3),
        "tests/core/test_fast.py": ("", 12),
    }
    for path, (mark, n) in modules.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(RECORD.format(mark=mark, n=n))
    (tmp_path / "conftest.py").write_text(PLANTED_CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    out = tmp_path / "ran.txt"
    env = {**os.environ, "PLANTED_OUT": str(out), "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'src'}"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "2",
            "--dist",
            "loadscope",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line.split() for line in out.read_text().splitlines()]
    worker = {m: {w for w, mm, _ in rows if mm == m} for m in ("test_run", "test_box", "test_eng")}
    assert all(len(w) == 1 for w in worker.values()), worker
    assert worker["test_run"] == worker["test_box"] != worker["test_eng"], worker
    first = {w: next(m for ww, m, _ in rows if ww == w) for w, _, _ in rows}
    assert sorted(first.values()) == ["test_eng", "test_run"], rows  # each worker began with its unit
