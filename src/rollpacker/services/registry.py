"""Where the long-lived services live: named, detached Ray actors, or plain objects in this process.

The stages reach the services only through a ``ServiceRegistry``: ``get(role)`` returns a handle
whose ``call`` blocks for a result and whose ``cast`` fires and forgets. With Ray the handle wraps
a named, detached actor (``<experiment>.<arm>.<role>`` in the configured namespace), created on
first use with ``get_if_exists`` so that concurrent stages never create two; it survives the stage
process that created it, so engines stay warm across steps and KFP tasks. ``inline`` keeps the
same services as objects in this process (``rollpacker run --runner inline``, tests).

A service is bound to the config text it was built from: when a stage brings a different config
(an edited YAML on resume), the actor is killed and rebuilt rather than silently reused.

Invariants:
- one live actor per (experiment, arm, role) in a namespace;
- a service built from another config is never handed out;
- a lost service (a dead actor, a lost Ray cluster) is rebuilt on the next ``get``; it restores
  itself from the committed state the next stage passes it (``begin``/``sync``), never from memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar

from rollpacker.core.errors import RollpackerError

ROLES = ("rollout", "reward", "judge", "trainer")


class ServiceError(RollpackerError):
    """A service could not be reached, created, or failed a call."""


def config_digest(config_text: str) -> str:
    return hashlib.sha256(config_text.encode()).hexdigest()[:16]


# the RayCluster worker group (custom resource ``rollpacker_<group>``) each service role runs in
ROLE_RESOURCE = {
    "rollout": "rollpacker_rollout",
    "trainer": "rollpacker_training",
    "reward": "rollpacker_sandbox",
    "judge": "rollpacker_judge",
}


def _service_class(role: str) -> type:
    if role == "rollout":
        from rollpacker.services.rollout import RolloutService

        return RolloutService
    if role in ("reward", "judge"):
        from rollpacker.services.reward import RewardService

        return RewardService
    if role == "trainer":
        from rollpacker.services.trainer import TrainerService

        return TrainerService
    raise ServiceError(f"unknown service role {role!r}; roles: {', '.join(ROLES)}")


class Handle:
    """A service handle: ``call`` blocks, ``cast`` returns a future and does not wait."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def cast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class _LocalHandle(Handle):
    def __init__(self, obj: Any, pool: ThreadPoolExecutor) -> None:
        self.obj = obj
        self._pool = pool

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.obj, method)(*args, **kwargs)

    def cast(self, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        return self._pool.submit(getattr(self.obj, method), *args, **kwargs)


class _RayHandle(Handle):
    def __init__(self, actor: Any, timeout_s: float, name: str) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.name = name

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise ServiceError(
                f"service {self.name}: {method} took longer than services.call_timeout_s = {self.timeout_s} s"
            ) from e
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, RollpackerError):
                raise cause from None
            raise ServiceError(f"service {self.name}: {method} failed: {cause}") from e
        except ray.exceptions.RayActorError as e:
            raise ServiceError(
                f"service {self.name} died during {method} ({e}); the next step rebuilds it from the "
                "committed state"
            ) from e

    def cast(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.actor, method).remote(*args, **kwargs)


class ServiceRegistry:
    """Service handles for one experiment arm; ``mode`` is ``ray`` or ``inline``."""

    _inline: ClassVar[dict[str, tuple[str, Any]]] = {}  # name -> (digest, object): process-wide
    _inline_lock = threading.Lock()
    _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="service-cast")

    def __init__(
        self,
        config_text: str,
        experiment: str,
        arm: str,
        mode: str = "ray",
        ray_address: str = "",
        namespace: str = "rollpacker",
        call_timeout_s: float = 1800.0,
    ) -> None:
        if mode not in ("ray", "inline"):
            raise ServiceError(f"services mode {mode!r}: use 'ray' or 'inline'")
        self.config_text = config_text
        self.digest = config_digest(config_text)
        self.experiment = experiment
        self.arm = arm
        self.mode = mode
        self.ray_address = ray_address
        self.namespace = namespace
        self.call_timeout_s = call_timeout_s
        self._handles: dict[str, Handle] = {}
        self.forward_env: tuple[str, ...] = ("ROLLPACKER_CACHE", "ROLLPACKER_LOCAL_SERVICES")
        self.role_resources = False  # ask for the role's worker-group resource (services.role_resources)

    @classmethod
    def for_config(cls, config_text: str, cfg: Any, arm: str) -> ServiceRegistry:
        mode = os.environ.get("ROLLPACKER_SERVICES", "ray")
        reg = cls(
            config_text,
            cfg.experiment,
            arm,
            mode=mode,
            ray_address=cfg.services.ray_address,
            namespace=cfg.services.namespace,
            call_timeout_s=cfg.services.call_timeout_s,
        )
        reg.forward_env += (cfg.store.access_key_env, cfg.store.secret_key_env)
        reg.role_resources = bool(cfg.services.role_resources)
        return reg

    def name(self, role: str) -> str:
        return f"{self.experiment}.{self.arm}.{role}"

    def get(self, role: str) -> Handle:
        h = self._handles.get(role)
        if h is None:
            h = self._inline_get(role) if self.mode == "inline" else self._ray_get(role)
            self._handles[role] = h
        return h

    # -- inline -----------------------------------------------------------------------------------
    def _inline_get(self, role: str) -> Handle:
        name = self.name(role)
        with self._inline_lock:
            got = self._inline.get(name)
            if got is not None and got[0] != self.digest:
                _close(got[1])
                got = None
            if got is None:
                obj = _service_class(role)(self.config_text, self.arm, role)
                obj.bind(self)
                got = (self.digest, obj)
                self._inline[name] = got
        return _LocalHandle(got[1], self._pool)

    @classmethod
    def close_inline(cls) -> None:
        """Close every in-process service (end of an inline run, tests)."""
        with cls._inline_lock:
            for _, obj in cls._inline.values():
                _close(obj)
            cls._inline.clear()

    # -- Ray --------------------------------------------------------------------------------------
    def _ray_get(self, role: str) -> Handle:
        import ray

        connect_ray(self.ray_address, self.namespace)
        name = self.name(role)
        actor_cls = ray.remote(_service_class(role))
        opts: dict[str, Any] = {
            "name": name,
            "namespace": self.namespace,
            "lifetime": "detached",
            "get_if_exists": True,
            # 2 cores: the services block on each other and on I/O; Ray must not reserve CPUs.
            "num_cpus": 0,
            "max_concurrency": 16,
            "max_restarts": 0,
        }
        if self.role_resources:
            opts["resources"] = {ROLE_RESOURCE[role]: 1}
        env = {k: os.environ[k] for k in self.forward_env if os.environ.get(k)}
        if env:
            # the services reach the store with the credentials of the stage that created them
            opts["runtime_env"] = {"env_vars": env}
        actor = actor_cls.options(**opts).remote(self.config_text, self.arm, role)
        handle = _RayHandle(actor, self.call_timeout_s, name)
        try:
            digest = handle.call("config_digest")
        except ServiceError:
            digest = None  # died: rebuild below
        if digest != self.digest:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
            _wait_gone(name, self.namespace)
            actor = actor_cls.options(**opts).remote(self.config_text, self.arm, role)
            handle = _RayHandle(actor, self.call_timeout_s, name)
            handle.call("config_digest")
        handle.call("bind_ray", self.config_text, self.experiment, self.ray_address, self.namespace)
        return handle

    def kill_all(self) -> None:
        """Stop this arm's services (end of an arm: frees the engine's memory for the next)."""
        if self.mode == "inline":
            with self._inline_lock:
                for role in ROLES:
                    got = self._inline.pop(self.name(role), None)
                    if got is not None:
                        _close(got[1])
            return
        import ray

        connect_ray(self.ray_address, self.namespace)
        for role in ROLES:
            try:
                actor = ray.get_actor(self.name(role), namespace=self.namespace)
            except ValueError:
                continue
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=60)
            ray.kill(actor, no_restart=True)
        self._handles.clear()


def _close(obj: Any) -> None:
    with contextlib.suppress(Exception):
        obj.close()


def _wait_gone(name: str, namespace: str, timeout_s: float = 30.0) -> None:
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.2)
    raise ServiceError(f"service {name} did not go away within {timeout_s} s after ray.kill")


def connect_ray(address: str, namespace: str) -> None:
    """Join the Ray cluster (``services.ray_address``, else $RAY_ADDRESS, else the local head that
    ``rollpacker up`` started); a clear error when none answers."""
    import ray

    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS", "")
    if not addr:
        from rollpacker import devservices

        find = getattr(devservices, "local_ray_address", None)
        addr = (find() if find is not None else "") or ""
    if not addr:
        raise ServiceError(
            "no Ray cluster to run the services on: set services.ray_address or $RAY_ADDRESS, or start "
            "the local one with `make up`"
        )
    _probe(addr)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    try:
        ray.init(
            address=addr,
            namespace=namespace,
            log_to_driver=False,
            logging_level="ERROR",
            configure_logging=True,
        )
    except Exception as e:  # ConnectionError, RuntimeError, ...
        raise ServiceError(
            f"services.ray_address = {addr!r}: no Ray cluster answers ({type(e).__name__}: {e}); start "
            "the local one with `make up` or fix services.ray_address / $RAY_ADDRESS"
        ) from e


def _probe(addr: str, timeout_s: float = 3.0) -> None:
    """A TCP connect to the Ray head first: ``ray.init`` on a dead address retries for minutes."""
    import socket

    target = addr.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ServiceError(f"services.ray_address = {addr!r}: expected host:port (e.g. 127.0.0.2:6380)")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        raise ServiceError(
            f"services.ray_address = {addr!r}: no Ray cluster answers there ({e}); start the local one "
            "with `make up` or fix services.ray_address / $RAY_ADDRESS"
        ) from e
