"""The rollout policies by name: ``build_policy(name, inputs)``; an unknown name lists the known.

Each policy is one short module beside this one; a new policy registers its builder in
``POLICIES``. A builder takes the same ``PolicyInputs`` (what the committed state and the task
give a step) and uses what it needs.

Invariants (tests/core/test_policy_registry.py):
- every ``PolicyName`` has a builder, and the policy it builds reports that name;
- a policy is rebuilt from the committed state at every step: nothing cross-step lives in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rollpacker.core.config import PolicyName, RolloutConfig
from rollpacker.core.errors import ConfigError, PolicyError
from rollpacker.core.policies.base import RolloutPolicy, SamplingFactory
from rollpacker.core.policies.entries import BufferEntry, buffer_from_state
from rollpacker.core.policies.partial import PartialPolicy
from rollpacker.core.policies.sorted import SortedPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import LongPromptQueue, PromptCursor
from rollpacker.core.types import Prompt


@dataclass(frozen=True)
class PolicyInputs:
    """What a step's policy is built from."""

    rollout: RolloutConfig
    cursor: PromptCursor
    sampling: SamplingFactory
    prompts: Mapping[str, Prompt]  # the training prompts by id
    long_queue: Sequence[str] = ()  # tail batching's queue (prompt ids, FIFO)
    buffer: Sequence[BufferEntry] = ()  # SortedRL's / partial rollout's buffer
    policy_version: int = 0
    in_flight: int = 1  # partial rollout: requests kept running
    namespace: str = ""  # request-id prefix (arm and attempt)


def _sync(x: PolicyInputs) -> RolloutPolicy:
    return SyncPolicy(x.rollout, x.cursor, x.sampling, namespace=x.namespace)


def _tail_batching(x: PolicyInputs) -> RolloutPolicy:
    missing = [i for i in x.long_queue if i not in x.prompts]
    if missing:
        raise PolicyError(
            f"long_queue holds prompts {missing[:3]} that the task does not have: the state was "
            "written for another dataset; start the arm over (--fresh)"
        )
    queue = LongPromptQueue(x.prompts[i] for i in x.long_queue)
    return TailBatchingPolicy(x.rollout, x.cursor, x.sampling, queue=queue, namespace=x.namespace)


def _sorted(x: PolicyInputs) -> RolloutPolicy:
    buffer = buffer_from_state(x.buffer, x.prompts.__contains__)
    return SortedPolicy(
        x.rollout, x.cursor, x.sampling, dict(x.prompts), buffer=buffer, namespace=x.namespace
    )


def _partial(x: PolicyInputs) -> RolloutPolicy:
    return PartialPolicy(
        x.rollout,
        x.cursor,
        x.sampling,
        dict(x.prompts),
        in_flight=x.in_flight,
        buffer=buffer_from_state(x.buffer, x.prompts.__contains__),
        policy_version=x.policy_version,
        namespace=x.namespace,
    )


POLICIES: dict[str, Callable[[PolicyInputs], RolloutPolicy]] = {
    PolicyName.SYNC.value: _sync,
    PolicyName.TAIL_BATCHING.value: _tail_batching,
    PolicyName.SORTED.value: _sorted,
    PolicyName.PARTIAL.value: _partial,
}


def build_policy(name: str, inputs: PolicyInputs) -> RolloutPolicy:
    """The policy ``name`` for one step; an unknown name is refused with the known ones."""
    builder = POLICIES.get(name)
    if builder is None:
        raise ConfigError(f"rollout.policy = {name!r}: unknown policy; known: {', '.join(sorted(POLICIES))}")
    return builder(inputs)


def cursor_window(rollout: RolloutConfig, in_flight: int) -> int:
    """How many prompts ahead the policy's cursor may look in one step (its launch window)."""
    if rollout.policy is PolicyName.SORTED:
        return rollout.sorted.group_size * rollout.prompts_per_step
    if rollout.policy is PolicyName.PARTIAL:
        return rollout.prompts_per_step + in_flight
    return rollout.launched_prompts
