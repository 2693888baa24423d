"""The store rides out an outage of up to ``store.outage_s``: on a real S3 server (SeaweedFS)
stopped and restarted under a write, the write lands once the server is back; a longer outage
fails cleanly, naming the setting; a committed state chain is never half-written; only
"unavailable" errors are retried, and the startup check never waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices
from rollpacker.core.config import StoreConfig, config_from_text
from rollpacker.core.errors import ConfigError
from rollpacker.store import PatientStore, StoreError, open_store
from rollpacker.store.base import StoreUnavailable
from rollpacker.store.local import FileStore


class _Flaky:
    """A file store whose first ``down`` calls fail as unavailable (or with ``error``)."""

    def __init__(self, root: Path, down: int, error: type[StoreError] = StoreUnavailable) -> None:
        self.inner, self.down, self.error, self.calls = FileStore(root), down, error, 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        fn = getattr(self.inner, name)

        def call(*a, **k):  # type: ignore[no-untyped-def]
            self.calls += 1
            if self.calls <= self.down:
                raise self.error(f"planted outage, call {self.calls}")
            return fn(*a, **k)

        return call


def test_unavailable_calls_are_retried_with_backoff_until_they_go_through(tmp_path: Path) -> None:
    slept: list[float] = []
    flaky = _Flaky(tmp_path, down=4)
    store = PatientStore(flaky, outage_s=30, sleep=slept.append)  # type: ignore[arg-type]
    assert store.put_bytes("a/b", b"x") == flaky.inner.uri("a/b")
    assert slept == [0.25, 0.5, 1.0, 2.0] and store.retried == 1
    assert store.get_bytes("a/b") == b"x"


def test_an_outage_longer_than_the_budget_fails_naming_the_setting(tmp_path: Path) -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    store = PatientStore(_Flaky(tmp_path, down=10**6), outage_s=10, sleep=sleep, clock=lambda: now[0])  # type: ignore[arg-type]
    with pytest.raises(StoreError, match=r"still unreachable after .* store.outage_s = 10 bounds"):
        store.put_bytes("a/b", b"x")
    assert now[0] <= 10


def test_other_errors_and_the_startup_check_are_not_retried(tmp_path: Path) -> None:
    slept: list[float] = []
    store = PatientStore(_Flaky(tmp_path, down=1, error=StoreError), outage_s=30, sleep=slept.append)  # type: ignore[arg-type]
    with pytest.raises(StoreError, match="planted outage, call 1"):
        store.get_bytes("missing")
    assert slept == []
    down = PatientStore(_Flaky(tmp_path, down=1), outage_s=30, sleep=slept.append)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        down.check()
    assert slept == []


@pytest.mark.parametrize("value", ["-1", "7200"])
def test_a_bad_outage_budget_is_refused_by_name(value: str) -> None:
    with pytest.raises(ConfigError, match=f"store.outage_s = {value}"):
        config_from_text(f"store: {{outage_s: {value}}}\n")


# -- a real S3 server that goes away and comes back ------------------------------------------------


@pytest.fixture()
def seaweed(tmp_path: Path) -> Iterator[tuple[Path, devservices.SeaweedPorts, devservices.Services]]:
    root, ports = tmp_path / "svc", devservices.SeaweedPorts.free()
    svc = devservices.up(root, bucket="outage", mlflow=False, ray=False, seaweed_ports=ports, timeout_s=60)
    try:
        yield root, ports, svc
    finally:
        devservices.down(root, grace_s=3)


def _store(svc: devservices.Services, outage_s: float):  # type: ignore[no-untyped-def]
    env = {"ROLLPACKER_S3_ACCESS_KEY": svc.access_key, "ROLLPACKER_S3_SECRET_KEY": svc.secret_key}
    return open_store(StoreConfig(endpoint=svc.s3_endpoint, bucket="outage", outage_s=outage_s), env=env)


def _chain_then_outage(seaweed, outage_s: float):  # type: ignore[no-untyped-def]
    """Steps -1 and 0 committed on a store with ``outage_s``, then the S3 server stopped; the
    state store, step 1's state, and a function that starts the server again."""
    from rollpacker.store.state_store import StateStore
    from tests.services.test_scaledown_runtime import start_state

    root, ports, svc = seaweed
    states = StateStore(_store(svc, outage_s=outage_s), "exp", "arm")
    s0 = start_state("exp", "arm", "s3://outage/base/")
    states.commit(s0)
    states.commit(s0.successor())
    devservices.down(root, names=["seaweedfs"], grace_s=2)

    def restart() -> StateStore:
        """The server started again; the chain read back through a store that waits for it."""
        devservices.up(root, bucket="outage", mlflow=False, ray=False, seaweed_ports=ports)
        return StateStore(_store(svc, outage_s=30), "exp", "arm")

    return states, s0.successor().successor(), restart


@pytest.mark.slow
def test_a_write_during_an_s3_restart_lands_when_the_server_is_back(seaweed) -> None:  # type: ignore[no-untyped-def]
    states, step1, restart = _chain_then_outage(seaweed, outage_s=60)
    back = threading.Timer(3.0, restart)  # (its reader is not needed: this store waits)
    back.start()
    t0 = time.monotonic()
    states.commit(step1)  # document and pointer, through the outage
    took = time.monotonic() - t0
    back.join()
    assert 2.5 < took < 60, took
    assert states.history() == [-1, 0, 1] and states.latest().step == 1  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_longer_outage_fails_cleanly_and_leaves_the_chain_whole(seaweed) -> None:  # type: ignore[no-untyped-def]
    states, step1, restart = _chain_then_outage(seaweed, outage_s=2)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"store\.outage_s = 2 bounds"):
        states.commit(step1)
    assert time.monotonic() - t0 < 10
    again = restart()
    assert again.latest().step == 0  # type: ignore[union-attr]  # the failed commit left nothing half-done
    assert again.history() == [-1, 0]
