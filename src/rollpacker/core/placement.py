"""Where an experiment's services get their GPUs: what each arm's service actors ask Ray for, and
whether the cluster's worker groups hold the arms (``services.arms``: sequential or disjoint).

The GPU-holding worker groups of the RayCluster are ``rollout``, ``training`` and ``judge``
(manifests/overlays/gpu). An arm uses, per group:

- rollout: its rollout service's engines, ``engines x TP`` GPUs = ``planner.devices`` (the
  layouts' devices) or, without layouts, ``engine.tensor_parallel_size`` (one engine);
- training: the megatron gang's bundles (``ranks x gpus_per_rank``; the driver actor asks none),
  or one GPU for the torch trainer's actor on CUDA;
- judge: one GPU (an MPS share on the gpu overlay) for a judge on CUDA.

Ray hands each actor and each bundle GPUs of its own (``ray.get_gpu_ids()``, and
``CUDA_VISIBLE_DEVICES`` set to them), so two arms whose requests fit together never share a GPU.

Invariants:
- a service asks for exactly the GPUs it uses, and none on a machine that declares no GPUs
  (``services.gpus`` all 0): the CPU path is unchanged;
- sequential: the largest arm fits each group; disjoint: the arms' sum fits each group;
- one actor's GPUs come from one node: a rollout service never asks for more than one pod holds;
- a plan that does not fit is refused before any run or actor starts, naming the group, what the
  arms ask, what the group has, and what to change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollpacker.core.config import ArmSchedule, ExperimentConfig, MegatronConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import Role

GPU_GROUPS = ("rollout", "training", "judge")
# the worker group each service role's actor runs in (its custom resource rollpacker_<group>)
ROLE_GROUP: dict[Role, str] = {
    Role.ROLLOUT: "rollout",
    Role.TRAINER: "training",
    Role.JUDGE: "judge",
    Role.REWARD: "sandbox",
    Role.TRACKING: "sandbox",  # a CPU worker: an MLflow client and nothing else
}
ONE_POOL = "cluster"  # services.role_resources: false: every node is one pool


class PlacementError(ConfigError):
    """The arms' services cannot be placed on the cluster's GPUs; the message says what to change."""


@dataclass(frozen=True)
class ArmGpus:
    """The GPUs one arm's services ask Ray for."""

    arm: str
    rollout: int  # the rollout service actor: engines x TP
    judge: int  # the judge service actor
    trainer: int  # the trainer service actor (torch on CUDA; the megatron driver asks none)
    gang: int  # the megatron ranks' placement-group bundles (training group)
    gang_detail: str = ""  # how ``gang`` was counted, for messages

    def actor_gpus(self, role: Role) -> int:
        """``num_gpus`` of ``role``'s service actor."""
        return {Role.ROLLOUT: self.rollout, Role.JUDGE: self.judge, Role.TRAINER: self.trainer}.get(role, 0)

    def by_group(self) -> dict[str, int]:
        return {"rollout": self.rollout, "training": self.trainer + self.gang, "judge": self.judge}

    @property
    def total(self) -> int:
        return sum(self.by_group().values())


@dataclass(frozen=True)
class GroupCapacity:
    """A pool's GPUs: all of them, and the most on any one node (an actor's GPUs are one node's)."""

    gpus: float
    largest_node: float


@dataclass(frozen=True)
class PlacementPlan:
    """The checked plan: each arm's GPUs, the pools they were checked against, and how."""

    schedule: ArmSchedule
    arms: tuple[ArmGpus, ...]
    capacity: Mapping[str, GroupCapacity]
    source: str  # where the capacity came from ("services.gpus", "Ray's nodes")

    def describe(self) -> str:
        per = "; ".join(
            f"{a.arm}: " + ", ".join(f"{g} {n}" for g, n in a.by_group().items() if n) for a in self.arms
        )
        return f"services.arms: {self.schedule.value}; GPUs per arm ({per or 'none'}) on {self.source}"


def _uses_cuda(device: str, group_gpus: int) -> bool:
    """A service's device setting: ``cuda``/``cuda:N`` uses a GPU; ``auto`` does when its worker group
    has GPUs; ``cpu`` never."""
    if device.startswith("cuda"):
        return True
    return device == "auto" and group_gpus > 0


def rank_bundle(m: MegatronConfig) -> dict[str, float]:
    """One megatron rank's placement-group bundle: its CPUs, ``gpus_per_rank`` GPUs and one unit of
    ``train.megatron.resource`` (the training group's) when set."""
    bundle: dict[str, float] = {"CPU": m.cpus_per_rank}
    if m.gpus_per_rank:
        bundle["GPU"] = m.gpus_per_rank
    if m.resource:
        bundle[m.resource] = 1.0
    return bundle


def arm_gpus(cfg: ExperimentConfig, arm: str) -> ArmGpus:
    """What ``arm``'s services ask Ray for under ``cfg``."""
    c = cfg.for_arm(arm)
    gpus = c.services.gpus
    rollout = (c.planner.devices or c.engine.tensor_parallel_size) if gpus.rollout > 0 else 0
    judge = int(_uses_cuda(c.reward.judge.device, gpus.judge))
    trainer, gang, detail = 0, 0, ""
    if c.train.backend == "megatron":
        m = c.train.megatron
        gang = int(m.ranks * m.gpus_per_rank)
        detail = f"megatron {m.ranks} ranks x gpus_per_rank {m.gpus_per_rank:g}"
    else:
        trainer = int(_uses_cuda(c.train.device, gpus.training))
    return ArmGpus(arm, rollout=rollout, judge=judge, trainer=trainer, gang=gang, gang_detail=detail)


def declared_capacity(cfg: ExperimentConfig) -> dict[str, GroupCapacity]:
    """The pools as ``services.gpus`` declares them (one pool without role resources). The largest
    node is not declared: a group's total stands for it."""
    g = cfg.services.gpus
    counts = {"rollout": g.rollout, "training": g.training, "judge": g.judge}
    if not cfg.services.role_resources:
        total = float(sum(counts.values()))
        return {ONE_POOL: GroupCapacity(total, total)}
    return {k: GroupCapacity(float(v), float(v)) for k, v in counts.items()}


def capacity_from_nodes(
    nodes: Iterable[Mapping[str, float]], role_resources: bool
) -> dict[str, GroupCapacity]:
    """The pools from Ray's alive nodes' resources (``ray.nodes()[i]["Resources"]``): with role
    resources, a group's GPUs are those of the nodes that advertise ``rollpacker_<group>``."""
    pools: dict[str, list[float]] = {ONE_POOL: []} if not role_resources else {g: [] for g in GPU_GROUPS}
    for res in nodes:
        gpu = float(res.get("GPU", 0.0))
        if not role_resources:
            pools[ONE_POOL].append(gpu)
            continue
        for g in GPU_GROUPS:
            if res.get(f"rollpacker_{g}", 0.0) > 0:
                pools[g].append(gpu)
    return {k: GroupCapacity(sum(v), max(v, default=0.0)) for k, v in pools.items()}


def plan_placement(
    cfg: ExperimentConfig,
    arms: Sequence[str],
    capacity: Mapping[str, GroupCapacity],
    source: str,
) -> PlacementPlan:
    """The arms' GPUs checked against ``capacity`` under ``services.arms``; ``PlacementError`` (what
    each arm asks, what the pool has, what to change) when they do not fit."""
    schedule = cfg.services.arms
    demands = tuple(arm_gpus(cfg, a) for a in arms)
    role_resources = cfg.services.role_resources
    for d in demands:
        _check_gang_group(cfg, d)
    need = {(g if role_resources else ONE_POOL): [0] * len(demands) for g in GPU_GROUPS}
    for i, d in enumerate(demands):
        for group, n in d.by_group().items():
            need[group if role_resources else ONE_POOL][i] += n
    for pool, per_arm in need.items():
        asked = sum(per_arm) if schedule is ArmSchedule.DISJOINT else max(per_arm, default=0)
        have = capacity.get(pool, GroupCapacity(0.0, 0.0))
        if asked > have.gpus:
            raise PlacementError(_refusal(cfg, pool, demands, per_arm, asked, have.gpus, source))
    for d in demands:  # one actor's GPUs are one node's
        for role in (Role.ROLLOUT, Role.JUDGE, Role.TRAINER):
            n = d.actor_gpus(role)
            pool = ROLE_GROUP[role] if role_resources else ONE_POOL
            largest = capacity.get(pool, GroupCapacity(0.0, 0.0)).largest_node
            if n > largest:
                raise PlacementError(
                    f"arm {d.arm!r}: the {role} service asks for {n} GPUs in one actor, but the largest "
                    f"node of the {pool} group has {largest:g} ({source}); one actor's GPUs are one "
                    f"node's: {_what_to_lower(role)}"
                )
    return PlacementPlan(schedule, demands, dict(capacity), source)


def _check_gang_group(cfg: ExperimentConfig, d: ArmGpus) -> None:
    m = cfg.train.megatron
    if cfg.services.role_resources and d.gang and not m.resource:
        raise PlacementError(
            f"train.megatron.resource is empty: the megatron gang's {d.gang} GPUs may be placed on any "
            "worker group's pods, the rollout group's included; set train.megatron.resource: "
            "rollpacker_training (the training group's resource)"
        )


def _what_to_lower(role: Role) -> str:
    return {
        Role.ROLLOUT: "lower planner.devices (or engine.tensor_parallel_size without layouts)",
        Role.JUDGE: "give the judge group's pods a GPU (rayStartParams num-gpus) or set "
        "reward.judge.device: cpu",
        Role.TRAINER: "give the training group's pods a GPU or set train.device: cpu",
    }[role]


def _refusal(
    cfg: ExperimentConfig,
    pool: str,
    demands: Sequence[ArmGpus],
    per_arm: Sequence[int],
    asked: int,
    have: float,
    source: str,
) -> str:
    schedule = cfg.services.arms
    each = ", ".join(f"{d.arm} {n}" for d, n in zip(demands, per_arm, strict=True))
    how = "together" if schedule is ArmSchedule.DISJOINT else "for the largest arm"
    parts = [
        f"services.arms: {schedule.value} needs {asked} GPUs {how} in the {pool} "
        f"{'worker group' if pool != ONE_POOL else 'pool (services.role_resources: false)'} "
        f"(per arm: {each}), but it has {have:g} ({source})."
    ]
    gang = next((d.gang_detail for d in demands if d.gang), "")
    if gang and pool in ("training", ONE_POOL):
        parts.append(f"The training GPUs are the {gang}.")
    fixes = []
    if schedule is ArmSchedule.DISJOINT and len(demands) > 1 and max(per_arm) <= have:
        fixes.append("set services.arms: sequential to run the arms one after another")
    fixes.append(
        {
            "rollout": "lower planner.devices or engine.tensor_parallel_size",
            "training": "lower train.megatron.world_size (or its tp x pp x dp)",
            "judge": "set reward.judge.device: cpu",
        }.get(pool, "lower the services' GPUs")
    )
    fixes.append(f"or give the group more GPUs (and set services.gpus.{pool} to match)")
    if pool == ONE_POOL:
        fixes[-1] = "or add GPUs to the cluster"
    parts.append("Before any run starts: " + "; ".join(fixes) + ".")
    return " ".join(parts)
