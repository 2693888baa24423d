"""Shared fixtures: small traces and prompt helpers; the session's checkpoint downloads removed at
its end."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

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


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`, with the
# scheduler below). A test module goes to one worker whole (its module and session fixtures start
# once). The modules with a slow test (real engines, Ray, servers, whole runs) are one unit of
# work, "serial": they run one after another on one worker, in the order and alone as before, while
# the other modules run beside them on the other worker. Also serial: the modules that start Ray or
# the local services from fast tests, and the sandbox's (its leak check looks at every jailed
# process of the machine, so no other sandbox may run beside it). The grouping is by the module's
# source (a `pytest.mark.slow` in it), read by the controller, which collects nothing itself;
# xdist's own `xdist_group` marks are not used: under pytest 9.2 they group nothing (seen: a
# module's marked tests on both workers).
SERIAL_ALWAYS = (
    "tests/rewards/",
    "tests/services/test_placement.py",
    "tests/experiment/test_experiment_preflight.py",
)
SERIAL = "serial"


def serial_module(path: str, source: str) -> bool:
    """Whether the test module at ``path`` (relative to the repository) runs in the serial unit."""
    return path.startswith(SERIAL_ALWAYS) or "pytest.mark.slow" in source


def scope_of(nodeid: str, root: Path, cache: dict[str, str]) -> str:
    """The unit of work a test belongs to: ``SERIAL``, or its module's path."""
    path = nodeid.split("::", 1)[0]
    if path not in cache:
        try:
            source = (root / path).read_text()
        except OSError:
            source = ""
        cache[path] = SERIAL if serial_module(path, source) else path
    return cache[path]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under ``--dist loadscope``: xdist's scope scheduler, its scopes the units above."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root, cache = Path(config.rootpath), {}

    class SerialSlowScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, root, cache)

    return SerialSlowScheduling(config, log)


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
