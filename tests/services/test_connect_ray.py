"""``connect_ray`` through the Ray client: a connect whose server process died at start (the head's
proxy forks one per client) is retried a bounded number of times; any other failure is not."""

from __future__ import annotations

from typing import Any

import pytest

from rollpacker.services import registry
from rollpacker.services.base import ServiceError

SERVER_DIED = ConnectionAbortedError("Initialization failure from server:\nTraceback ... ZombieProcess")


class FakeRay:
    """The ``ray`` module's edge: ``init`` fails with the queued errors, then connects."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors, self.inits, self.shutdowns = errors, 0, 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kw: Any) -> None:
        self.inits += 1
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    import sys

    def install(errors: list[BaseException]) -> FakeRay:
        ray = FakeRay(errors)
        monkeypatch.setitem(sys.modules, "ray", ray)
        monkeypatch.setattr(registry, "_probe", lambda addr: None)
        monkeypatch.setattr(registry.time, "sleep", lambda s: None)
        return ray

    return install


def test_a_client_server_that_died_at_start_is_retried(fake: Any) -> None:
    ray = fake([SERVER_DIED, SERVER_DIED])
    registry.connect_ray("ray://127.0.0.3:10001", "ns")
    assert ray.inits == 3 and ray.shutdowns == 2


def test_the_retries_are_bounded_and_the_error_names_the_setting(fake: Any) -> None:
    ray = fake([SERVER_DIED] * registry.CLIENT_SERVER_ATTEMPTS)
    with pytest.raises(ServiceError, match=r"services.ray_address = 'ray://127.0.0.3:10001'"):
        registry.connect_ray("ray://127.0.0.3:10001", "ns")
    assert ray.inits == registry.CLIENT_SERVER_ATTEMPTS


def test_other_failures_are_not_retried(fake: Any) -> None:
    ray = fake([ConnectionError("refused")])
    with pytest.raises(ServiceError, match="no Ray cluster answers"):
        registry.connect_ray("ray://127.0.0.3:10001", "ns")
    assert ray.inits == 1


def test_without_an_address_or_ray_address_it_names_both_and_the_runner(fake: Any, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The registry finds no local head by itself (no dev tooling in the services): the runner hands
    the address over, or $RAY_ADDRESS carries it."""
    ray = fake([])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ServiceError, match=r"services.ray_address or \$RAY_ADDRESS.*`rollpacker run`"):
        registry.connect_ray("", "ns")
    assert ray.inits == 0
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.3:6380")
    registry.connect_ray("", "ns")
    assert ray.inits == 1
