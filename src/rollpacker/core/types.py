"""Typed data shared by policies, engines and the rollout driver.

Everything here is a frozen dataclass or an enum: no dicts cross a module boundary.

Invariants:
- a ``GenerationRequest`` names exactly one (prompt, sample index) pair, and its request id is
  unique within a run (``request_id(step, prompt_id, sample_index, attempt)``);
- a ``Completion``'s ``token_ids`` and ``logprobs`` have the same length, and resumed tokens keep
  the logprobs and policy versions they were sampled with (``resumed_from``);
- a ``Group`` holds responses of one prompt only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TypeVar

from rollpacker.core.errors import ConfigError


class RoundKind(enum.StrEnum):
    """What kind of rollout a step runs (a ``str`` enum: its JSON and its metric tags are the value)."""

    STANDARD = "standard"  # synchronous baseline: P0 prompts x R0 responses, wait for all
    SHORT = "short"  # tail batching with speculation (abort the tail)
    LONG = "long"  # tail batching long round: P0 queued prompts, no speculation
    SORTED = "sorted"  # SortedRL: the buffered group oversubscribed, early termination at P0 groups
    PARTIAL = "partial"  # partial rollout: cached partial samples resumed, supplemented, interrupted


class Role(enum.StrEnum):
    """A service of an experiment arm (its actor is ``<experiment>.<arm>.<role>``)."""

    ROLLOUT = "rollout"
    REWARD = "reward"  # rule and sandbox rewards
    JUDGE = "judge"  # the LLM judge
    TRAINER = "trainer"
    TRACKING = "tracking"  # the arm's MLflow run

    @property
    def is_reward(self) -> bool:
        """True for the two reward services (``reward`` and ``judge``)."""
        return self in (Role.REWARD, Role.JUDGE)


class ServicesMode(enum.StrEnum):
    """Where an arm's services live: named Ray actors, or objects in this process."""

    RAY = "ray"
    INLINE = "inline"


class Runner(enum.StrEnum):
    """How ``rollpacker run`` sequences the stages: ``kfp.local`` tasks, or one process."""

    KFP = "kfp"
    INLINE = "inline"

    @property
    def services_mode(self) -> ServicesMode:
        """The services this runner's stages reach: Ray actors for KFP tasks, objects inline."""
        return ServicesMode.RAY if self is Runner.KFP else ServicesMode.INLINE


E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``cls`` (a member passes as is); a bad value raises a ``ConfigError``
    that names ``what`` (the option, field or argument) and the allowed values."""
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ConfigError(f"{what} = {value!r}: not one of {allowed}") from None


class FinishReason(enum.Enum):
    """Why a request stopped generating."""

    STOP = "stop"  # end-of-sequence or a stop string
    LENGTH = "length"  # reached max_tokens
    ABORT = "abort"  # aborted by the policy (speculation, interruption, migration)

    @property
    def is_natural(self) -> bool:
        """True when the response ended on its own (it can be trained on)."""
        return self is not FinishReason.ABORT


@dataclass(frozen=True)
class Prompt:
    """One prompt of a dataset or trace.

    ``token_ids`` is what the engine receives. ``metadata`` holds task-specific, JSON-able
    values (for a replay trace: the traced response lengths).
    """

    prompt_id: str
    token_ids: tuple[int, ...]
    response_lens: tuple[int, ...] = ()  # replay traces only: length of response j
    dataset_index: int = -1  # position in the seeded dataset order (-1: not from a dataset)

    def __post_init__(self) -> None:
        if not self.prompt_id:
            raise ValueError("Prompt.prompt_id must be a non-empty string")
        if not self.token_ids:
            raise ValueError(f"prompt {self.prompt_id!r}: token_ids is empty; a prompt needs >= 1 token")


@dataclass(frozen=True)
class SamplingSpec:
    """Sampling parameters for one request (a small, engine-neutral subset of vLLM's)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False  # replay: generate exactly max_tokens tokens
    logprobs: bool = True  # return the logprob of every sampled token

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingSpec.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingSpec.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingSpec.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class GenerationRequest:
    """One response to generate: prompt ``prompt_id``, sample ``sample_index``.

    ``prefix_token_ids`` / ``prefix_logprobs`` hold already generated tokens of a resumed partial
    response (SortedRL partial mode, partial rollout, PAT migration): the engine continues after
    them and ``sampling.max_tokens`` counts only the new tokens.
    """

    request_id: str
    prompt: Prompt
    sample_index: int
    sampling: SamplingSpec
    prefix_token_ids: tuple[int, ...] = ()
    prefix_logprobs: tuple[float, ...] = ()
    prefix_versions: tuple[int, ...] = ()  # policy version of each prefix token (() = unknown: 0)

    def __post_init__(self) -> None:
        if len(self.prefix_token_ids) != len(self.prefix_logprobs):
            raise ValueError(
                f"request {self.request_id!r}: prefix has {len(self.prefix_token_ids)} tokens but "
                f"{len(self.prefix_logprobs)} logprobs"
            )
        if self.prefix_versions and len(self.prefix_versions) != len(self.prefix_token_ids):
            raise ValueError(
                f"request {self.request_id!r}: prefix has {len(self.prefix_token_ids)} tokens but "
                f"{len(self.prefix_versions)} policy versions"
            )

    @property
    def prefix_token_versions(self) -> tuple[int, ...]:
        return self.prefix_versions or (0,) * len(self.prefix_token_ids)

    @property
    def engine_input_ids(self) -> tuple[int, ...]:
        """What the engine must see as its prompt: the prompt plus any resumed tokens."""
        return self.prompt.token_ids + self.prefix_token_ids


def request_id(step: int, prompt_id: str, sample_index: int, attempt: int = 0, namespace: str = "") -> str:
    """The canonical request id; unique per (namespace, step, prompt, sample, attempt).

    ``namespace`` separates runs that share one engine (the benchmark's policies, experiments).
    """
    base = f"s{step}/{prompt_id}/r{sample_index}/a{attempt}"
    return f"{namespace}/{base}" if namespace else base


@dataclass(frozen=True)
class RequestUpdate:
    """What one engine step produced for one request (a delta, not the whole response)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[float, ...]
    finished: bool
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if len(self.new_token_ids) != len(self.new_logprobs):
            raise ValueError(
                f"update for {self.request_id!r}: {len(self.new_token_ids)} tokens but "
                f"{len(self.new_logprobs)} logprobs"
            )
        if self.finished and self.finish_reason is None:
            raise ValueError(f"update for {self.request_id!r}: finished without a finish_reason")


@dataclass(frozen=True)
class EngineStepStats:
    """Engine-side facts about one engine step, for metrics (bubble ratio, preemptions)."""

    start_s: float
    duration_s: float
    num_running: int  # requests decoding/prefilling in this step (r_k of the bubble ratio)
    num_waiting: int
    num_preemptions_total: int  # cumulative counter since engine start
    kv_cache_usage: float  # fraction of KV blocks in use after the step, 0..1
    new_tokens: int = 0  # tokens the step generated, over every request (> running with drafts)
    # speculative decoding (engine.speculation): tokens drafted and verified in this step, drafted
    # tokens the target model accepted, and the seconds spent drafting after it
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_draft_s: float = 0.0
    # per draft position (index 0 = the first drafted token): drafts that reached the position, and
    # drafts whose tokens up to and including it were all accepted (vLLM's SpecDecodingStats)
    spec_draft_tokens_per_pos: tuple[int, ...] = ()
    spec_accepted_tokens_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A finished (or aborted) response, as the driver hands it to the policy."""

    request_id: str
    prompt_id: str
    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    policy_version: int = 0  # weights version that sampled the new tokens
    resumed_tokens: int = 0  # leading tokens that came from a resumed prefix
    finished_at_s: float = 0.0
    prefix_versions: tuple[int, ...] = ()  # versions of the resumed tokens (() = all policy_version)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"completion {self.request_id!r}: {len(self.token_ids)} tokens but "
                f"{len(self.logprobs)} logprobs"
            )
        if not 0 <= self.resumed_tokens <= len(self.token_ids):
            raise ValueError(
                f"completion {self.request_id!r}: {self.resumed_tokens} resumed tokens of "
                f"{len(self.token_ids)}"
            )
        if self.prefix_versions and len(self.prefix_versions) != self.resumed_tokens:
            raise ValueError(
                f"completion {self.request_id!r}: {len(self.prefix_versions)} prefix versions for "
                f"{self.resumed_tokens} resumed tokens"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def token_versions(self) -> tuple[int, ...]:
        """The policy version that sampled each token: resumed tokens keep theirs."""
        head = self.prefix_versions or (self.policy_version,) * self.resumed_tokens
        return head + (self.policy_version,) * (len(self.token_ids) - self.resumed_tokens)


@dataclass(frozen=True)
class Group:
    """The R0 responses of one prompt that a step trains on."""

    prompt: Prompt
    responses: tuple[Completion, ...]

    def __post_init__(self) -> None:
        for c in self.responses:
            if c.prompt_id != self.prompt.prompt_id:
                raise ValueError(f"group for {self.prompt.prompt_id!r} holds a response of {c.prompt_id!r}")
            if not c.finish_reason.is_natural:
                raise ValueError(f"group for {self.prompt.prompt_id!r} holds an aborted response")


@dataclass(frozen=True)
class Actions:
    """What a round controller wants the runtime to do next."""

    submit: tuple[GenerationRequest, ...] = ()
    abort: tuple[str, ...] = ()  # request ids

    def __add__(self, other: Actions) -> Actions:
        return Actions(self.submit + other.submit, self.abort + other.abort)

    @property
    def empty(self) -> bool:
        return not self.submit and not self.abort


@dataclass(frozen=True)
class StepPlan:
    """What one RL step's rollout will do, as data (logged, and stored in the controller state)."""

    step: int
    round_kind: RoundKind
    prompts: tuple[Prompt, ...]
    responses_per_prompt: int  # launched per prompt (R0, or ceil(eta_r * R0) in short rounds)
    target_prompts: int  # P0: groups the step must produce
    target_responses: int  # R0: responses per group
    from_queue: tuple[str, ...] = ()  # prompt ids taken from the long-prompt queue


@dataclass(frozen=True)
class RoundResult:
    """What a round produced: the groups to train and the prompts it deferred."""

    plan: StepPlan
    groups: tuple[Group, ...]
    deferred: tuple[Prompt, ...]  # appended to the long-prompt queue, in launch order
    # every response generated but not trained: aborted ones (with their partial tokens) and
    # natural ones that came too late for their group or belong to a deferred prompt
    discarded: tuple[Completion, ...] = field(default=())
    # responses kept for a later step (partial modes: interrupted ones with their tokens, finished
    # ones of prompts that are not complete yet): generated now, trained later, not wasted
    cached: tuple[Completion, ...] = field(default=())
    # DAPO's dynamic sampling: prompts whose group had no reward variance (dropped: neither trained
    # nor deferred, consumed) and the prompts drawn beyond the plan to replace them, in launch order
    filtered: tuple[Prompt, ...] = field(default=())
    extra_prompts: tuple[Prompt, ...] = field(default=())
