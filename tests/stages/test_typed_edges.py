"""Role, round kind, services mode and runner are enums at every edge: the messages carry them,
round-trip them, and refuse a bad value naming the field; the functions that take them from text
(an option, an environment variable, a state document) refuse a bad one naming it too."""

from __future__ import annotations

import json

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.prompts import CursorState
from rollpacker.core.serde import MessageError
from rollpacker.core.state import ControllerState, StateError, TPPlan
from rollpacker.core.types import Role, RoundKind, Runner, ServicesMode, parse_enum
from rollpacker.services import api
from rollpacker.stages.messages import (
    CommitOutput,
    CommitRecord,
    GroupsLog,
    LengthsLog,
    RolloutOutput,
    Timing,
)


def _report(kind: RoundKind = RoundKind.LONG) -> api.RoundReport:
    return api.RoundReport(
        step=1,
        attempt="a",
        round_kind=kind,
        trained=("p1",),
        deferred=(),
        from_queue=("p1",),
        groups_by_role={Role.REWARD: ("p1",), Role.JUDGE: ()},
        lengths=(3,),
        longest=(("p1", 3),),
        next_cursor=CursorState(0, 0, 1),
        next_queue=(),
        next_buffer_uri="",
        metrics={},
        preemptions=4,
        decode_drift=0.5,
    )


def _rollout(rewards: dict[Role, api.RewardBegin]) -> RolloutOutput:
    update = api.Pending("trainer", "update", "a1", "TrainReport", 1.0)
    return RolloutOutput(
        _report(), api.TrainerBegin(0.2, True, 0), rewards, Timing(1, 2, 3), Timing(1, 2, 3), update
    )


def test_enums_round_trip_as_their_values_and_come_back_as_members() -> None:
    ro = _rollout({Role.JUDGE: api.RewardBegin(0.1, ("judge",))})
    doc = json.loads(ro.to_json())
    assert doc["round"]["round_kind"] == "long" and set(doc["round"]["groups_by_role"]) == {"reward", "judge"}
    assert set(doc["rewards"]) == {"judge"}
    back = RolloutOutput.from_json(ro.to_json())
    assert back == ro
    assert back.round is not None and back.round.round_kind is RoundKind.LONG
    assert all(isinstance(k, Role) for k in back.round.groups_by_role) and list(back.rewards) == [Role.JUDGE]
    for msg in (
        CommitRecord(1, "a", "s3://b/s", RoundKind.SHORT, {"x": 1.0}),
        GroupsLog(1, "a", RoundKind.PARTIAL, ("p",), (), ()),
        LengthsLog(RoundKind.SORTED, (1, 2)),
        CommitOutput(1, "a", False, "s3://b/s", RoundKind.STANDARD),
        CommitOutput(1, "a", True),
    ):
        again = type(msg).from_json(msg.to_json())
        assert again == msg and type(again.round_kind) is type(msg.round_kind)


def test_a_bad_enum_value_is_refused_naming_the_field() -> None:
    doc = json.loads(_rollout({}).to_json())
    doc["round"]["round_kind"] = "medium"
    with pytest.raises(MessageError, match=r"RolloutOutput\.round\.round_kind: 'medium' is not one of"):
        RolloutOutput.from_json(json.dumps(doc))
    doc = json.loads(_rollout({}).to_json())
    doc["round"]["groups_by_role"]["sandbox"] = []
    with pytest.raises(
        MessageError, match=r"RolloutOutput\.round\.groups_by_role key: 'sandbox' is not one of"
    ):
        RolloutOutput.from_json(json.dumps(doc))
    bad = json.loads(api.DrainReport(Role.REWARD, 0.1, 1).to_json()) | {"role": "rewards"}
    with pytest.raises(
        MessageError, match=r"DrainReport\.role: 'rewards' is not one of \['rollout', 'reward'"
    ):
        api.DrainReport.from_json(json.dumps(bad))


def test_text_edges_parse_to_enums_or_name_the_bad_value() -> None:
    assert parse_enum(Runner, "inline", "--runner") is Runner.INLINE
    assert parse_enum(ServicesMode, ServicesMode.RAY, "x") is ServicesMode.RAY
    assert Runner.KFP.services_mode is ServicesMode.RAY and Runner.INLINE.services_mode is ServicesMode.INLINE
    with pytest.raises(ConfigError, match=r"--runner = 'kubeflow': not one of 'kfp', 'inline'"):
        parse_enum(Runner, "kubeflow", "--runner")
    assert [r for r in Role if r.is_reward] == [Role.REWARD, Role.JUDGE]


def test_the_services_mode_and_reward_role_are_checked_where_they_enter() -> None:
    from rollpacker.services.base import ServiceError
    from rollpacker.services.registry import RegistrySpec, ServiceRegistry

    spec = RegistrySpec("experiment: x\n", "x", "sync", mode="inline")  # type: ignore[arg-type]
    assert spec.mode is ServicesMode.INLINE  # from text ($ROLLPACKER_SERVICES): the member
    with pytest.raises(ConfigError, match=r"services mode = 'local': not one of 'ray', 'inline'"):
        RegistrySpec("experiment: x\n", "x", "sync", mode="local")  # type: ignore[arg-type]
    reg = ServiceRegistry(spec)
    with pytest.raises(
        ServiceError, match=r"reward service role <Role\.TRAINER: 'trainer'>: use Role\.REWARD"
    ):
        reg.reward(Role.TRAINER)


def test_the_state_keeps_round_kinds_as_members_and_refuses_an_unknown_one() -> None:
    s = ControllerState("e", "a", 0, 1, 0, 0, tp_plan=TPPlan(1, 2, (0, 3), (RoundKind.SHORT, RoundKind.LONG)))
    back = ControllerState.from_json(s.to_json())
    assert back == s and all(type(k) is RoundKind for k in back.tp_plan.round_kinds)
    doc = json.loads(s.to_json())
    doc["tp_plan"]["round_kinds"] = ["short", "tall"]
    with pytest.raises(
        StateError, match=r"'tp_plan\.round_kinds\[1\]' = 'tall': not one of 'standard', 'short'"
    ):
        ControllerState.from_json(json.dumps(doc))


def test_the_runner_option_refuses_an_unknown_runner_before_anything_runs(tmp_path) -> None:
    from rollpacker.experiment import run_experiment

    with pytest.raises(ConfigError, match=r"--runner = 'local': not one of 'kfp', 'inline'"):
        run_experiment(tmp_path / "none.yaml", runner="local")  # type: ignore[arg-type]
