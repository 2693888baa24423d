"""The typed edges: stage messages round-trip and refuse bad fields by path; every service Protocol
method has a proxy and an implementation with the same signature."""

from __future__ import annotations

import dataclasses
import inspect
import json
import pickle
import threading
import time
import typing

import pytest

from rollpacker.core.prompts import CursorState
from rollpacker.core.serde import MessageError, from_data
from rollpacker.services import api
from rollpacker.services.base import Service, ServiceError
from rollpacker.services.registry import RewardProxy, RolloutProxy, TrackingProxy, TrainerProxy
from rollpacker.services.reward import RewardService
from rollpacker.services.rollout import RolloutService
from rollpacker.services.tracking import TrackingService
from rollpacker.services.trainer import TrainerService
from rollpacker.stages.messages import ArmDone, PlanOutput, RolloutOutput, RoundStart, Timing, TrainOutput


def _rollout() -> RolloutOutput:
    report = api.RoundReport(
        step=3,
        attempt="abc",
        round_kind="short",
        trained=("p1", "p2"),
        deferred=("p3",),
        from_queue=(),
        groups_by_role={"reward": ("p1", "p2"), "judge": ()},
        lengths=(5, 7, 9, 11),
        longest=(("p1", 7), ("p2", 11)),
        next_cursor=CursorState(0, 1, 12),
        next_queue=("p3",),
        next_buffer_uri="",
        metrics={"rollout/time_s": 1.5, "rollout/preemptions": 0.0},
        preemptions=0,
        decode_drift=0.0,
        end_wall=1.0e9,
    )
    begin = api.RewardBegin(0.1, ("math", "code"))
    update = api.Pending[api.TrainReport]("trainer", "update", "abc", "TrainReport", 1.0e9)
    span = Timing(1.0, 1.0e9 - 1.0, 1.0e9)
    return RolloutOutput(
        report, api.TrainerBegin(0.2, True, 0), {"reward": begin}, Timing(2.0, 1.0, 3.0), span, update
    )


def test_stage_messages_round_trip() -> None:
    ro = _rollout()
    assert RolloutOutput.from_json(ro.to_json()) == ro
    report = api.TrainReport("s3://b/ck/", 4, 8, "", {"train/loss": 0.5})
    tr = TrainOutput(report, None, 0.0, Timing(1, 2, 3), Timing(1, 1, 2))
    assert TrainOutput.from_json(tr.to_json()) == tr
    sync = api.EngineSync(True, False, 1.5, 0)
    round_plan = api.RoundPlan("short", ("p1", "p2"), (), 2, ("reward",))
    plan = PlanOutput("e", "a", 0, -1, "x", "s3://b/base/", "run", Timing(0.1, 1.0, 1.1), sync, round_plan)
    assert PlanOutput.from_json(plan.to_json()) == plan
    ticket = api.Pending[api.RoundReport]("rollout", "round", "x", "RoundReport", 1.0e9)
    started = RoundStart(api.TrainerBegin(0.2, True, 0), {"reward": api.RewardBegin(0.1, ("math",))}, ticket)
    plan = dataclasses.replace(plan, started=started)
    assert PlanOutput.from_json(plan.to_json()) == plan
    done = ArmDone("e", "a", 4, 3, "y", "run", Timing(0.1, 1.0, 1.1))
    assert ArmDone.from_json(done.to_json()) == done


def test_no_stage_message_carries_a_report_that_exists_only_when_the_step_runs() -> None:
    # the DAG gates on plan.skip: a later stage always has its inputs' reports
    for msg, name in (
        (PlanOutput, "sync"),
        (PlanOutput, "round"),
        (RolloutOutput, "round"),
        (RolloutOutput, "trainer"),
        (RolloutOutput, "update"),
        (TrainOutput, "report"),
    ):
        assert type(None) not in typing.get_args(typing.get_type_hints(msg)[name]), (msg, name)
    assert not hasattr(PlanOutput, "skip")
    with pytest.raises(MessageError, match="PlanOutput: missing field 'base_uri'"):  # ArmDone is no plan
        PlanOutput.from_json(ArmDone("e", "a", 4, 3, "y", "run", Timing(0.1, 1.0, 1.1)).to_json())


def test_a_renamed_field_fails_at_the_edge_with_its_path() -> None:
    doc = json.loads(_rollout().to_json())
    doc["round"]["next_cursor"]["pos"] = doc["round"]["next_cursor"].pop("position")
    with pytest.raises(
        MessageError, match=r"RolloutOutput\.round\.next_cursor: unknown field\(s\) \['pos'\]"
    ):
        RolloutOutput.from_json(json.dumps(doc))
    doc = json.loads(_rollout().to_json())
    doc["round"]["metrics"]["rollout/time_s"] = "fast"
    with pytest.raises(
        MessageError, match=r"RolloutOutput\.round\.metrics\['rollout/time_s'\]: expected float"
    ):
        RolloutOutput.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("protocol", "proxy", "service"),
    [
        (api.RolloutAPI, RolloutProxy, RolloutService),
        (api.RewardAPI, RewardProxy, RewardService),
        (api.TrainerAPI, TrainerProxy, TrainerService),
        (api.TrackingAPI, TrackingProxy, TrackingService),
    ],
)
def test_every_protocol_method_has_a_proxy_and_an_implementation(protocol, proxy, service) -> None:
    methods = [n for n, f in vars(protocol).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert methods
    for name in methods:
        want = _params(getattr(protocol, name))
        assert name in vars(proxy), f"{proxy.__name__} lacks {name}"
        assert _params(getattr(proxy, name)) == want, (proxy, name)
        assert _params(getattr(service, name)) == want, (service, name)


def _params(fn) -> list[str]:
    # ray.remote(cls) adds a `_ray_trace_ctx` keyword to the class's methods in place
    return [p for p in inspect.signature(fn).parameters if not p.startswith("_ray_")]


def test_the_begun_work_is_on_the_protocols_with_typed_tickets() -> None:
    hints = typing.get_type_hints
    assert hints(api.RolloutAPI.begin_round)["return"] == api.Pending[api.RoundReport]
    assert hints(api.RolloutAPI.collect)["return"] == api.Collected[api.RoundReport]
    assert hints(api.TrainerAPI.begin_update)["return"] == api.Pending[api.TrainReport]
    assert hints(api.TrainerAPI.collect)["ticket"] == api.Pending[api.TrainReport]
    # nothing is started or collected by a method's name, and no result comes back untyped
    assert not hasattr(api.ServiceAPI, "start") and not hasattr(api.ServiceAPI, "collect")
    assert hints(api.Collected)["value"] is api.R


class _Slow(Service):
    """A service whose work waits for a signal (or fails), to test begin/collect."""

    go = threading.Event()

    def begin(self, run_id: str) -> api.Pending[api.RewardBegin]:
        return self._run_ahead("probe", run_id, api.RewardBegin, lambda: self._work(run_id))

    def _work(self, run_id: str) -> api.RewardBegin:
        self.go.wait(5)
        if run_id == "bad":
            raise ValueError("no such run")
        return api.RewardBegin(1.5, (run_id,))


def test_a_begun_call_runs_ahead_and_is_collected_once_with_its_span() -> None:
    svc = _Slow("experiment: x\n", "sync", "rollout")
    _Slow.go.clear()
    t0 = time.time()
    ticket = svc.begin("r1")
    assert svc.begin("r1") == ticket  # beginning it again returns the first ticket, runs nothing
    assert time.time() - t0 < 1.0  # begin does not wait for the call
    assert api.Pending.from_json(ticket.to_json()) == ticket  # the ticket crosses a KFP edge...
    assert pickle.loads(pickle.dumps(ticket)) == ticket  # ...and a Ray call
    _Slow.go.set()
    got = svc.collect(ticket)
    assert got.value == api.RewardBegin(1.5, ("r1",)) and t0 <= got.start_wall <= got.end_wall
    assert from_data(api.Collected[api.RewardBegin], json.loads(got.to_json())) == got  # a message too
    with pytest.raises(ServiceError, match="no probe of attempt r1 was begun here"):
        svc.collect(ticket)
    with pytest.raises(ServiceError, match="begun on the trainer service"):
        svc.collect(dataclasses.replace(ticket, service="trainer"))
    with pytest.raises(ValueError, match="no such run"):  # the call's own error, at the collector
        svc.collect(svc.begin("bad"))
    liar = _Slow("experiment: x\n", "sync", "rollout")
    wrong = liar._run_ahead("probe", "w", api.TrainReport, lambda: api.RewardBegin(0.0, ()))  # type: ignore[arg-type]
    with pytest.raises(ServiceError, match="returned a RewardBegin, its ticket promised a TrainReport"):
        liar.collect(wrong)
    for i in range(svc.MAX_STARTED + 3):  # uncollected calls are bounded
        svc.begin(f"x{i}")
    assert len(svc._started) == svc.MAX_STARTED


def test_busy_seconds_is_the_union_of_spans() -> None:
    from rollpacker.stages.commit import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == pytest.approx(4.0)
    assert busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == pytest.approx(10.0)  # nested: counted once
    assert busy_seconds([(4.0, 5.0), (0.0, 1.0)]) == pytest.approx(2.0)
