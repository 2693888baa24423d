"""The state after a step (stages.successor) from the stages' reports, on a real filesystem store."""

from __future__ import annotations

from rollpacker.core.config import config_from_text
from rollpacker.core.policies.entries import BufferEntry, buffer_to_json
from rollpacker.core.prompts import CursorState
from rollpacker.core.state import ControllerState
from rollpacker.core.types import Role, RoundKind
from rollpacker.services.api import DrainReport, RoundReport, TrainReport
from rollpacker.stages.context import StageContext
from rollpacker.stages.successor import step_metrics, successor
from rollpacker.store.local import FileStore
from rollpacker.store.state_store import StateStore


def _ctx(tmp_path) -> StageContext:
    text = f'experiment: e\narms: [tail_batching]\nstore: {{endpoint: "file://{tmp_path}"}}\n'
    cfg = config_from_text(text).for_arm("tail_batching")
    store = FileStore(tmp_path)
    return StageContext(text, "tail_batching", cfg, store, StateStore(store, "e", "tail_batching"), None)  # type: ignore[arg-type]


def _round(buffer_uri: str = "", drift: float = 0.0) -> RoundReport:
    return RoundReport(
        step=0,
        attempt="a",
        round_kind=RoundKind.SHORT,
        trained=("p1", "p2"),
        deferred=("p3",),
        from_queue=(),
        groups_by_role={Role.REWARD: ("p1", "p2")},
        lengths=(4, 9, 5, 6),
        longest=(("p1", 9), ("p2", 6)),
        next_cursor=CursorState(7, 0, 3),
        next_queue=("p3",),
        next_buffer_uri=buffer_uri,
        # the commit decides on the typed fields, never on the logged names
        metrics={"rollout/preemptions": 99.0, "planner/drift": 9.0, "rollout/time_s": 1.0},
        preemptions=2,
        decode_drift=drift,
    )


def test_the_successor_carries_every_report_into_the_state(tmp_path) -> None:
    ctx = _ctx(tmp_path)
    state = ControllerState("e", "tail_batching", -1, 7, 0, 0, timeout_anchors=(("old", 1.0),))
    entry = BufferEntry("p9", 0)
    uri = ctx.store.put_bytes("e/tail_batching/buffers/b.json", buffer_to_json([entry]).encode())
    drain = DrainReport(Role.REWARD, 0.1, 2, samples=4, reward_sum=3.0, timeout_anchors=(("case", 0.5),))
    train = TrainReport("file:///ck/", 1, 4, "", {"train/loss": 0.1})
    new = successor(ctx, state, _round(uri, drift=0.3), drain, train, "")
    assert (new.step, new.cursor_seed, new.cursor_position, new.long_queue) == (0, 7, 3, ("p3",))
    assert new.timeout_anchors == (("case", 0.5),)  # the sandbox's anchors after the step
    assert new.partial_cache == (entry,)
    assert new.tp_plan.round_kinds == ("short",) and new.tp_plan.preemption_history == (2,)
    assert dict(new.length_history) == {"p1": 9, "p2": 6}
    assert (new.checkpoint_uri, new.policy_version, new.trained_samples, new.trained_prompts) == (
        "file:///ck/",
        1,
        4,
        2,
    )
    assert new.profile_drift == 0.3
    kept = successor(ctx, state, _round(), None, train, "")  # no reward drain: anchors kept
    assert kept.timeout_anchors == (("old", 1.0),) and kept.partial_cache == ()


def test_step_metrics_merge_the_reports() -> None:
    rw = DrainReport(
        Role.REWARD, 0.5, 2, samples=4, reward_sum=3.0, metrics={"reward/tail_s": 0.2}, tail_s=0.2
    )
    jd = DrainReport(
        Role.JUDGE, 0.25, 1, samples=4, reward_sum=1.0, metrics={"judge/tail_s": 9.0}, tail_s=0.7
    )
    m = step_metrics(_round(), rw, jd, TrainReport("u", 1, 8, "", {"train/loss": 0.1}))
    assert m["reward/mean"] == 0.5 and m["reward/tail_s"] == 0.7 and m["reward/drain_s"] == 0.75
    assert m["train/samples"] == 8.0 and m["rollout/time_s"] == 1.0


def test_a_step_between_checkpoints_names_the_last_stored_one(tmp_path) -> None:
    """checkpoint.every: an unstored step's state names the step to roll back to; a stored one
    clears it; a step with no update (the one-off pipeline's first) keeps its predecessor's."""
    ctx = _ctx(tmp_path)
    s = ControllerState("e", "tail_batching", -1, 7, 0, 0, checkpoint_uri="file:///base/")
    chain = []
    for i, stored in enumerate((False, False, True, False)):
        s = successor(ctx, s, _round(), None, TrainReport(f"file:///ck{i}/", i + 1, 4, stored=stored), "")
        chain.append(s.rollback_step)
    assert chain == [-1, -1, None, 2]
    same = successor(ctx, s, _round(), None, TrainReport(s.checkpoint_uri, s.policy_version, 0), "")
    assert same.rollback_step == 2


def test_the_commit_keeps_the_checkpoint_a_step_between_checkpoints_rolls_back_to(tmp_path) -> None:
    from rollpacker.stages.commit import _collect_garbage

    ctx = _ctx(tmp_path)
    ck = "e/tail_batching/ckpt"
    for d in ("base-x", "step-000000-a", "step-000000-b"):  # step 0's, and a failed attempt's
        ctx.store.put_bytes(f"{ck}/{d}/trainer.json", b"{}")
    s0 = ControllerState(
        "e", "tail_batching", 0, 7, 0, 0, checkpoint_uri=ctx.store.uri(f"{ck}/step-000000-a/")
    )
    ctx.states.init(ControllerState("e", "tail_batching", -1, 7, 0, 0))
    ctx.states.commit(s0)
    s1 = s0.successor(checkpoint_uri=ctx.store.uri(f"{ck}/step-000001-a/"), rollback_step=0)  # not written
    ctx.states.commit(s1)
    s2 = s1.successor(checkpoint_uri=ctx.store.uri(f"{ck}/step-000002-a/"), rollback_step=0)
    _collect_garbage(ctx, s2, s1)
    assert sorted({k.split("/")[3] for k in ctx.store.list(f"{ck}/")}) == ["base-x", "step-000000-a"]


class _Tracker:
    def __init__(self, logged: int) -> None:
        self.logged, self.steps = logged, []

    def state_pointer(self, run_id: str) -> tuple[str, int]:
        return "", self.logged

    def log_committed(self, c) -> None:  # type: ignore[no-untyped-def]
        self.steps.append(c.state_step)
        self.logged = c.state_step


class _Services:
    def __init__(self, tracker: _Tracker) -> None:
        self.t = tracker

    def tracking(self) -> _Tracker:
        return self.t


def test_mlflow_gets_each_missed_step_once_and_a_rolled_back_arm_its_re_run_steps(tmp_path) -> None:
    from rollpacker.stages.commit import repair_tracking
    from rollpacker.stages.messages import CommitRecord, LengthsLog

    ctx = _ctx(tmp_path)
    s = ControllerState("e", "tail_batching", -1, 7, 0, 0)
    ctx.states.init(s)
    chain = [s]
    for step in range(3):
        s = s.successor()
        ctx.states.put_blob(step, "commit.json", CommitRecord(step, "a", "", "short", {}).to_json().encode())
        ctx.states.put_blob(step, "lengths.json", LengthsLog("short", (1,)).to_json().encode())
        ctx.states.commit(s)
        chain.append(s)
    for logged, state, want in (
        (2, chain[3], []),  # up to date: nothing again
        (0, chain[3], [1, 2]),  # MLflow was down for two steps
        (2, chain[1], [0]),  # rolled back to step 0: its values again, then the re-run steps
    ):
        tracker = _Tracker(logged)
        ctx.services = _Services(tracker)  # type: ignore[assignment]
        repair_tracking(ctx, state)
        assert tracker.steps == want, (logged, state.step)
