"""Shared fixtures: small traces and prompt helpers; the session's checkpoint downloads removed at
its end."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from rollpacker.core.trace import TraceRecord, to_prompts
from rollpacker.core.types import Prompt

pytest_plugins = ["tests.budget"]  # the suite's time budget under `make test`

# The property tests draw the same examples on every run of the suite ("gate"), so a property that
# fails fails on every run, not once in a while in CI. `--hypothesis-profile=explore` draws new ones
# (pin what it finds with @example). Neither profile fails on time (a deadline, a slow data
# generation): the suite runs on a loaded machine, and a timing is not a property.
settings.register_profile(
    "gate", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "explore", derandomize=False, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("gate")


# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`). A module goes to
# one worker whole (its module and session fixtures start once). The modules with a slow test (real
# engines, Ray, servers, whole runs) are one group, "serial": they run one after another on one
# worker, as they ran before, while the other modules run beside them on the other worker. Also
# serial: the modules that start Ray or the local services from fast tests, and the sandbox's (its
# leak check looks at every jailed process of the machine, so no other sandbox may run beside it).
SERIAL_ALWAYS = (
    "tests/rewards/",
    "tests/services/test_placement.py",
    "tests/experiment/test_experiment_preflight.py",
)


def xdist_groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each module's xdist group: "serial", or the module's own path (beside anything)."""
    modules: dict[str, bool] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow = item.get_closest_marker("slow") is not None or path.startswith(SERIAL_ALWAYS)
        modules[path] = modules.get(path, False) or slow
    return {path: "serial" if slow else path for path, slow in modules.items()}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = xdist_groups(items)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid.split("::", 1)[0]]))


def make_prompts(lens: list[list[int]], prefix: str = "p") -> list[Prompt]:
    recs = [
        TraceRecord(prompt_id=f"{prefix}{i:03d}", prompt_len=4 + i % 5, response_lens=tuple(ls))
        for i, ls in enumerate(lens)
    ]
    return to_prompts(recs, vocab_size=259)


@pytest.fixture(scope="session", autouse=True)
def _checkpoint_downloads_of_this_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The services keep the checkpoints they download in ``$ROLLPACKER_CACHE/checkpoints`` (for a
    user's next run); the suite's end-to-end runs put ~1 GB there each time (measured: 47 entries,
    1.0 GB after two runs), which would fill a machine's disk run by run. The session downloads
    into a directory of its own instead (``$ROLLPACKER_CHECKPOINT_CACHE``, inherited by the stage
    processes and forwarded to the services), removed at its end: removing what appeared in the
    shared directory during the session also removed the downloads of another session running
    at the same time, mid-read. The warmed-up models stay in the shared cache."""
    from rollpacker.services.base import CHECKPOINT_CACHE_ENV

    root = tmp_path_factory.mktemp("checkpoints")
    before = os.environ.get(CHECKPOINT_CACHE_ENV)
    os.environ[CHECKPOINT_CACHE_ENV] = str(root)
    yield
    if before is None:
        os.environ.pop(CHECKPOINT_CACHE_ENV, None)
    else:
        os.environ[CHECKPOINT_CACHE_ENV] = before
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def prompts_factory():
    return make_prompts
