"""What the services offer: typed Protocols, and the payloads their methods return.

The stages and the services reach a service only through these Protocols, implemented by typed
proxies (``services.registry``) over a Ray actor or an object in this process. Every payload is a
frozen dataclass (``core.serde.Message``), so what crosses a process edge is checked field by field.

When each method is called, per step (one *attempt* = one try of a step; a re-run is a new one).
Two calls run ahead of the stage that needs them: ``begin_*`` starts the work in a thread of the
service and returns a typed ticket (``Pending[RoundReport]``, ``Pending[TrainReport]``) that travels
in the stage messages, across KFP edges; the stage that needs the result hands it to the same
service's ``collect``, which waits for it (the sync points; ``stages/run.py`` marks them):

    plan stage      rollout.sync(state)             serve the committed weights
                    rollout.plan(state, step)       the round the policy would run
                    trainer.begin / reward.begin    forget older attempts, restore committed state
                    rollout.begin_round(...)        -> Pending[RoundReport] (when no profile is due;
                        else the rollout stage begins it after profiling); during the round the
                        rollout service casts reward.score / reward.group, and the reward service
                        casts trainer.submit; with rollout.dynamic_sampling it calls
                        reward.group_rewards for each complete group first (the round keeps or
                        drops it on its rewards); with rollout.scale_down the rollout service calls
                        trainer.repurpose once when it frees engine replicas (the trainer gives them
                        back in finish)
    rollout stage   rollout.collect(round)          wait for the round: its RoundReport and span
                    trainer.begin_update(...)       -> Pending[TrainReport]: the one update begins
                        now (it waits for the step's last rewarded groups itself)
    drain stages    reward.drain(...)               wait for the step's rewards, report them
    train stage     trainer.collect(update)         wait for the update: checkpoint, weight push
                    rollout.validate(...)           when validation is due

tests/test_docs.py checks that every ``role.method`` named here and in docs/architecture.md is a
method of that role's Protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from rollpacker.core.advantages import TrainSample
from rollpacker.core.prompts import CursorState
from rollpacker.core.serde import Message
from rollpacker.core.state import ControllerState
from rollpacker.core.types import Group, Role, RoundKind
from rollpacker.core.weight_sync import TransferGroup

Anchors = tuple[tuple[str, float], ...]  # the sandbox's timeout anchors: (test case, seconds)
R = TypeVar("R", bound=Message)  # what a call begun ahead returns


# -- payloads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSync(Message):
    """What ``rollout.sync`` did to serve the state's checkpoint."""

    started: bool
    reloaded: bool
    seconds: float
    policy_version: int


@dataclass(frozen=True)
class WeightProbe(Message):
    """The engine's sampled tokens and their logprobs on the fixed probe prompts, taken right after
    a weight push (``rollout.probe``); empty when no engine is up (the next sync loads the checkpoint)."""

    policy_version: int
    prompt_ids: tuple[tuple[int, ...], ...]
    response_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[tuple[float, ...], ...]


@dataclass(frozen=True)
class WeightPeer(Message):
    """The rollout engines as a collective weight push sees them (``RolloutAPI.weight_peer``)."""

    workers: int  # every engine's workers (every replica of every started layout), after the senders
    joined: bool  # they are in the trainer's group on the port asked about


@dataclass(frozen=True)
class WeightPush(Message):
    """What the engine's workers received in a collective weight push (``train.weight_sync``)."""

    seconds: float
    workers: int
    buckets: int  # per worker
    payload_bytes: int  # per worker


@dataclass(frozen=True)
class RoundPlan(Message):
    """The round the arm's policy would run next (the plan stage reports it; the rollout stage
    plans it again from the same state, so both agree)."""

    round_kind: RoundKind
    prompts: tuple[str, ...]
    from_queue: tuple[str, ...]
    target_prompts: int
    roles: tuple[Role, ...]  # the reward services the task needs: reward, judge


@dataclass(frozen=True)
class RoundReport(Message):
    """One rolled-out round: what to train, what the policy's next state is, and its metrics."""

    step: int
    attempt: str
    round_kind: RoundKind
    trained: tuple[str, ...]  # prompt ids of the groups the update trains
    deferred: tuple[str, ...]  # prompt ids left for later (queue or buffer)
    from_queue: tuple[str, ...]
    groups_by_role: dict[Role, tuple[str, ...]]  # reward role -> prompt ids it rewards
    lengths: tuple[int, ...]  # response lengths of the trained groups
    longest: tuple[tuple[str, int], ...]  # (prompt id, its longest trained response)
    next_cursor: CursorState
    next_queue: tuple[str, ...]
    next_buffer_uri: str  # the rollout buffer after the round, in the store ("" = none)
    metrics: dict[str, float]  # what MLflow logs; the commit decides on the typed fields below
    preemptions: int  # the engine's KV-cache preemptions in the round (the TP planner's input)
    # |predicted - measured| / measured decode time of the round on the profile (0: no profile or
    # no layouts): a re-profile is due when it passes planner.reprofile_margin
    decode_drift: float
    end_wall: float = 0.0  # wall clock when the round ended (reward tails are measured from it)
    # DAPO's dynamic sampling: prompts whose groups had no reward variance (consumed: neither
    # trained nor queued), and the prompts drawn beyond the plan to replace them
    dropped: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupRewards(Message):
    """A complete group's rewards, one per response in the group's order (``reward.group_rewards``:
    what DAPO's dynamic sampling keeps or drops the group on)."""

    prompt_id: str
    rewards: tuple[float, ...]


@dataclass(frozen=True)
class ProfileSummary(Message):
    """A profile table measured and written to the store (the document is at ``uri``)."""

    uri: str
    points: int
    window_error: dict[str, float]  # layout -> mean error of the predictor per decode window
    seconds: float


@dataclass(frozen=True)
class Validation(Message):
    accuracy: float
    mean_response_len: float
    time_s: float

    def metrics(self, tag: str = "val") -> dict[str, float]:
        return {
            f"{tag}/accuracy": self.accuracy,
            f"{tag}/mean_response_len": self.mean_response_len,
            f"{tag}/time_s": self.time_s,
        }


@dataclass(frozen=True)
class RewardBegin(Message):
    seconds: float
    kinds: tuple[str, ...]


@dataclass(frozen=True)
class TrainerBegin(Message):
    seconds: float
    restored: bool  # the trainer (re)loaded the state's checkpoint
    pending: int  # one-off: samples of the previous step whose gradients run during this one


@dataclass(frozen=True)
class DrainReport(Message):
    """A reward service's account of one step."""

    role: Role
    drain_s: float
    groups: int
    samples: int = 0
    reward_sum: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    tail_s: float = 0.0  # seconds from the round's end to the step's last reward (0: none scored)
    timeout_anchors: Anchors = ()  # the sandbox's anchors after the step (role "reward")


@dataclass(frozen=True)
class TrainReport(Message):
    """The trainer's account of one step's update."""

    checkpoint_uri: str
    policy_version: int
    samples: int  # samples the update trained (one-off: the previous step's)
    pending_batch_uri: str = ""  # one-off: this step's samples, trained at the next step
    metrics: dict[str, float] = field(default_factory=dict)
    # False: a step between checkpoints (checkpoint.every); the weights checkpoint_uri names are
    # only in the trainer's and the engine's memory
    stored: bool = True


@dataclass(frozen=True)
class DeviceLease(Message):
    """What ``trainer.repurpose`` did with the devices a scale-down freed (RollPacker 4.4)."""

    devices: tuple[str, ...]  # the devices the trainer now holds (empty: none; a late call)
    threads: int  # the stream trainer's gradient threads from now on
    at_s: float  # seconds since the trainer's ``begin`` of this attempt


@dataclass(frozen=True)
class ScoreItem:
    """A response to score at once (validation)."""

    sample_id: str
    prompt_id: str
    text: str


@dataclass(frozen=True)
class PendingBatch(Message):
    """The one-off pipeline's rewarded samples of a step, trained at the next step."""

    samples: tuple[TrainSample, ...]
    version: int = 1


# -- the services ---------------------------------------------------------------------------------
class ServiceAPI(Protocol):
    """What every service answers (the registry uses these)."""

    def config_digest(self) -> str: ...

    def bind(self, peers: Peers) -> None:
        """Called once after construction: how to reach the other services."""

    def close(self) -> None: ...


# -- calls begun ahead of the stage that waits for them ------------------------------------------
@dataclass(frozen=True)
class Pending(Message, Generic[R]):
    """A call a service began and nobody has collected yet: a ticket, not the work. It is plain
    data, so it crosses process and KFP edges inside the stage messages; the stage that needs the
    result hands it to the same service's ``collect``. ``R`` is the result's type
    (``begin_round`` gives a ``Pending[RoundReport]``); ``result`` names it, checked at collection."""

    service: str  # the role of the service running the call: "rollout", "trainer"
    call: str  # what runs: "round", "update"
    attempt: str
    result: str  # the result's message type, by name
    begun_wall: float

    @property
    def key(self) -> str:
        """What the service keeps the running call under (one per call and attempt)."""
        return f"{self.call}:{self.attempt}"


@dataclass(frozen=True)
class Collected(Message, Generic[R]):
    """The result of a call begun ahead (``Pending[R]``), and when it ran (wall clock)."""

    value: R
    start_wall: float
    end_wall: float


class RolloutAPI(Protocol):
    """The rollout engine(s), the arm's policy, validation and profiling."""

    def sync(self, state: ControllerState) -> EngineSync: ...

    def plan(self, state: ControllerState, step: int) -> RoundPlan: ...

    def run_round(self, state: ControllerState, step: int, attempt: str) -> RoundReport: ...

    def begin_round(self, state: ControllerState, step: int, attempt: str) -> Pending[RoundReport]:
        """``run_round`` begun now, in a thread of the service; returns at once. Beginning the same
        attempt's round again returns the first ticket (it runs once)."""

    def collect(self, ticket: Pending[RoundReport]) -> Collected[RoundReport]:
        """Wait for the round ``ticket`` names: its report (or its exception), and its span."""

    def validate(self, step: int, attempt: str) -> Validation: ...

    def profile(self, key: str) -> ProfileSummary: ...

    def load_weights(self, policy_version: int, checkpoint_uri: str, weights: dict[str, Any]) -> float: ...

    def probe(self, prompts: int, max_tokens: int) -> WeightProbe:
        """Sample ``max_tokens`` tokens on the task's first ``prompts`` training prompts with the
        served weights (seeded, at the rollout temperature): the weight-sync probe's engine side."""

    def weight_peer(self, port: int) -> WeightPeer:
        """The engines' workers and whether they all joined the group on ``port`` (a layout
        started since did not); raises when no running vLLM engine can receive a push (the
        trainer then uses the object store)."""

    def init_weight_transfer(self, group: TransferGroup) -> None:
        """Join the trainer's weight-transfer group; returns once the trainer has joined too."""

    def receive_weights(self, policy_version: int, checkpoint_uri: str) -> WeightPush:
        """Receive the trainer's collective push (it sends meanwhile), between rounds."""

    def holds(self, checkpoint_uri: str) -> bool:
        """Whether a live engine serves the weights ``checkpoint_uri`` names (a step between
        checkpoints: they are in no store, only pushed into the engine)."""


class RewardAPI(Protocol):
    """Rule and sandbox rewards (role ``reward``) or the LLM judge (role ``judge``)."""

    def begin(self, attempt: str, anchors: Anchors) -> RewardBegin: ...

    def score(self, attempt: str, request_id: str, prompt_id: str, text: str) -> None:
        """Fire and forget: a finished response, scored while rollout goes on."""

    def group(self, attempt: str, group: Group, texts: tuple[str, ...]) -> None:
        """Fire and forget: a final group; once rewarded it goes to the trainer."""

    def group_rewards(self, attempt: str, group: Group, texts: tuple[str, ...]) -> GroupRewards:
        """A complete group's rewards, waited for (DAPO's dynamic sampling decides on them before
        the group is final); each response is scored once: a later ``group`` of it reuses them."""

    def drain(self, attempt: str, expected: tuple[str, ...], rollout_end_wall: float) -> DrainReport: ...

    def score_now(self, items: tuple[ScoreItem, ...]) -> tuple[bool, ...]: ...


class TrainerAPI(Protocol):
    """The policy's trainer and the stream trainer."""

    def begin(self, attempt: str, state: ControllerState, base_uri: str) -> TrainerBegin: ...

    def submit(self, attempt: str, prompt_id: str, samples: tuple[TrainSample, ...]) -> None:
        """Fire and forget: a rewarded group's samples; their gradients start now."""

    def finish(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> TrainReport: ...

    def begin_update(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> Pending[TrainReport]:
        """``finish`` begun now, in a thread of the service (it waits for the step's last groups
        itself); returns at once. Beginning the same attempt's update again returns the first ticket."""

    def collect(self, ticket: Pending[TrainReport]) -> Collected[TrainReport]:
        """Wait for the update ``ticket`` names: its report (or its exception), and its span."""

    def holds(self, checkpoint_uri: str) -> bool:
        """Whether the trainer's memory holds exactly the weights and optimizer state
        ``checkpoint_uri`` names (a step between checkpoints: they are in no store)."""

    def repurpose(self, attempt: str, devices: tuple[str, ...]) -> DeviceLease:
        """Rollout freed ``devices`` (scale-down): compute the streamed gradients on them until
        ``finish`` gives them back; a call of an older attempt is ignored."""


class Peers(Protocol):
    """How a service reaches the others (the registry, picklable into a Ray actor)."""

    def rollout(self) -> RolloutAPI: ...

    def reward(self, role: Role) -> RewardAPI: ...

    def trainer(self) -> TrainerAPI: ...

    def cast_failure(self, attempt: str) -> str | None:
        """The first fire-and-forget call of ``attempt`` made through these peers that failed (the
        peer raised or died), as a message naming the peer, the call and the cause; None if none."""

    def refresh(self) -> None:
        """Forget the peers found so far: the next call looks each up by name, so a peer rebuilt
        since (after a crash) is the one reached. A service calls it when an attempt begins."""


class TrackingAPI(Protocol):
    """The arm's MLflow run, reached through a long-lived service so that no stage process imports
    MLflow (seconds per process) or opens its own HTTP session; every call is one round trip.
    Mirrors ``rollpacker.tracking.ExperimentTracker`` for the calls the stages make."""

    def check(self) -> str:
        """The experiment's id (created if missing); a clear error if MLflow does not answer."""

    def arm_run(self, arm: str, params: dict[str, str]) -> str: ...

    def log_step(self, run_id: str, step: int, metrics: dict[str, float]) -> None: ...

    def state_pointer(self, run_id: str) -> tuple[str, int] | None: ...

    def log_committed(self, commit: CommittedStep) -> None:
        """A committed step in one call: its metrics (one batch), its lengths, the state pointer,
        and the arm's plots when it is the arm's last step."""

    def log_profile(self, run_id: str, step: int, uri: str, doc: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CommittedStep(Message):
    """What MLflow records of a committed step (``TrackingAPI.log_committed``)."""

    run_id: str
    step: int  # the MLflow step (the RL step + 1: step 0 is the validation before any RL)
    metrics: dict[str, float]
    round_kind: RoundKind
    lengths: tuple[int, ...]
    state_uri: str
    state_step: int
    last: bool  # the arm's last step: render its plots and mark the run finished
