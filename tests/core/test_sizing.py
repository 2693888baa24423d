"""core/sizing.py's invariants (module docstring)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import load_config
from rollpacker.core.errors import ConfigError
from rollpacker.core.sizing import (
    SHIPPED,
    CheckpointPlan,
    ModelSize,
    Volumes,
    check,
    checkpoint_bytes,
    kept_copy_bytes,
    layouts_at_once,
    parse_quantity,
    required,
    shm_refusal,
)

SEVEN = SHIPPED[0]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("20Gi", 20 * 2**30),
        ("1.5Ti", 3 * 2**39),
        ("500G", 500 * 10**9),
        ("1e9", 10**9),
        (64, 64),
        ("100Mi", 100 * 2**20),
    ],
)
def test_parse_quantity_reads_kubernetes_quantities_exactly(text: str, want: int) -> None:
    assert parse_quantity(text) == want


@pytest.mark.parametrize("text", ["20GB", "-1Gi", "Gi", "20 gi", ""])
def test_parse_quantity_refuses_anything_else(text: str) -> None:
    with pytest.raises(ConfigError, match="not a Kubernetes storage quantity"):
        parse_quantity(text)


def test_a_checkpoint_is_16_bytes_per_parameter() -> None:
    assert checkpoint_bytes(ModelSize("m", 10**9)) == 16 * 10**9


def test_required_grows_with_parameters_keep_and_arms() -> None:
    base = required(SEVEN, CheckpointPlan(arms=1, keep=1))
    for bigger in (
        required(SHIPPED[1], CheckpointPlan(1, 1)),
        required(SEVEN, CheckpointPlan(1, 2)),
        required(SEVEN, CheckpointPlan(2, 1)),
    ):
        assert bigger.store > base.store
    assert required(SHIPPED[2], CheckpointPlan(1, 1)).training_scratch > base.training_scratch
    ck = checkpoint_bytes(SEVEN)
    assert min(base.store, base.training_scratch, base.rollout_scratch) > ck
    assert (
        required(SEVEN, CheckpointPlan(1, 1, staged=False)).training_scratch
        == base.training_scratch - ck * 11 // 10
    )


def test_check_names_each_small_volume_and_passes_big_ones() -> None:
    need = required(SEVEN, CheckpointPlan(2, 2))
    fits = Volumes((need.store, "s"), (need.training_scratch, "t"), (need.rollout_scratch, "r"))
    assert check(SEVEN, CheckpointPlan(2, 2), fits) == []
    short = Volumes(
        (need.store - 1, "MinIO"), (need.training_scratch, "t"), (need.rollout_scratch - 1, "rollout /tmp")
    )
    found = check(SEVEN, CheckpointPlan(2, 2), short)
    assert [f.split(" is ")[0] for f in found] == ["Qwen2.5-7B: MinIO", "Qwen2.5-7B: rollout /tmp"]
    assert all("set it to at least" in f for f in found)


@pytest.mark.parametrize(("arms", "keep"), [(0, 1), (1, 0), (True, 1)])
def test_layout_refuses_non_positive_counts(arms: int, keep: int) -> None:
    with pytest.raises(ConfigError, match="must be a positive integer"):
        CheckpointPlan(arms=arms, keep=keep)


# --- the collective push's kept copy against the rollout pods' /dev/shm ------------------------------


def test_the_kept_copy_is_the_model_in_the_push_dtype() -> None:
    assert kept_copy_bytes(SEVEN.params, "bfloat16") == 15_231_233_024  # the 15.2 GB of a 7B copy
    assert kept_copy_bytes(SEVEN.params, "float32") == 2 * kept_copy_bytes(SEVEN.params, "float16")
    with pytest.raises(ConfigError, match=r"engine\.dtype = 'int8'"):
        kept_copy_bytes(SEVEN.params, "int8")


def test_a_shm_too_small_for_the_kept_copy_is_refused_naming_the_model_the_shm_and_the_fixes() -> None:
    """The cluster config: 3 layouts (tp 1, 2, 4 of 8 GPUs), one started at a time at 0.9."""
    assert layouts_at_once(load_config("cluster")) == (3, 1)
    why = shm_refusal(load_config("cluster", {"services.rollout_shm_gib": 15}), SEVEN.params, SEVEN.name)
    assert why.startswith(
        "Qwen2.5-7B: the rollout pods' /dev/shm (services.rollout_shm_gib = 15) is 15 GiB, needs 16 GiB "
        "for the copy the collective push keeps"
    ), why
    for fix in ("larger dshm volume", "services.rollout_shm_gib >= 16", "fewer layouts", "planner.devices"):
        assert fix in why, fix
    assert (
        shm_refusal(load_config("cluster", {"services.rollout_shm_gib": 16}), SEVEN.params, SEVEN.name) == ""
    )


@pytest.mark.parametrize(
    "over",
    [
        {"services.rollout_shm_gib": 0},  # not declared (one machine)
        {"train.weight_sync": "object_store"},  # no copy kept
        {"engine.gpu_memory_utilization": 0.3},  # floor(1 / 0.3) = 3 layouts stay started
        {"planner.min_tp": 4, "planner.initial_tp": 4},  # one layout
        {"planner.devices": 0, "engine.tensor_parallel_size": 1},  # one engine, no layouts
        {"engine.device": "cpu"},  # every layout stays started
    ],
)
def test_no_refusal_where_no_copy_is_kept(over: dict[str, object]) -> None:
    cfg = load_config("cluster", {"services.rollout_shm_gib": 1, **over})
    assert shm_refusal(cfg, SEVEN.params, SEVEN.name) == ""
    assert shm_refusal(load_config("cluster", {"services.rollout_shm_gib": 1}), SEVEN.params, SEVEN.name)
