"""What the stages hand each other: typed, strict messages (JSON only at the KFP component edge).

    PlanOutput ──> ProfileOutput (optional, read back from the store by the commit)
               ──> RolloutOutput ──> DrainOutput (reward), DrainOutput (judge) ──> TrainOutput
               ──> CommitOutput
Beside the edges, the commit writes per-step records into the state store: ``CommitRecord``
(what MLflow is repaired from), ``GroupsLog`` (the exactly-once log) and ``LengthsLog``.

When the arm already committed all its steps the plan stage emits ``ArmDone`` instead of a
``PlanOutput``, and nothing runs after it (the DAG gates on the plan's ``skip`` output;
``run_step`` returns at once), so no stage message carries a report that may be missing.
Invariants: every message round-trips through ``to_json``/``from_json``; an unknown or missing
field is refused by name (``core.serde``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rollpacker.core.serde import Message
from rollpacker.core.types import Role, RoundKind
from rollpacker.services.api import (
    DrainReport,
    EngineSync,
    Pending,
    ProfileSummary,
    RewardBegin,
    RoundPlan,
    RoundReport,
    TrainerBegin,
    TrainReport,
    Validation,
)


@dataclass(frozen=True)
class Timing(Message):
    """When a stage ran: its own work (``work_s``) and its wall-clock span."""

    work_s: float
    start_wall: float
    end_wall: float


class Clock:
    """Measures one stage: ``timing()`` at its end."""

    def __init__(self, start_wall: float | None = None) -> None:
        """``start_wall``: when the span began, if before this stage's own work (the start of the
        process running it); ``work_s`` always counts from here."""
        self.t0, self.t0_wall = time.perf_counter(), time.time() if start_wall is None else start_wall

    def timing(self) -> Timing:
        return Timing(time.perf_counter() - self.t0, self.t0_wall, time.time())


def span(start_wall: float, end_wall: float) -> Timing:
    """A service's call that ran from ``start_wall`` to ``end_wall``."""
    return Timing(max(0.0, end_wall - start_wall), start_wall, end_wall)


@dataclass(frozen=True)
class RoundStart(Message):
    """The services began the step's round: what the trainer and the reward services said when they
    began the attempt, and the round's ticket (the rollout stage collects it)."""

    trainer: TrainerBegin
    rewards: dict[Role, RewardBegin]
    round: Pending[RoundReport]


@dataclass(frozen=True)
class ArmDone(Message):
    """The plan stage found every step of the arm committed: nothing else runs for this step."""

    experiment: str
    arm: str
    step: int  # the step that would have run (= config.steps)
    state_step: int  # the arm's last committed step
    attempt: str
    run_id: str  # the arm's MLflow run
    timing: Timing


@dataclass(frozen=True)
class PlanOutput(Message):
    """The plan stage's decision for one attempt of one step that runs."""

    experiment: str
    arm: str
    step: int
    state_step: int  # the committed step this plan was made from
    attempt: str
    base_uri: str  # the base model in the store (the trainer's reference model)
    run_id: str  # the arm's MLflow run
    timing: Timing
    sync: EngineSync
    round: RoundPlan
    need_profile: bool = False
    reprofile: str = ""  # why a profile is measured again ("" = first profile or none)
    val0: Validation | None = None  # the validation before any RL (the arm's first step)
    init_s: float = 0.0  # one-off start-up of the arm's first step (warm-ups, engine start)
    started: RoundStart | None = None  # no profile was due: the round runs already; rollout collects it


@dataclass(frozen=True)
class ProfileOutput(Message):
    summary: ProfileSummary
    timing: Timing


@dataclass(frozen=True)
class RolloutOutput(Message):
    round: RoundReport
    trainer: TrainerBegin
    rewards: dict[Role, RewardBegin]
    timing: Timing
    round_span: Timing  # when the rollout service ran the round
    update: Pending[TrainReport]  # the update, begun as the round ended: the training stage collects it


@dataclass(frozen=True)
class DrainOutput(Message):
    report: DrainReport | None  # None: the round's task needs no service of this role (no judge)
    timing: Timing


@dataclass(frozen=True)
class TrainOutput(Message):
    report: TrainReport
    validation: Validation | None  # None: no validation was due at this step
    val_s: float
    timing: Timing
    update_span: Timing  # when the trainer service ran the update (begun at rollout's end)


@dataclass(frozen=True)
class CommitOutput(Message):
    step: int
    attempt: str
    skipped: bool  # the arm was done (``ArmDone``): nothing ran or was committed
    state_uri: str = ""
    round_kind: RoundKind | None = None  # None: skipped
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CommitRecord(Message):
    """``commit.json`` beside a committed state: the step's metrics (MLflow is repaired from it)."""

    step: int
    attempt: str
    state_uri: str
    round_kind: RoundKind
    metrics: dict[str, float]


@dataclass(frozen=True)
class GroupsLog(Message):
    """``groups.json``: which prompts the step trained, deferred and took from the queue; with
    DAPO's dynamic sampling also those it dropped (no reward variance: consumed, neither trained
    nor queued) and the extra prompts it drew to replace them. The prompts a step launched are
    ``from_queue`` (long round) or the cursor's next ones (short round), plus ``extra``; each is in
    exactly one of ``trained``, ``deferred`` and ``dropped``."""

    step: int
    attempt: str
    round_kind: RoundKind
    trained: tuple[str, ...]
    deferred: tuple[str, ...]
    from_queue: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class LengthsLog(Message):
    """``lengths.json``: the response lengths the step trained on."""

    round_kind: RoundKind
    lengths: tuple[int, ...]
