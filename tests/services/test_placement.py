"""Two arms' services on a Ray cluster with fake GPUs, shaped like the gpu overlay: a rollout node
and a training node of 8 GPUs each, a judge node of 2 (MPS shares), each advertising its worker
group's resource. The actors are created with exactly the options the registry gives them (a probe
class stands in for the services, which would start engines) and the megatron ranks with the gang's
bundles: with ``services.arms: disjoint`` each arm gets GPUs of its own; a plan the cluster cannot
hold is refused before any actor starts; with ``sequential`` an arm's services are released only
once it has committed every step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollpacker.core.config import config_from_text
from rollpacker.core.placement import PlacementError, rank_bundle
from rollpacker.services.registry import RegistrySpec, ServiceRegistry
from rollpacker.store import open_store
from rollpacker.store.state_store import StateStore

NAMESPACE = "placement-test"
GROUP_GPUS = {"rollout": 8, "training": 8, "judge": 2}


class _Probe:
    """Stands in for a service actor: where Ray put it and which GPUs it was given."""

    def where(self) -> tuple[str, list[int], str]:
        import ray

        ctx = ray.get_runtime_context()
        gpus = [int(g) for g in ray.get_gpu_ids()]
        return ctx.get_node_id(), gpus, os.environ.get("CUDA_VISIBLE_DEVICES", "")

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """The Ray cluster (this test's own processes; stopped at the end) and each group's node id."""
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    node = {"node_ip_address": "127.0.0.2", "include_dashboard": False}
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, **node})
    try:
        nodes = {}
        for group, gpus in GROUP_GPUS.items():
            n = c.add_node(num_cpus=1, num_gpus=gpus, resources={f"rollpacker_{group}": 1000}, **node)
            nodes[group] = n.node_id
        c.add_node(num_cpus=1, resources={"rollpacker_sandbox": 1000}, **node)
        ray.init(address=c.address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
        nodes["address"] = c.address
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


_GROUPS: list[Any] = []  # the placement groups a test made (removed after it)


@pytest.fixture(autouse=True)
def _no_actors_left() -> Iterator[None]:
    yield
    import ray
    from ray.util.placement_group import remove_placement_group

    while _GROUPS:
        remove_placement_group(_GROUPS.pop())

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == NAMESPACE:
            ray.kill(ray.get_actor(a["name"], namespace=NAMESPACE), no_restart=True)


def _config(address: str, store: Path, **services: Any) -> str:
    data = {
        "experiment": "placement",
        "steps": 3,
        "arms": ["sync", "tail_batching"],
        "store": {"endpoint": f"file://{store}"},
        "services": {
            "ray_address": address,
            "namespace": NAMESPACE,
            "role_resources": True,
            "gpus": GROUP_GPUS,
            **services,
        },
        "planner": {"devices": 4, "max_tp": 4},
        "reward": {"judge": {"memory_budget_mb": 20000}},
        "train": {
            "backend": "megatron",
            "megatron": {
                "tp": 2,
                "world_size": 4,
                "gpus_per_rank": 1,
                "cpus_per_rank": 0.1,
                "resource": "rollpacker_training",
            },
        },
    }
    return yaml.safe_dump(data, sort_keys=False)


def _registry(text: str, arm: str) -> ServiceRegistry:
    return ServiceRegistry(RegistrySpec.of(text, config_from_text(text), arm, "ray"))


def _place_arm(text: str, arm: str) -> dict[str, list[tuple[str, list[int], str]]]:
    """The arm's rollout and judge actors with the registry's options, and its megatron ranks with
    the gang's bundles: where each landed and its GPUs."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    reg = _registry(text, arm)
    reg.check_placement()
    probe = ray.remote(_Probe)
    out: dict[str, list[tuple[str, list[int], str]]] = {}
    for role in ("rollout", "judge"):
        actor = probe.options(**reg.actor_options(role)).remote()
        out[role] = [ray.get(actor.where.remote(), timeout=120)]
    m = config_from_text(text).train.megatron
    pg = placement_group([rank_bundle(m) for _ in range(m.ranks)], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    ranks = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            num_cpus=m.cpus_per_rank,
            num_gpus=m.gpus_per_rank,
            name=f"placement.{arm}.rank{i}",
            namespace=NAMESPACE,
        ).remote()
        for i in range(m.ranks)
    ]
    out["gang"] = ray.get([r.where.remote() for r in ranks], timeout=120)
    _GROUPS.append(pg)
    return out


def test_two_disjoint_arms_get_gpus_of_their_own_on_their_groups(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    text = _config(cluster["address"], tmp_path / "store", arms="disjoint")
    placed = {arm: _place_arm(text, arm) for arm in ("sync", "tail_batching")}
    for role, group, each in (("rollout", "rollout", 4), ("judge", "judge", 1), ("gang", "training", 4)):
        got = {arm: [g for _, ids, _ in placed[arm][role] for g in ids] for arm in placed}
        assert all(len(ids) == each for ids in got.values()), (role, got)
        assert not set(got["sync"]) & set(got["tail_batching"]), (role, got)  # disjoint
        assert {node for arm in placed for node, _, _ in placed[arm][role]} == {cluster[group]}, role
    _node, ids, visible = placed["sync"]["rollout"][0]
    assert visible == ",".join(str(i) for i in ids)  # what the engines see


def test_arms_the_cluster_cannot_hold_are_refused_before_any_actor_starts(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    import ray

    text = _config(cluster["address"], tmp_path / "store", arms="disjoint")
    text = text.replace("world_size: 4", "world_size: 8")
    reg = _registry(text, "sync")
    with pytest.raises(PlacementError) as e:
        reg.rollout()  # the first lookup of a service creates its actor
    msg = str(e.value)
    assert "needs 16 GPUs together in the training worker group" in msg
    assert "it has 8 (Ray's alive nodes)" in msg and "services.arms: sequential" in msg
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE]


def test_sequential_releases_an_arms_services_only_once_it_has_committed_every_step(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    import ray

    store = tmp_path / "store"
    text = _config(cluster["address"], store, arms="sequential")
    text = text.replace("devices: 4\n  max_tp: 4", "devices: 8\n  max_tp: 8")
    first = _registry(text, "sync")
    first.check_placement()
    probe = ray.remote(_Probe)
    held = probe.options(**first.actor_options("rollout")).remote()
    assert len(ray.get(held.where.remote(), timeout=120)[1]) == 8  # every rollout GPU
    states = StateStore(open_store(config_from_text(text).store), "placement", "sync")

    def committed(step: int) -> None:
        states.store.put_json(states.pointer_key, {"step": step, "key": states.state_key(step)})

    committed(1)  # 2 of 3 steps
    second = _registry(text, "tail_batching")
    still = r"arm 'sync' .* still has its services \(rollout\) and has committed 2 of 3 steps"
    with pytest.raises(PlacementError, match=still):
        second.check_placement()
    assert ray.get(held.where.remote(), timeout=60)  # still up
    committed(2)  # done: its services go, and the next arm gets every GPU
    second.check_placement()
    with pytest.raises(ValueError):
        ray.get_actor(first.name("rollout"), namespace=NAMESPACE)
    nxt = probe.options(**second.actor_options("rollout")).remote()
    assert sorted(ray.get(nxt.where.remote(), timeout=120)[1]) == list(range(8))


def test_the_local_runner_refuses_an_arm_the_ray_cluster_cannot_hold_before_any_step(
    cluster: dict[str, str], tmp_path: Path
) -> None:
    from rollpacker.experiment import preflight

    text = _config(cluster["address"], tmp_path / "store", arms="disjoint")
    data = yaml.safe_load(text)
    data["tracking_uri"] = f"sqlite:///{tmp_path / 'mlflow.db'}"
    data["train"]["megatron"]["world_size"] = 8  # two such arms do not fit at once, one at a time does
    preflight(config_from_text(yaml.safe_dump(data)), "kfp", ["sync", "tail_batching"])
    data["train"]["megatron"]["world_size"] = 16
    with pytest.raises(PlacementError, match="needs 16 GPUs for the largest arm in the training worker"):
        preflight(config_from_text(yaml.safe_dump(data)), "kfp", ["sync"])
