"""The suite's units of work under pytest-xdist (`make test` runs two workers with the scheduler
of tests/conftest.py): a module goes to one worker whole; every module with a slow test (or one that
starts real services from fast tests, or runs the sandbox) is in the one "serial" unit, the rest run
beside it."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import SERIAL, scope_of, serial_module

ROOT = Path(__file__).resolve().parents[1]


def test_a_module_with_a_slow_test_is_serial_and_a_fast_one_is_its_own_unit(tmp_path: Path) -> None:
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests/a/test_slow.py").write_text("import pytest\n@pytest.mark.slow\ndef test_x(): pass\n")
    (tmp_path / "tests/a/test_fast.py").write_text("def test_y(): pass\n")
    cache: dict[str, str] = {}
    assert scope_of("tests/a/test_slow.py::test_x[p1]", tmp_path, cache) == SERIAL
    assert scope_of("tests/a/test_fast.py::test_y", tmp_path, cache) == "tests/a/test_fast.py"
    assert scope_of("tests/a/test_fast.py::Cls::test_z", tmp_path, cache) == "tests/a/test_fast.py"


def test_the_sandbox_and_the_fast_modules_that_start_services_are_serial() -> None:
    assert serial_module("tests/rewards/test_sandbox.py", "")
    assert serial_module("tests/services/test_placement.py", "")
    assert not serial_module("tests/core/test_serde.py", "def test(): pass")


def test_the_real_tree_puts_the_end_to_end_runs_in_the_serial_unit() -> None:
    cache: dict[str, str] = {}
    for nodeid in (
        "tests/experiment/test_chaos.py::test_faults",
        "tests/experiment/test_inline_runner.py::test_x",
        "tests/trainers/megatron/test_gang.py::test_x",
    ):
        assert scope_of(nodeid, ROOT, cache) == SERIAL, nodeid
    assert scope_of("tests/core/test_serde.py::test_x", ROOT, cache) == "tests/core/test_serde.py"
