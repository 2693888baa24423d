from __future__ import annotations

import pytest

from rollpacker.core.config import EngineConfig, PolicyName, RolloutConfig, from_mapping, speculative_count
from rollpacker.core.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompts_per_step": 0}, "prompts_per_step"),
        ({"responses_per_prompt": -1}, "responses_per_prompt"),
        ({"eta_p": 0.9}, "eta_p"),
        ({"eta_r": 0.5}, "eta_r"),
        ({"eta_r": float("nan")}, "eta_r"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_impossible_rollout_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        RolloutConfig(**kwargs)


def test_engine_config_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="int3")


def test_speculative_counts_are_ceilings() -> None:
    assert speculative_count(1.25, 16) == 20
    assert speculative_count(1.25, 4) == 5
    assert speculative_count(1.25, 3) == 4
    assert speculative_count(1.0, 7) == 7
    cfg = RolloutConfig(prompts_per_step=16, responses_per_prompt=4)
    assert (cfg.launched_prompts, cfg.launched_responses) == (20, 5)


def test_from_mapping_rejects_unknown_keys_by_name() -> None:
    with pytest.raises(ConfigError, match="'prompts_per_stepp'"):
        from_mapping(RolloutConfig, {"prompts_per_stepp": 3})


def test_from_mapping_converts_enums_and_checks_types() -> None:
    cfg = from_mapping(RolloutConfig, {"policy": "sync", "eta_p": 1, "prompts_per_step": 8})
    assert cfg.policy is PolicyName.SYNC and cfg.eta_p == 1.0 and cfg.prompts_per_step == 8
    with pytest.raises(ConfigError, match="policy"):
        from_mapping(RolloutConfig, {"policy": "fastest"})
    with pytest.raises(ConfigError, match="prompts_per_step"):
        from_mapping(RolloutConfig, {"prompts_per_step": "many"})


def test_experiment_config_rejects_unknown_nested_keys_by_name():
    from rollpacker.core.config import ExperimentConfig

    with pytest.raises(ConfigError, match=r"'train\.lr_rate'"):
        from_mapping(ExperimentConfig, {"train": {"lr_rate": 1e-3}})
    cfg = from_mapping(ExperimentConfig, {"rollout": {"policy": "sync"}, "train": {"loss_norm": "seq_mean"}})
    assert cfg.rollout.policy.value == "sync" and cfg.train.loss_norm == "seq_mean"


def test_stream_trainer_needs_one_mini_batch():
    from rollpacker.core.config import TrainerConfig

    with pytest.raises(ConfigError, match="one deferred optimizer step"):
        TrainerConfig(stream=True, mini_batches=2)
    assert TrainerConfig(stream=False, mini_batches=2).mini_batches == 2
    with pytest.raises(ConfigError, match="loss_norm"):
        TrainerConfig(loss_norm="sum")


def test_arms_are_policy_names_or_variants_and_errors_name_the_arm() -> None:
    from rollpacker.core.config import ArmConfig, ExperimentConfig, PolicyName, SortedMode, from_mapping

    cfg = from_mapping(
        ExperimentConfig,
        {
            "arms": [
                "sync",
                {"name": "sorted_partial", "policy": "sorted", "mode": "partial"},
                {"name": "tb-one-off", "policy": "tail_batching", "one_off": True},
            ]
        },
    )
    assert cfg.arms[0] == ArmConfig("sync", PolicyName.SYNC)
    assert cfg.for_arm("sorted_partial").rollout.sorted.mode is SortedMode.PARTIAL
    assert cfg.for_arm("sorted_partial").rollout.policy is PolicyName.SORTED
    assert cfg.for_arm("tb-one-off").rollout.one_off and not cfg.for_arm("sync").rollout.one_off
    bad = [
        (["sortd"], "an arm is a policy name"),
        ([{"name": "x", "policy": "sync", "mode": "partial"}], "only the sorted policy has modes"),
        (["sync", {"name": "sync", "policy": "sorted"}], "distinct name"),
        ([{"name": "Bad Name", "policy": "sync"}], "lowercase"),
        ([{"name": "x", "policy": "sorted", "mode": "offpolicy"}], "on_policy"),
        ([{"name": "x", "policy": "sorted", "group": 2}], "unknown config key"),
    ]
    for arms, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            from_mapping(ExperimentConfig, {"arms": arms})
    with pytest.raises(ConfigError, match="not in this config's arms"):
        cfg.for_arm("partial")


def test_policy_sub_configs_are_validated() -> None:
    from rollpacker.core.config import RolloutConfig, TrainerConfig, from_mapping

    with pytest.raises(ConfigError, match=r"rollout\.sorted\.group_size"):
        from_mapping(RolloutConfig, {"sorted": {"group_size": 0}}, "rollout.")
    with pytest.raises(ConfigError, match=r"rollout\.partial\.max_staleness"):
        from_mapping(RolloutConfig, {"partial": {"max_staleness": -1}}, "rollout.")
    with pytest.raises(ConfigError, match=r"train\.objective"):
        from_mapping(TrainerConfig, {"objective": "grpo"})


def test_checkpoint_cadence_every_nth_step_and_the_last() -> None:
    from rollpacker.core.config import CheckpointConfig, config_from_text

    assert config_from_text("{}").checkpoint == CheckpointConfig(every=1, export_every=0)
    two = CheckpointConfig(every=2, export_every=3)
    assert [s for s in range(7) if two.due(s, 7)] == [1, 3, 5, 6]  # and the last step
    assert [s for s in range(7) if two.export_due(s)] == [2, 5]
    assert not any(CheckpointConfig().export_due(s) for s in range(10))
    for text, match in (
        ("checkpoint: {every: 0}", "checkpoint.every = 0: must be a positive integer"),
        ("checkpoint: {export_every: -1}", "checkpoint.export_every = -1"),
        ("checkpoint: {evry: 2}", "unknown config key.*checkpoint.evry"),
    ):
        with pytest.raises(ConfigError, match=match):
            config_from_text(text)


def test_dynamic_sampling_without_arms_names_the_default_arm_list() -> None:
    """The user set no policy: the error names the default arm list as the cause and what to set."""
    from rollpacker.core.config import ExperimentConfig

    with pytest.raises(ConfigError) as e:
        from_mapping(ExperimentConfig, {"rollout": {"dynamic_sampling": {"enabled": True}}})
    msg = str(e.value)
    assert "the config names no arms, so the default arm list (sync, tail_batching) runs" in msg
    assert "its arm 'sync' sets rollout.policy = 'sync'" in msg and "`arms: [tail_batching]`" in msg
    with pytest.raises(ConfigError, match=r"arm 'partial' sets rollout\.policy = 'partial'") as named:
        from_mapping(
            ExperimentConfig,
            {"rollout": {"dynamic_sampling": {"enabled": True}}, "arms": ["tail_batching", "partial"]},
        )
    assert "default arm list" not in str(named.value)
    cfg = from_mapping(
        ExperimentConfig, {"rollout": {"dynamic_sampling": {"enabled": True}}, "arms": ["tail_batching"]}
    )
    assert cfg.for_arm("tail_batching").rollout.dynamic_sampling.enabled


def test_constant_loss_norm_budget_defaults_to_max_tokens() -> None:
    """Dr. GRPO's constant normaliser divides by ``L * N``; ``L`` is ``rollout.max_tokens`` unless set."""
    from rollpacker.core.config import ExperimentConfig, TrainerConfig

    cfg = from_mapping(ExperimentConfig, {"rollout": {"max_tokens": 300}, "train": {"loss_norm": "constant"}})
    assert cfg.train.loss_budget_tokens == 0
    assert cfg.for_arm("sync").train.loss_budget_tokens == 300
    own = {"rollout": {"max_tokens": 300}, "train": {"loss_norm": "constant", "loss_budget_tokens": 512}}
    assert from_mapping(ExperimentConfig, own).for_arm("sync").train.loss_budget_tokens == 512
    short = {"rollout": {"max_tokens": 300}, "train": {"loss_budget_tokens": 200}}
    with pytest.raises(ConfigError, match=r"train\.loss_budget_tokens = 200: .* rollout\.max_tokens = 300"):
        from_mapping(ExperimentConfig, short)
    with pytest.raises(ConfigError, match="token_mean, seq_mean, constant"):
        TrainerConfig(loss_norm="sum")
    with pytest.raises(ConfigError, match="loss_budget_tokens"):
        TrainerConfig(loss_budget_tokens=-1)
