"""A service that fails or dies while another waits on it is noticed at once, not at the call
timeout: on a real Ray cluster, a blocking call to an actor that is SIGKILLed fails within seconds
(measured here), a fire-and-forget call that raised or hit a dead actor is recorded under its
attempt, and a dead actor's handle is dropped so that the next lookup finds the rebuilt one. The
waiting services (a reward drain, a rollout round) fail on a recorded failure within a second."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rollpacker import devservices
from rollpacker.services.base import ServiceError
from rollpacker.services.registry import CastFailures, RegistrySpec, ServiceRegistry, _RayHandle


class _Echo:
    def pid(self) -> int:
        return os.getpid()

    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"

    def boom(self, attempt: str) -> None:
        raise ValueError(f"planted failure in {attempt}")

    def fine(self, attempt: str) -> str:
        return attempt


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import ray

    root = tmp_path_factory.mktemp("ray")
    svc = devservices.up(root, s3=False, mlflow=False, ray_ports=devservices.RayPorts.free(), timeout_s=120)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=svc.ray_address, namespace="fail-fast-test", log_to_driver=False)
    try:
        yield svc.ray_address
    finally:
        ray.shutdown()
        devservices.down(root, grace_s=3.0)


def _handle(failures: CastFailures, dead: list[str]) -> _RayHandle:
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=0)(_Echo).remote()
    return _RayHandle(
        actor, timeout_s=600, name="t.echo", failures=failures, on_dead=lambda: dead.append("x")
    )


def _eventually(pred: Any, within_s: float) -> float:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > within_s:
            raise AssertionError(f"not within {within_s} s")
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.mark.slow
def test_a_kill_while_a_call_waits_is_noticed_in_seconds_and_the_handle_dropped(ray_cluster: str) -> None:
    failures, dead = CastFailures(), []
    h = _handle(failures, dead)
    pid = h.call(_Echo.pid)  # type: ignore[arg-type]
    got: list[BaseException] = []

    def wait() -> None:
        try:
            h.call(_Echo.nap, 300)  # type: ignore[arg-type]
        except BaseException as e:
            got.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    detected = time.monotonic() - t0
    assert got and isinstance(got[0], ServiceError), got
    assert "t.echo died during nap" in str(got[0])
    print(f"\n[fail-fast] a SIGKILLed actor's death reached the waiting call after {detected:.2f} s")
    assert detected < 30, f"the death was noticed after {detected:.1f} s"
    assert dead  # the handle asked to be dropped
    # a fire-and-forget call to the dead actor is recorded under its attempt
    h.cast(_Echo.fine, "a-dead")  # type: ignore[arg-type]
    _eventually(lambda: failures.get("a-dead") is not None, 30)
    assert "t.echo: fine (fire and forget) failed: the service died" in (failures.get("a-dead") or "")


@pytest.mark.slow
def test_a_cast_that_raises_is_recorded_under_its_attempt_only(ray_cluster: str) -> None:
    failures, dead = CastFailures(), []
    h = _handle(failures, dead)
    h.cast(_Echo.fine, "a1")  # type: ignore[arg-type]
    h.cast(_Echo.boom, "a2")  # type: ignore[arg-type]
    took = _eventually(lambda: failures.get("a2") is not None, 30)
    assert "planted failure in a2" in (failures.get("a2") or "") and took < 10
    time.sleep(0.5)
    assert failures.get("a1") is None and not dead  # a success records nothing, the actor lives


def test_inline_casts_record_their_failures() -> None:
    reg = ServiceRegistry(
        RegistrySpec(config_text="experiment: ff\n", experiment="ff", arm="sync", mode="inline")
    )
    failures = reg.failures
    from rollpacker.services.registry import _LocalHandle

    h = _LocalHandle(_Echo(), ServiceRegistry._pool, "ff.echo", failures)
    h.cast(_Echo.boom, "b1")  # type: ignore[arg-type]
    _eventually(lambda: reg.cast_failure("b1") is not None, 10)
    assert reg.cast_failure("b1") == "service ff.echo: boom (fire and forget) failed: planted failure in b1"
    assert reg.cast_failure("b2") is None


def test_cast_failures_keep_the_first_cause_and_a_bounded_number_of_attempts() -> None:
    f = CastFailures()
    f.record("a", "first")
    f.record("a", "second")
    assert f.get("a") == "first"
    for i in range(CastFailures.MAX_KEPT + 5):
        f.record(f"x{i}", "m")
    assert f.get("a") is None and f.get(f"x{CastFailures.MAX_KEPT + 4}") == "m"


def test_service_actors_cap_their_malloc_arenas_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """glibc's per-thread malloc arenas grew the trainer actor's RSS by ~48 MB per 100 soak steps;
    the actors start with MALLOC_ARENA_MAX=2, or the caller's own value."""
    from rollpacker.core.config import config_from_text

    text = "experiment: arenas\n"
    reg = ServiceRegistry(RegistrySpec.of(text, config_from_text(text), "sync", "ray"))
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    for role in ("rollout", "reward", "trainer", "tracking"):
        assert reg.actor_options(role)["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "2"
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert reg.actor_options("trainer")["runtime_env"]["env_vars"]["MALLOC_ARENA_MAX"] == "4"


def test_a_service_class_is_made_a_ray_actor_class_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.remote(cls)`` builds a new subclass each time and none is freed; every service looks
    its peers up again each step, which grew the reward actor ~35 kB a step."""
    import ray

    from rollpacker.services import registry

    made: list[type] = []
    real = ray.remote

    def counting(cls: type) -> object:
        made.append(cls)
        return real(cls)

    monkeypatch.setattr(ray, "remote", counting)
    registry._remote_class.cache_clear()
    try:
        first = [registry._remote_class(role) for role in ("reward", "trainer")]
        again = [registry._remote_class(role) for role in ("reward", "trainer")] * 3
        assert again == first * 3 and len(made) == 2
    finally:
        registry._remote_class.cache_clear()
