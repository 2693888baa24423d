"""The peers a rollout service's round talks to, recorded (the outer edge of the service tests)."""

from __future__ import annotations

from typing import Any


class RewardRecorder:
    def __init__(self) -> None:
        self.groups: list[str] = []

    def score(self, *args: Any) -> None:
        pass

    def group(self, attempt: str, group: Any, texts: Any) -> None:
        self.groups.append(group.prompt.prompt_id)


class TrainerRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def repurpose(self, attempt: str, devices: tuple[str, ...]) -> Any:
        self.calls.append((attempt, devices))


class RoundPeers:
    """Every reward role is one recorder; the trainer records the devices lent to it."""

    def __init__(self) -> None:
        self.rewards = RewardRecorder()
        self.train = TrainerRecorder()

    def reward(self, role: str) -> RewardRecorder:
        return self.rewards

    def trainer(self) -> TrainerRecorder:
        return self.train

    def cast_failure(self, attempt: str) -> str | None:
        return None

    def refresh(self) -> None:
        pass

    def rollout(self) -> Any:
        raise AssertionError("the round does not call the rollout service")
