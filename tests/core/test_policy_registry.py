"""The rollout policies by name (rollpacker.core.policies.registry)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import PolicyName, RolloutConfig
from rollpacker.core.errors import ConfigError, PolicyError
from rollpacker.core.policies.registry import POLICIES, PolicyInputs, build_policy, cursor_window
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.types import Prompt, SamplingSpec


def _inputs(policy: PolicyName) -> PolicyInputs:
    prompts = [Prompt(f"p{i}", (1, 2, 3), i) for i in range(40)]
    r = RolloutConfig(policy=policy, prompts_per_step=4, responses_per_prompt=2)
    spec = SamplingSpec(max_tokens=8)
    return PolicyInputs(
        rollout=r,
        cursor=PromptCursor(prompts, seed=0, window=cursor_window(r, 8)),
        sampling=lambda _p, _j: spec,
        prompts={p.prompt_id: p for p in prompts},
        in_flight=8,
    )


@pytest.mark.parametrize("name", [p for p in PolicyName])
def test_every_policy_name_builds_a_policy_of_that_name(name: PolicyName) -> None:
    policy = build_policy(name.value, _inputs(name))
    assert policy.name == name.value
    assert policy.plan_step(0).target_prompts == 4


def test_an_unknown_policy_lists_the_known_ones() -> None:
    with pytest.raises(
        ConfigError, match=r"'nope': unknown policy; known: partial, sorted, sync, tail_batching"
    ):
        build_policy("nope", _inputs(PolicyName.SYNC))
    assert set(POLICIES) == {p.value for p in PolicyName}


def test_a_queue_naming_an_unknown_prompt_is_refused() -> None:
    import dataclasses

    x = dataclasses.replace(_inputs(PolicyName.TAIL_BATCHING), long_queue=("p1", "ghost"))
    with pytest.raises(PolicyError, match=r"long_queue holds prompts \['ghost'\].*--fresh"):
        build_policy("tail_batching", x)
