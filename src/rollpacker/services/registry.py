"""Where the long-lived services live: named, detached Ray actors, or plain objects in this process.

The stages reach the services only through a ``ServiceRegistry``: ``rollout()``, ``reward(role)``
and ``trainer()`` return typed proxies implementing the Protocols of ``services.api``. With Ray a
proxy wraps a named, detached actor (``<experiment>.<arm>.<role>`` in the configured namespace),
created on first use with ``get_if_exists`` so that concurrent stages never create two; it survives
the stage process that created it, so engines stay warm across steps and KFP tasks. ``inline``
keeps the same services as objects in this process (``rollpacker train``, ``run --runner inline``,
tests). A proxy method that the Protocol documents as fire-and-forget does not wait.

A service is bound to the config text it was built from: when a stage brings a different config
(an edited YAML on resume), the actor is killed and rebuilt rather than silently reused.

Each actor asks Ray for the GPUs its service uses (core/placement.py: the rollout engines, a CUDA
judge or torch trainer), so Ray gives it GPUs of its own. Before an arm's first actor starts, its
GPUs are checked against Ray's alive nodes; with ``services.arms: sequential`` the services of an
arm that has committed all its steps are stopped then, and an unfinished arm's refuse the next.

Invariants:
- one live actor per (experiment, arm, role) in a namespace;
- a service built from another config is never handed out;
- a lost service (a dead actor, a lost Ray cluster) is rebuilt on the next lookup; it restores
  itself from the committed state the next stage passes it (``begin``/``sync``), never from memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Concatenate, ParamSpec, TypeVar

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import ArmSchedule, ExperimentConfig, config_from_text
from rollpacker.core.errors import RollpackerError
from rollpacker.core.placement import (
    ROLE_GROUP,
    PlacementError,
    PlacementPlan,
    arm_gpus,
    capacity_from_nodes,
    plan_placement,
)
from rollpacker.core.state import ControllerState
from rollpacker.core.types import Group, Role, ServicesMode, parse_enum
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.services.api import (
    Anchors,
    Collected,
    CommittedStep,
    DeviceLease,
    DrainReport,
    EngineSync,
    GroupRewards,
    Peers,
    Pending,
    ProfileSummary,
    RewardAPI,
    RewardBegin,
    RolloutAPI,
    RoundPlan,
    RoundReport,
    ScoreItem,
    ServiceAPI,
    TrackingAPI,
    TrainerAPI,
    TrainerBegin,
    TrainReport,
    Validation,
    WeightPeer,
    WeightProbe,
    WeightPush,
)
from rollpacker.services.base import CHECKPOINT_CACHE_ENV, Service, ServiceError, config_digest
from rollpacker.services.reward import RewardService
from rollpacker.services.rollout import RolloutService
from rollpacker.services.tracking import TrackingService
from rollpacker.services.trainer import TrainerService
from rollpacker.store import open_store
from rollpacker.store.state_store import StateStore

P = ParamSpec("P")
R = TypeVar("R")

ROLES = tuple(Role)
SERVICE_CLASS: dict[Role, type[Service]] = {
    Role.ROLLOUT: RolloutService,
    Role.REWARD: RewardService,
    Role.JUDGE: RewardService,
    Role.TRAINER: TrainerService,
    Role.TRACKING: TrackingService,
}
# the RayCluster worker group (custom resource ``rollpacker_<group>``) each service role runs in
ROLE_RESOURCE = {role: f"rollpacker_{group}" for role, group in ROLE_GROUP.items()}


# -- handles: one service, reached in this process or in a Ray actor -----------------------------
class CastFailures:
    """Fire-and-forget calls that failed, by attempt: a cast's failure (the callee raised, or died)
    is recorded the moment its result comes back, and the service that waits on the work the cast
    carried (a round, a drain) asks ``get(attempt)`` while it waits and fails at once, naming the
    peer, the call and the cause. Every fire-and-forget call of the service Protocols carries the
    attempt as its first argument."""

    MAX_KEPT = 64  # attempts remembered (an attempt nobody waits for any more is dropped oldest first)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_attempt: dict[str, str] = {}

    def record(self, attempt: str, message: str) -> None:
        with self._lock:
            self._by_attempt.setdefault(attempt, message)  # the first failure is the cause
            while len(self._by_attempt) > self.MAX_KEPT:
                del self._by_attempt[next(iter(self._by_attempt))]

    def get(self, attempt: str) -> str | None:
        with self._lock:
            return self._by_attempt.get(attempt)


class Handle:
    """``call`` blocks for the result; ``cast`` starts the call and does not wait (its failure is
    recorded in ``failures`` under the attempt, its first argument). The method is given as the
    Protocol's function (``RolloutAPI.sync``), so its arguments are type-checked."""

    name: str
    failures: CastFailures

    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        raise NotImplementedError

    def cast(self, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs) -> None:
        raise NotImplementedError

    def _cast_failed(self, what: str, attempt: Any, cause: BaseException) -> None:
        self.failures.record(str(attempt), f"service {self.name}: {what} (fire and forget) failed: {cause}")


class _LocalHandle(Handle):
    def __init__(self, obj: Any, pool: ThreadPoolExecutor, name: str, failures: CastFailures) -> None:
        self.obj, self._pool, self.name, self.failures = obj, pool, name, failures

    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(self.obj, method.__name__)(*args, **kwargs)  # type: ignore[no-any-return]

    def cast(self, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs) -> None:
        what = method.__name__
        fut = self._pool.submit(getattr(self.obj, what), *args, **kwargs)

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                self._cast_failed(what, args[0] if args else "", exc)

        fut.add_done_callback(done)


class _RayHandle(Handle):
    """A named actor. A handle whose actor died is dropped (``on_dead``): the next lookup finds the
    rebuilt actor by name, so a service never keeps calling a peer that is gone."""

    def __init__(
        self,
        actor: Any,
        timeout_s: float,
        name: str,
        failures: CastFailures | None = None,
        on_dead: Callable[[], None] = lambda: None,
    ) -> None:
        self.actor, self.timeout_s, self.name = actor, timeout_s, name
        self.failures = failures if failures is not None else CastFailures()
        self._on_dead = on_dead

    def call(self, method: Callable[Concatenate[Any, P], R], *args: P.args, **kwargs: P.kwargs) -> R:
        import ray

        what = method.__name__
        try:
            ref = getattr(self.actor, what).remote(*args, **kwargs)
            return ray.get(ref, timeout=self.timeout_s)  # type: ignore[no-any-return]
        except ray.exceptions.GetTimeoutError as e:
            raise ServiceError(
                f"service {self.name}: {what} took longer than services.call_timeout_s = {self.timeout_s} s"
            ) from e
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, RollpackerError):
                raise cause from None
            raise ServiceError(f"service {self.name}: {what} failed: {cause}") from e
        except ray.exceptions.RayActorError as e:
            self._on_dead()
            raise ServiceError(
                f"service {self.name} died during {what} ({_actor_death(e)}); the step fails and its "
                "re-run rebuilds the service from the committed state"
            ) from e

    def cast(self, method: Callable[Concatenate[Any, P], Any], *args: P.args, **kwargs: P.kwargs) -> None:
        import ray

        what = method.__name__
        attempt = args[0] if args else ""
        try:
            ref = getattr(self.actor, what).remote(*args, **kwargs)
        except ray.exceptions.RayActorError as e:  # known dead already
            self._on_dead()
            self._cast_failed(what, attempt, RuntimeError(f"the service died ({_actor_death(e)})"))
            return

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is None:
                return
            if isinstance(exc, ray.exceptions.RayActorError):
                self._on_dead()
                exc = RuntimeError(f"the service died ({_actor_death(exc)})")
            elif isinstance(exc, ray.exceptions.RayTaskError) and getattr(exc, "cause", None) is not None:
                exc = exc.cause
            self._cast_failed(what, attempt, exc)

        ref.future().add_done_callback(done)


@functools.cache
def _remote_class(role: Role) -> Any:
    """The Ray actor class of ``role``'s service, made once per process: ``ray.remote`` builds a
    new subclass (tracing wrappers, docstrings) at every call and none is ever freed, and every
    service looks its peers up again each step (a reward service grew ~35 kB a step that way)."""
    import ray

    return ray.remote(SERVICE_CLASS[role])


def _actor_death(e: BaseException) -> str:
    """The first line of Ray's actor-death message (it runs to a page of context)."""
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


# -- typed proxies --------------------------------------------------------------------------------
class RolloutProxy(RolloutAPI):
    def __init__(self, h: Handle) -> None:
        self._h = h

    def sync(self, state: ControllerState) -> EngineSync:
        return self._h.call(RolloutAPI.sync, state)

    def plan(self, state: ControllerState, step: int) -> RoundPlan:
        return self._h.call(RolloutAPI.plan, state, step)

    def run_round(self, state: ControllerState, step: int, attempt: str) -> RoundReport:
        return self._h.call(RolloutAPI.run_round, state, step, attempt)

    def begin_round(self, state: ControllerState, step: int, attempt: str) -> Pending[RoundReport]:
        return self._h.call(RolloutAPI.begin_round, state, step, attempt)

    def collect(self, ticket: Pending[RoundReport]) -> Collected[RoundReport]:
        return self._h.call(RolloutAPI.collect, ticket)

    def validate(self, step: int, attempt: str) -> Validation:
        return self._h.call(RolloutAPI.validate, step, attempt)

    def profile(self, key: str) -> ProfileSummary:
        return self._h.call(RolloutAPI.profile, key)

    def load_weights(self, policy_version: int, checkpoint_uri: str, weights: dict[str, Any]) -> float:
        return self._h.call(RolloutAPI.load_weights, policy_version, checkpoint_uri, weights)

    def probe(self, prompts: int, max_tokens: int) -> WeightProbe:
        return self._h.call(RolloutAPI.probe, prompts, max_tokens)

    def weight_peer(self, port: int) -> WeightPeer:
        return self._h.call(RolloutAPI.weight_peer, port)

    def init_weight_transfer(self, group: TransferGroup) -> None:
        self._h.call(RolloutAPI.init_weight_transfer, group)

    def receive_weights(self, policy_version: int, checkpoint_uri: str) -> WeightPush:
        return self._h.call(RolloutAPI.receive_weights, policy_version, checkpoint_uri)

    def holds(self, checkpoint_uri: str) -> bool:
        return self._h.call(RolloutAPI.holds, checkpoint_uri)


class RewardProxy(RewardAPI):
    def __init__(self, h: Handle) -> None:
        self._h = h

    def begin(self, attempt: str, anchors: Anchors) -> RewardBegin:
        return self._h.call(RewardAPI.begin, attempt, anchors)

    def score(self, attempt: str, request_id: str, prompt_id: str, text: str) -> None:
        self._h.cast(RewardAPI.score, attempt, request_id, prompt_id, text)

    def group(self, attempt: str, group: Group, texts: tuple[str, ...]) -> None:
        self._h.cast(RewardAPI.group, attempt, group, texts)

    def group_rewards(self, attempt: str, group: Group, texts: tuple[str, ...]) -> GroupRewards:
        return self._h.call(RewardAPI.group_rewards, attempt, group, texts)

    def drain(self, attempt: str, expected: tuple[str, ...], rollout_end_wall: float) -> DrainReport:
        return self._h.call(RewardAPI.drain, attempt, expected, rollout_end_wall)

    def score_now(self, items: tuple[ScoreItem, ...]) -> tuple[bool, ...]:
        return self._h.call(RewardAPI.score_now, items)


class TrainerProxy(TrainerAPI):
    def __init__(self, h: Handle) -> None:
        self._h = h

    def begin(self, attempt: str, state: ControllerState, base_uri: str) -> TrainerBegin:
        return self._h.call(TrainerAPI.begin, attempt, state, base_uri)

    def submit(self, attempt: str, prompt_id: str, samples: tuple[TrainSample, ...]) -> None:
        self._h.cast(TrainerAPI.submit, attempt, prompt_id, samples)

    def finish(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> TrainReport:
        return self._h.call(TrainerAPI.finish, attempt, step, expected, checkpoint_key, batch_key)

    def holds(self, checkpoint_uri: str) -> bool:
        return self._h.call(TrainerAPI.holds, checkpoint_uri)

    def repurpose(self, attempt: str, devices: tuple[str, ...]) -> DeviceLease:
        return self._h.call(TrainerAPI.repurpose, attempt, devices)

    def begin_update(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> Pending[TrainReport]:
        return self._h.call(TrainerAPI.begin_update, attempt, step, expected, checkpoint_key, batch_key)

    def collect(self, ticket: Pending[TrainReport]) -> Collected[TrainReport]:
        return self._h.call(TrainerAPI.collect, ticket)


class TrackingProxy(TrackingAPI):
    def __init__(self, h: Handle) -> None:
        self._h = h

    def check(self) -> str:
        return self._h.call(TrackingAPI.check)

    def arm_run(self, arm: str, params: dict[str, str]) -> str:
        return self._h.call(TrackingAPI.arm_run, arm, params)

    def log_step(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        self._h.call(TrackingAPI.log_step, run_id, step, metrics)

    def state_pointer(self, run_id: str) -> tuple[str, int] | None:
        return self._h.call(TrackingAPI.state_pointer, run_id)

    def log_committed(self, commit: CommittedStep) -> None:
        self._h.call(TrackingAPI.log_committed, commit)

    def log_profile(self, run_id: str, step: int, uri: str, doc: dict[str, Any]) -> None:
        self._h.call(TrackingAPI.log_profile, run_id, step, uri, doc)


# -- the registry ---------------------------------------------------------------------------------
SERVICE_MALLOC_ARENA_MAX = "2"  # the service actors' glibc arenas unless the caller sets its own


@dataclass(frozen=True)
class RegistrySpec:
    """Everything a registry is made from (what travels into a Ray actor)."""

    config_text: str
    experiment: str
    arm: str
    mode: ServicesMode = ServicesMode.RAY
    ray_address: str = ""
    namespace: str = "rollpacker"
    call_timeout_s: float = 1800.0
    # what the services inherit from the process that creates them: never a secret, never a path
    # of this process's machine (a service may run on another node). The store's keys reach a
    # service from its own node's environment (the cluster's Ray pods mount the store's Secret) or
    # from the local credentials file `rollpacker up` wrote (mode 0600), found through the
    # $ROLLPACKER_SERVICES_DIR of the Ray node it runs on (`rollpacker up` starts its Ray head with
    # it). A runtime env is not secret: Ray keeps it in the GCS and shows it on the dashboard
    # (docs/operations.md, "Secrets").
    forward_env: tuple[str, ...] = (
        "ROLLPACKER_CACHE",
        CHECKPOINT_CACHE_ENV,
        "ROLLPACKER_LOCAL_SERVICES",
        "MALLOC_ARENA_MAX",
    )
    role_resources: bool = False  # ask for the role's worker-group resource (services.role_resources)
    # (role, num_gpus) of the actors that use GPUs, and whether the arm uses any (its gang's
    # included): core/placement.py; the placement is checked against Ray's nodes before the first
    # actor starts
    actor_gpus: tuple[tuple[Role, int], ...] = ()
    uses_gpus: bool = False

    def __post_init__(self) -> None:
        # the mode may come from the environment ($ROLLPACKER_SERVICES) or a pickled spec: refused by name
        object.__setattr__(self, "mode", parse_enum(ServicesMode, self.mode, "services mode"))

    @classmethod
    def of(
        cls, config_text: str, cfg: ExperimentConfig, arm: str, mode: ServicesMode, ray_address: str = ""
    ) -> RegistrySpec:
        """``ray_address``: the Ray cluster the runner resolved (default ``services.ray_address``;
        both empty: ``$RAY_ADDRESS``, see ``connect_ray``)."""
        gpus = arm_gpus(cfg, arm)
        return cls(
            config_text,
            cfg.experiment,
            arm,
            mode=mode,
            ray_address=ray_address or cfg.services.ray_address,
            namespace=cfg.services.namespace,
            call_timeout_s=cfg.services.call_timeout_s,
            role_resources=bool(cfg.services.role_resources),
            actor_gpus=tuple((r, gpus.actor_gpus(r)) for r in ROLES if gpus.actor_gpus(r)),
            uses_gpus=gpus.total > 0,
        )


class ServiceRegistry(Peers):
    """Typed service proxies for one experiment arm (``spec.mode``: ``ray`` or ``inline``)."""

    _inline: ClassVar[dict[str, tuple[str, Service]]] = {}  # name -> (digest, object): process-wide
    _inline_lock = threading.Lock()
    _pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="service-cast")

    def __init__(self, spec: RegistrySpec) -> None:
        self.spec = spec
        self.digest = config_digest(spec.config_text)
        self._handles: dict[Role, Handle] = {}
        self.failures = CastFailures()
        self._placed = False

    def __reduce__(self) -> tuple[Any, ...]:  # into a Ray actor: the spec, not the live handles
        return (ServiceRegistry, (self.spec,))

    def name(self, role: Role) -> str:
        return f"{self.spec.experiment}.{self.spec.arm}.{role}"

    def rollout(self) -> RolloutProxy:
        return RolloutProxy(self._get(Role.ROLLOUT))

    def reward(self, role: Role) -> RewardAPI:
        if not isinstance(role, Role) or not role.is_reward:
            raise ServiceError(f"reward service role {role!r}: use Role.REWARD or Role.JUDGE")
        return RewardProxy(self._get(role))

    def trainer(self) -> TrainerProxy:
        return TrainerProxy(self._get(Role.TRAINER))

    def tracking(self) -> TrackingAPI:
        """The arm's MLflow run (the stages' only way to MLflow)."""
        return TrackingProxy(self._get(Role.TRACKING))

    def cast_failure(self, attempt: str) -> str | None:
        """The first fire-and-forget call of ``attempt`` made through this registry that failed."""
        return self.failures.get(attempt)

    def refresh(self) -> None:
        self._handles.clear()

    def _forget(self, role: Role, handle: Handle) -> None:
        if self._handles.get(role) is handle:
            del self._handles[role]

    def disconnect(self) -> None:
        """Leave the Ray cluster if this process joined it; the services go on. A KFP task calls it
        before it exits: leaving through Ray's exit hook took 0.92 s, an explicit shutdown and exit 0.41 s."""
        self._handles.clear()
        if self.spec.mode is not ServicesMode.RAY:
            return
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()

    def _get(self, role: Role) -> Handle:
        h = self._handles.get(role)
        if h is None:
            h = self._inline_get(role) if self.spec.mode is ServicesMode.INLINE else self._ray_get(role)
            self._handles[role] = h
        return h

    # -- inline -----------------------------------------------------------------------------------
    def _inline_get(self, role: Role) -> Handle:
        name = self.name(role)
        with self._inline_lock:
            got = self._inline.get(name)
            if got is not None and got[0] != self.digest:
                _close(got[1])
                got = None
            if got is None:
                obj = SERVICE_CLASS[role](self.spec.config_text, self.spec.arm, role)
                obj.bind(self)
                got = (self.digest, obj)
                self._inline[name] = got
        return _LocalHandle(got[1], self._pool, name, self.failures)

    @classmethod
    def close_inline(cls) -> None:
        """Close every in-process service (end of an inline run, tests)."""
        with cls._inline_lock:
            for _, obj in cls._inline.values():
                _close(obj)
            cls._inline.clear()

    # -- Ray --------------------------------------------------------------------------------------
    def actor_options(self, role: Role) -> dict[str, Any]:
        """The ``.options()`` of ``role``'s Ray actor: its name, the worker group's resource with
        ``services.role_resources``, and ``num_gpus`` when it uses GPUs (core/placement.py)."""
        opts: dict[str, Any] = {
            "name": self.name(role),
            "namespace": self.spec.namespace,
            "lifetime": "detached",
            "get_if_exists": True,
            # 2 cores: the services block on each other and on I/O; Ray must not reserve CPUs.
            "num_cpus": 0,
            "max_concurrency": 16,
            "max_restarts": 0,
        }
        if self.spec.role_resources:
            opts["resources"] = {ROLE_RESOURCE[role]: 1}
        gpus = dict(self.spec.actor_gpus).get(role, 0)
        if gpus:
            opts["num_gpus"] = gpus  # Ray sets the actor's CUDA_VISIBLE_DEVICES to GPUs of its own
        env = {k: os.environ[k] for k in self.spec.forward_env if os.environ.get(k)}
        # glibc gives every thread that allocates its own malloc arena (up to 8 per core), and the
        # services' threads (streamed gradients, reward workers, Ray's) keep growing them: the soak
        # measured +48 MB per 100 steps in the trainer without a cap, flat with 2
        env.setdefault("MALLOC_ARENA_MAX", SERVICE_MALLOC_ARENA_MAX)
        opts["runtime_env"] = {"env_vars": env}
        return opts

    def _ray_get(self, role: Role) -> Handle:
        import ray

        connect_ray(self.spec.ray_address, self.spec.namespace)
        if self.spec.uses_gpus and not self._placed:
            self.check_placement()
        name = self.name(role)
        actor_cls = _remote_class(role)
        opts = self.actor_options(role)
        args = (self.spec.config_text, self.spec.arm, role)

        def handle_of(actor: Any) -> _RayHandle:
            h = _RayHandle(actor, self.spec.call_timeout_s, name, self.failures)
            h._on_dead = lambda: self._forget(role, h)
            return h

        handle = handle_of(actor_cls.options(**opts).remote(*args))
        try:
            digest: str | None = handle.call(ServiceAPI.config_digest)
        except ServiceError:
            digest = None  # died: rebuild below
        if digest != self.digest:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(handle.actor, no_restart=True)
            _wait_gone(name, self.spec.namespace)
            handle = handle_of(actor_cls.options(**opts).remote(*args))
            handle.call(ServiceAPI.config_digest)
        handle.call(ServiceAPI.bind, self)
        return handle

    def check_placement(self) -> None:
        """Before this arm's first actor starts: its GPUs (every arm's, with ``services.arms:
        disjoint``) checked against Ray's alive nodes, and, with ``sequential``, the services of
        another arm of the experiment released when that arm has committed all its steps (or a
        ``PlacementError`` when it has not: two arms would share the GPUs)."""
        cfg = config_from_text(self.spec.config_text)
        disjoint = cfg.services.arms is ArmSchedule.DISJOINT
        plan_on_ray(cfg, cfg.arm_names if disjoint else [self.spec.arm])
        if not disjoint:
            for other in cfg.arm_names:
                if other != self.spec.arm:
                    self._release_finished(cfg, other)
        self._placed = True

    def _release_finished(self, cfg: ExperimentConfig, other: str) -> None:
        """``services.arms: sequential``: arm ``other``'s live services are stopped when it has
        committed ``steps`` steps; a ``PlacementError`` when it has not."""
        import ray

        peer = ServiceRegistry(replace(self.spec, arm=other))
        live = []
        for role in ROLES:
            try:
                ray.get_actor(peer.name(role), namespace=self.spec.namespace)
                live.append(role)
            except ValueError:
                continue
        if not live:
            return
        done = StateStore(open_store(cfg.store), cfg.experiment, other).latest_step()
        committed = 0 if done is None else done + 1
        if committed < cfg.steps:
            raise PlacementError(
                f"services.arms: sequential runs one arm at a time, but arm {other!r} of experiment "
                f"{cfg.experiment!r} still has its services ({', '.join(live)}) and has committed "
                f"{committed} of {cfg.steps} steps, so arm {self.spec.arm!r} would share its GPUs: let arm "
                f"{other!r}'s run end first (`rollpacker submit` starts the arms one after another), or "
                "set services.arms: disjoint where the cluster holds every arm at once"
            )
        peer.kill_all()

    def kill_all(self) -> None:
        """Stop this arm's services (end of an arm: frees the engine's memory for the next)."""
        self._handles.clear()
        if self.spec.mode is ServicesMode.INLINE:
            with self._inline_lock:
                for role in ROLES:
                    got = self._inline.pop(self.name(role), None)
                    if got is not None:
                        _close(got[1])
            return
        import ray

        connect_ray(self.spec.ray_address, self.spec.namespace)
        for role in ROLES:
            try:
                actor = ray.get_actor(self.name(role), namespace=self.spec.namespace)
            except ValueError:
                continue
            with contextlib.suppress(Exception):
                ray.get(actor.close.remote(), timeout=60)
            ray.kill(actor, no_restart=True)


def _close(obj: Service) -> None:
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


def plan_on_ray(cfg: ExperimentConfig, arms: list[str]) -> PlacementPlan:
    """``arms``' GPUs checked against the GPUs of the connected Ray cluster's alive nodes, per
    worker group (core/placement.py); ``PlacementError`` when they do not fit."""
    import ray

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    capacity = capacity_from_nodes(nodes, cfg.services.role_resources)
    return plan_placement(cfg, arms, capacity, "Ray's alive nodes")


def connect_ray(address: str, namespace: str) -> None:
    """Join the Ray cluster at ``address`` (``services.ray_address``, or what the runner resolved:
    ``rollpacker run`` finds the local head that ``rollpacker up`` recorded and hands its address to
    the registry and, as $RAY_ADDRESS, to its KFP tasks), else $RAY_ADDRESS (a cluster's pods get it
    from the ConfigMap); a clear error when none is given or none answers."""
    import ray

    if ray.is_initialized():
        return
    addr = address or os.environ.get("RAY_ADDRESS", "")
    if not addr:
        raise ServiceError(
            "no Ray cluster to run the services on: set services.ray_address or $RAY_ADDRESS, or run "
            "through `rollpacker run` (it starts the local one, or finds the one `make up` started)"
        )
    _probe(addr)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for attempt in range(CLIENT_SERVER_ATTEMPTS):
        try:
            ray.init(
                address=addr,
                namespace=namespace,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
            )
            return
        except Exception as e:  # ConnectionError, RuntimeError, ...
            # the head's Ray client proxy forks a server process per client, and the fork can die
            # at start (seen here: a segfault in gRPC's event engine, forked while the proxy's
            # gRPC threads ran): that fails this connect only ("Initialization failure from
            # server"); the next connect gets another process
            if "Initialization failure from server" in str(e) and attempt + 1 < CLIENT_SERVER_ATTEMPTS:
                ray.shutdown()
                time.sleep(2.0)
                continue
            raise ServiceError(
                f"services.ray_address = {addr!r}: no Ray cluster answers ({type(e).__name__}: {e}); start "
                "the local one with `make up` or fix services.ray_address / $RAY_ADDRESS"
            ) from e


CLIENT_SERVER_ATTEMPTS = 3  # Ray client connects (``ray://``) whose server process failed to start


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
