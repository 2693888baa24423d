"""The suite's grouping for pytest-xdist (`make test` runs two workers, tests/conftest.py): whole
modules go to one worker, every module with a slow test (or one that starts real services from
fast tests, or runs the sandbox) is in the one "serial" group, the rest run beside it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import xdist_groups


def _item(nodeid: str, slow: bool = False) -> Any:
    return SimpleNamespace(
        nodeid=nodeid, get_closest_marker=lambda name: object() if slow and name == "slow" else None
    )


def test_a_module_with_one_slow_test_is_serial_whole() -> None:
    groups = xdist_groups(
        [_item("tests/a/test_x.py::test_fast"), _item("tests/a/test_x.py::test_slow[p1]", slow=True)]
    )
    assert groups == {"tests/a/test_x.py": "serial"}


def test_fast_modules_are_their_own_group_and_the_sandbox_is_serial() -> None:
    groups = xdist_groups(
        [
            _item("tests/core/test_y.py::test_a"),
            _item("tests/core/test_y.py::test_b[1-2]"),
            _item("tests/rewards/test_sandbox.py::test_fast"),
            _item("tests/services/test_placement.py::test_fast"),
        ]
    )
    assert groups["tests/core/test_y.py"] == "tests/core/test_y.py"
    assert groups["tests/rewards/test_sandbox.py"] == "serial"
    assert groups["tests/services/test_placement.py"] == "serial"


def test_the_suite_marks_every_test_with_its_group(request: pytest.FixtureRequest) -> None:
    group = request.node.get_closest_marker("xdist_group")
    assert group is not None and group.args == ("tests/test_xdist_groups.py",)
