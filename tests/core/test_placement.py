"""core/placement.py: the GPUs each arm's services ask for, and the check of the arms against the
cluster's worker groups under ``services.arms`` (one test per invariant of the module)."""

from __future__ import annotations

from typing import Any

import pytest

from rollpacker.core.config import ArmSchedule, ConfigError, load_config
from rollpacker.core.placement import (
    ONE_POOL,
    GroupCapacity,
    PlacementError,
    arm_gpus,
    capacity_from_nodes,
    declared_capacity,
    plan_placement,
    rank_bundle,
)

GPUS = {"rollout": 8, "training": 8, "judge": 1}


def _cluster(**overrides: Any) -> Any:
    """The shipped cluster config (Qwen2.5-7B, two arms) with ``overrides`` (dotted keys)."""
    return load_config("cluster", overrides)


def _small_arms() -> dict[str, Any]:
    """Two arms that fit 8 + 8 GPUs at once: 4 rollout GPUs and a gang of 4 each, 2 judge shares."""
    return {
        "services.arms": "disjoint",
        "services.gpus": {"rollout": 8, "training": 8, "judge": 2},
        "planner.devices": 4,
        "planner.max_tp": 4,
        "train.megatron.world_size": 4,
    }


def test_a_service_asks_for_exactly_the_gpus_it_uses() -> None:
    cfg = _cluster()
    assert cfg.services.gpus.rollout == 8 and cfg.services.arms is ArmSchedule.SEQUENTIAL
    a = arm_gpus(cfg, "sync")
    # layouts: engines x TP = planner.devices; the megatron driver none, its 8 ranks 1 each
    assert (a.rollout, a.judge, a.trainer, a.gang) == (8, 1, 0, 8)
    assert a.by_group() == {"rollout": 8, "training": 8, "judge": 1}
    # no layouts: one engine of engine.tensor_parallel_size
    assert arm_gpus(_cluster(**{"planner.devices": 0}), "sync").rollout == 1
    assert arm_gpus(_cluster(**{"planner.devices": 0, "engine.tensor_parallel_size": 2}), "sync").rollout == 2
    # the torch trainer's actor holds its GPU itself
    torch = arm_gpus(_cluster(**{"train.backend": "torch"}), "sync")
    assert (torch.trainer, torch.gang, torch.actor_gpus("trainer")) == (1, 0, 1)


def test_no_service_asks_for_a_gpu_where_none_is_declared() -> None:
    cfg = load_config("default")
    assert not cfg.services.gpus.declared
    for arm in cfg.arm_names:
        a = arm_gpus(cfg, arm)
        assert a.total == 0 and all(a.actor_gpus(r) == 0 for r in ("rollout", "judge", "trainer", "reward"))


def test_sequential_needs_the_largest_arm_to_fit_and_disjoint_the_sum() -> None:
    seq = _cluster()
    plan = plan_placement(seq, seq.arm_names, declared_capacity(seq), "services.gpus")
    assert [a.arm for a in plan.arms] == ["sync", "tail_batching"]
    assert "sequential" in plan.describe()
    disjoint = _cluster(**{"services.arms": "disjoint"})
    with pytest.raises(PlacementError) as e:
        plan_placement(disjoint, disjoint.arm_names, declared_capacity(disjoint), "services.gpus")
    msg = str(e.value)
    assert "needs 16 GPUs together in the rollout worker group" in msg and "planner.devices" in msg
    half = {"services.arms": "disjoint", "planner.devices": 4, "planner.max_tp": 4}
    disjoint = _cluster(**half)  # the rollout groups fit (4 + 4), the training gangs do not
    with pytest.raises(PlacementError) as e:
        plan_placement(disjoint, disjoint.arm_names, declared_capacity(disjoint), "services.gpus")
    msg = str(e.value)
    assert "needs 16 GPUs together in the training worker group" in msg
    assert "sync 8, tail_batching 8" in msg and "it has 8 (services.gpus)" in msg
    assert "megatron 8 ranks x gpus_per_rank 1" in msg
    assert "set services.arms: sequential" in msg and "train.megatron.world_size" in msg
    small = _cluster(**_small_arms())
    plan = plan_placement(small, small.arm_names, declared_capacity(small), "services.gpus")
    assert sum(a.by_group()["rollout"] for a in plan.arms) == 8
    assert sum(a.by_group()["training"] for a in plan.arms) == 8


def test_a_group_too_small_for_even_one_arm_is_refused_without_suggesting_sequential() -> None:
    cfg = _cluster(**{"services.gpus": {"rollout": 8, "training": 4, "judge": 1}})
    with pytest.raises(PlacementError, match="needs 8 GPUs for the largest arm in the training") as e:
        plan_placement(cfg, cfg.arm_names, declared_capacity(cfg), "services.gpus")
    assert "sequential to run" not in str(e.value)
    judge = _cluster(**{**_small_arms(), "services.gpus": {"rollout": 8, "training": 8, "judge": 1}})
    with pytest.raises(PlacementError, match="needs 2 GPUs together in the judge worker group"):
        plan_placement(judge, judge.arm_names, declared_capacity(judge), "services.gpus")


def test_one_actors_gpus_come_from_one_node() -> None:
    cfg = _cluster(**{"planner.devices": 8})
    nodes = [
        {"GPU": 4.0, "rollpacker_rollout": 1000.0},
        {"GPU": 4.0, "rollpacker_rollout": 1000.0},
        {"GPU": 8.0, "rollpacker_training": 1000.0},
        {"GPU": 1.0, "rollpacker_judge": 1000.0},
        {"CPU": 16.0, "rollpacker_sandbox": 1000.0},
    ]
    cap = capacity_from_nodes(nodes, role_resources=True)
    assert cap["rollout"] == GroupCapacity(8.0, 4.0) and cap["judge"] == GroupCapacity(1.0, 1.0)
    with pytest.raises(PlacementError, match=r"rollout service asks for 8 GPUs in one actor.*largest node"):
        plan_placement(cfg, ["sync"], cap, "Ray's alive nodes")


def test_without_role_resources_every_gpu_is_one_pool() -> None:
    cap = capacity_from_nodes([{"GPU": 8.0}, {"CPU": 2.0}], role_resources=False)
    assert cap == {ONE_POOL: GroupCapacity(8.0, 8.0)}
    cfg = _cluster(**{"services.role_resources": False, "train.megatron.resource": ""})
    assert declared_capacity(cfg) == {ONE_POOL: GroupCapacity(17.0, 17.0)}
    with pytest.raises(PlacementError, match=r"needs 17 GPUs .* pool \(services.role_resources: false\)"):
        plan_placement(cfg, ["sync"], cap, "Ray's alive nodes")  # 8 rollout + 8 gang + 1 judge > 8


def test_a_gang_without_the_training_resource_is_refused_on_a_cluster() -> None:
    cfg = _cluster(**{"train.megatron.resource": ""})
    with pytest.raises(PlacementError, match=r"train.megatron.resource is empty.*rollpacker_training"):
        plan_placement(cfg, ["sync"], declared_capacity(cfg), "services.gpus")


def test_the_rank_bundle_holds_its_gpu_and_the_training_resource() -> None:
    m = _cluster().train.megatron
    assert rank_bundle(m) == {"CPU": 4.0, "GPU": 1.0, "rollpacker_training": 1.0}
    assert rank_bundle(load_config("default").train.megatron) == {"CPU": 1.0}


def test_the_settings_are_validated_by_name() -> None:
    with pytest.raises(ConfigError, match=r"services.arms"):
        _cluster(**{"services.arms": "parallel"})
    with pytest.raises(ConfigError, match=r"services.gpus.training = -1"):
        _cluster(**{"services.gpus": {"training": -1}})
    with pytest.raises(ConfigError, match=r"unknown config key.*services.gpus.sandbox"):
        _cluster(**{"services.gpus": {"sandbox": 2}})
