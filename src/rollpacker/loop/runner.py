"""The local RL training loop: ``rollpacker train --config FILE``.

One RL step (``RLRun.step``), readable on one screen:

1. the policy plans the step (short / long / standard round) from the cursor and the long queue;
2. rollout runs on the vLLM engine; each response is scored by its reward function (math-verify
   workers, the code sandbox, the judge) as soon as it finishes, while rollout goes on, and each
   final, fully rewarded group is handed to the stream trainer, which accumulates its gradient
   during rollout;
3. when rollout ends, the remaining rewards are drained and the stream trainer takes its one
   deferred optimizer step (or, with ``train.stream: false``, trains the whole batch now);
4. the new weights are pushed into the engine in place, the policy commits (cursor, queue), and
   the step's metrics go to MLflow; validation and checkpoints every few steps.

Invariants:
- every group the round returns is trained exactly once in its step (checked per step);
- nothing changes the policy's cross-step state before the step's update is applied;
- a checkpoint holds everything a restart needs (weights, optimizer, RNG, cursor, queue, step).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.advantages import train_samples
from rollpacker.core.config import ExperimentConfig, PolicyName, from_mapping
from rollpacker.core.errors import ConfigError, TrainerError
from rollpacker.core.policies.base import RolloutPolicy
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import CursorState, LongPromptQueue, PromptCursor
from rollpacker.core.tasks import RewardKind, TaskExample, split
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.core.types import Completion, Group, Prompt, SamplingSpec
from rollpacker.rewards.base import RewardFunction, RewardRequest, RewardResult, RewardRouter

# the share of code in a built-in task, which the warm-up mixes in (docs/tasks.md)
_CODE_SHARE = {"synthetic_code": 1.0, "mixed": 0.5}


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read a YAML experiment config; unknown keys are rejected by name."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; see configs/ for examples")
    return config_from_text(p.read_text(), where=str(p), overrides=overrides)


def config_from_text(
    text: str, where: str = "config", overrides: dict[str, Any] | None = None
) -> ExperimentConfig:
    """The experiment config from YAML text (what the pipeline stages receive); ``overrides`` maps
    dotted keys (``rollout.policy``) to values."""
    import yaml

    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping of sections, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    try:
        return from_mapping(ExperimentConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


@dataclass
class StepRecord:
    step: int
    metrics: dict[str, float]
    round_kind: str
    trained_prompts: list[str]
    deferred_prompts: list[str]
    from_queue: list[str]


@dataclass
class RunSummary:
    run_id: str
    run_dir: str
    policy: str
    seed: int
    steps: int
    trained_samples: int
    val_accuracy_start: float
    val_accuracy_end: float
    wall_s: float
    records: list[StepRecord] = field(default_factory=list)
    leftover_queue: list[str] = field(default_factory=list)


class _GroupRewards:
    """Scores each response as soon as it finishes (``on_response``), and hands out each final
    group once all its responses are scored (``on_group`` / ``take_ready``). A response whose
    prompt ends up deferred (tail batching) was scored for nothing: ``wasted`` counts those."""

    def __init__(
        self,
        submit: Callable[[RewardRequest], Future[RewardResult]],
        decode: Callable[[Any], str],
        examples: dict[str, TaskExample],
    ) -> None:
        self._submit = submit
        self._decode = decode
        self._examples = examples
        self._lock = threading.Lock()
        self._ready: list[tuple[Group, list[RewardResult]]] = []
        self._pending = 0
        self._all_done = threading.Condition(self._lock)
        self.results: list[RewardResult] = []
        self.kinds: list[RewardKind] = []  # the reward kind of each result
        self.last_done_s = 0.0
        self._early: dict[str, Future[RewardResult]] = {}  # scored on finishing, not yet grouped

    def _request(self, c: Completion) -> Future[RewardResult]:
        ex = self._examples[c.prompt_id]
        return self._submit(
            RewardRequest(sample_id=c.request_id, example=ex, response=self._decode(c.token_ids))
        )

    def on_response(self, c: Completion) -> None:
        fut = self._request(c)
        with self._lock:
            self._early[c.request_id] = fut

    @property
    def wasted(self) -> int:
        """Responses scored on finishing that no final group took (their prompt was deferred)."""
        with self._lock:
            return len(self._early)

    def on_group(self, group: Group) -> None:
        ex = self._examples[group.prompt.prompt_id]
        with self._lock:
            early = [self._early.pop(c.request_id, None) for c in group.responses]
        futs = [f if f is not None else self._request(c) for f, c in zip(early, group.responses, strict=True)]
        with self._lock:
            self._pending += 1
        box: list[RewardResult | None] = [None] * len(futs)
        left = [len(futs)]

        def done(i: int, f: Future[RewardResult]) -> None:
            res = f.result()
            with self._lock:
                box[i] = res
                left[0] -= 1
                if left[0] == 0:
                    got = [r for r in box if r is not None]
                    self._ready.append((group, got))
                    self.results.extend(got)
                    self.kinds.extend([ex.reward_kind] * len(got))
                    self._pending -= 1
                    self.last_done_s = time.perf_counter()
                    self._all_done.notify_all()

        for i, f in enumerate(futs):
            f.add_done_callback(lambda f, i=i: done(i, f))

    def take_ready(self) -> list[tuple[Group, list[RewardResult]]]:
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def wait_all(self, timeout_s: float = 600.0) -> None:
        with self._all_done:
            if not self._all_done.wait_for(lambda: self._pending == 0, timeout=timeout_s):
                raise TrainerError(f"{self._pending} groups still wait for rewards after {timeout_s} s")


class RLRun:
    """Everything one local run holds: engine, trainer, rewards, policy, tracking."""

    def __init__(self, cfg: ExperimentConfig, resume: bool = False, quiet: bool = False) -> None:
        from rollpacker.engines.vllm_engine import VLLMEngine
        from rollpacker.loop.tracking import Tracker
        from rollpacker.tasks.registry import load_task
        from rollpacker.trainers.stream import StreamTrainer
        from rollpacker.trainers.torch_trainer import TorchTrainer

        self.cfg = cfg
        self.quiet = quiet
        name = cfg.run_name or f"{cfg.rollout.policy.value}-seed{cfg.seed}"
        self.run_dir = Path(cfg.out_dir) / cfg.experiment / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        base_model = prepare_model(cfg, quiet=quiet)
        state = _latest_state(self.run_dir) if resume else None
        model_dir = Path(state["checkpoint"]) / "model" if state else base_model

        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(base_model))
        examples = load_task(cfg.task.name, seed=cfg.task.seed, num_examples=cfg.task.num_examples)
        if cfg.task.val_size >= len(examples):
            raise ConfigError(
                f"task.val_size = {cfg.task.val_size} leaves no training examples out of {len(examples)}"
            )
        train, val = split(examples, cfg.task.val_size / len(examples), seed=cfg.task.seed)
        self.examples = {ex.example_id: ex for ex in examples}
        self.train_prompts = [self._prompt(ex, i) for i, ex in enumerate(train)]
        self.val_prompts = [self._prompt(ex, i) for i, ex in enumerate(val)]
        by_id = {p.prompt_id: p for p in self.train_prompts}

        cursor_state = CursorState(**state["cursor"]) if state else None
        cursor = PromptCursor(
            self.train_prompts, seed=cfg.seed, state=cursor_state, window=cfg.rollout.launched_prompts
        )
        r = cfg.rollout
        sampling = lambda _p, _j: SamplingSpec(  # noqa: E731
            max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p
        )
        ns = f"{name}"
        self.policy: RolloutPolicy
        if r.policy in (PolicyName.SORTED, PolicyName.PARTIAL) or r.one_off:
            raise ConfigError(
                f"rollout.policy = {r.policy.value!r}{' with one_off' if r.one_off else ''}: the "
                "single-process loop (`rollpacker train`) runs sync and tail_batching only; run the "
                "buffered policies and the one-off mode through the pipeline (`rollpacker run`), "
                "whose controller state keeps their caches"
            )
        if r.policy is PolicyName.SYNC:
            self.policy = SyncPolicy(r, cursor, sampling, namespace=ns)
        else:
            queue = LongPromptQueue(by_id[i] for i in (state["queue"] if state else []))
            self.policy = TailBatchingPolicy(r, cursor, sampling, queue=queue, namespace=ns)

        self.engine = VLLMEngine(
            _replace(cfg.engine, model_dir=str(model_dir), seed=cfg.seed + cfg.engine.seed)
        )
        self.trainer = TorchTrainer(
            model_dir,
            _replace(cfg.train, seed=cfg.seed + cfg.train.seed),
            temperature=r.temperature,
            ref_model_dir=base_model,
        )
        if state:
            self.trainer.load_checkpoint(Path(state["checkpoint"]))
        self.stream = StreamTrainer(self.trainer, stream=cfg.train.stream)
        self.timeouts = AdaptiveTimeout(
            cfg.reward.sandbox.timeouts(),
            AdaptiveTimeout.from_json(state["timeout_anchors"]).anchors()
            if state and state.get("timeout_anchors")
            else None,
        )
        self.rewards = build_rewards(cfg, examples, self.timeouts, quiet=quiet)
        self.start_step = int(state["step"]) + 1 if state else 0
        self.trained_samples = int(state["trained_samples"]) if state else 0
        self.tracker = Tracker(cfg, run_dir=self.run_dir, run_id=state["run_id"] if state else None)
        self.records: list[StepRecord] = []

    def _prompt(self, ex: TaskExample, index: int) -> Prompt:
        ids = tuple(self.tokenizer.encode(ex.prompt, add_special_tokens=False))
        return Prompt(prompt_id=ex.example_id, token_ids=ids, dataset_index=index)

    def _decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    # -- one RL step ------------------------------------------------------------------------------
    def step(self, step: int) -> StepRecord:
        from rollpacker.rollout.driver import run_round

        t0 = time.perf_counter()
        plan = self.policy.plan_step(step)
        scorer = _GroupRewards(self.rewards.submit, self._decode, self.examples)
        trained: list[str] = []

        def push_ready(*_: Any) -> None:
            for group, results in scorer.take_ready():
                rewards = [res.reward for res in results]
                self.stream.submit(train_samples(group, rewards, scale=self.cfg.train.scale_advantages))
                trained.append(group.prompt.prompt_id)

        run = run_round(
            self.engine,
            self.policy.open_round(plan),
            policy_version=self.trainer.policy_version,
            on_group=scorer.on_group,
            on_response=scorer.on_response if self.cfg.reward.per_response else None,
            on_step=push_ready,
        )
        t_rollout = time.perf_counter()
        scorer.wait_all()
        reward_tail_s = max(0.0, scorer.last_done_s - t_rollout)
        push_ready()
        result = run.result
        if sorted(trained) != sorted(g.prompt.prompt_id for g in result.groups):
            raise TrainerError(f"step {step}: trained groups differ from the round's groups")
        report = self.stream.finish()
        t_sync = time.perf_counter()
        self.engine.load_weights(self.trainer.weights())
        sync_s = time.perf_counter() - t_sync
        self.policy.commit(result)
        self.trained_samples += report.stats.samples

        sync_stage = self._sync_reward_stage(result.groups) if self.cfg.reward.measure_sync_stage else {}
        m = run.metrics
        rewards = [r.reward for r in scorer.results]
        latency = [r.elapsed_s for r in scorer.results]
        metrics = {
            **m.logged(len(getattr(self.policy, "queue", ()))),
            "reward/mean": sum(rewards) / len(rewards),
            "reward/tail_s": reward_tail_s,
            "reward/latency_s_mean": sum(latency) / len(latency),
            "reward/latency_s_max": max(latency),
            **_per_kind(scorer.results, scorer.kinds),
            **sync_stage,
            "reward/timeouts": float(sum(r.status.value == "timeout" for r in scorer.results)),
            "reward/wasted": float(scorer.wasted),
            "train/time_s": report.finish_s,
            "train/overlap_s": report.overlap_s,
            "train/streamed_samples": float(report.streamed_samples),
            "train/loss": report.stats.loss,
            "train/grad_norm": report.stats.grad_norm,
            "train/clip_frac": report.stats.clip_frac,
            "train/ratio_mean": report.stats.ratio_mean,
            "train/kl": report.stats.kl,
            "train/samples_total": float(self.trained_samples),
            "weights/sync_s": sync_s,
        }
        metrics["step/time_s"] = time.perf_counter() - t0
        rec = StepRecord(
            step=step,
            metrics=metrics,
            round_kind=plan.round_kind.value,
            trained_prompts=[g.prompt.prompt_id for g in result.groups],
            deferred_prompts=[p.prompt_id for p in result.deferred],
            from_queue=list(plan.from_queue),
        )
        self.records.append(rec)
        return rec

    def _sync_reward_stage(self, groups: Sequence[Group]) -> dict[str, float]:
        """Score the step's responses again, all at once after rollout: the synchronous reward stage
        this step would have had. Its seconds beside ``reward/tail_s`` show what overlap saved."""
        t0 = time.perf_counter()
        futs = [
            self.rewards.submit(
                RewardRequest(
                    f"{c.request_id}#sync", self.examples[g.prompt.prompt_id], self._decode(c.token_ids)
                )
            )
            for g in groups
            for c in g.responses
        ]
        for f in futs:
            f.result()
        return {"reward/sync_stage_s": time.perf_counter() - t0}

    # -- validation, checkpoints, the loop --------------------------------------------------------
    def validate(
        self, step: int, prompts: Sequence[Prompt] | None = None, samples: int = 1, tag: str = "val"
    ) -> dict[str, float]:
        """Accuracy (mean over ``samples`` responses per prompt) on the held-out split, or on
        ``prompts`` when given, at the validation temperature, under the engine's current weights."""
        from rollpacker.rollout.driver import generate, sample_requests

        v = self.cfg.validation
        sp = SamplingSpec(max_tokens=v.max_tokens, temperature=v.temperature)
        chosen = self.val_prompts if prompts is None else prompts
        reqs = sample_requests(chosen, samples, sp, f"{tag}/{self.run_dir.name}/s{step}")
        t0 = time.perf_counter()
        comps = generate(self.engine, reqs)
        futs = [
            self.rewards.submit(
                RewardRequest(c.request_id, self.examples[c.prompt_id], self._decode(c.token_ids))
            )
            for c in comps
        ]
        res = [f.result() for f in futs]
        return {
            f"{tag}/accuracy": sum(r.correct for r in res) / len(res),
            f"{tag}/mean_response_len": sum(c.num_tokens for c in comps) / len(comps),
            f"{tag}/time_s": time.perf_counter() - t0,
        }

    def checkpoint(self, step: int) -> Path:
        ck = self.trainer.save_checkpoint(self.run_dir / "checkpoints" / f"step-{step:06d}")
        queue = getattr(self.policy, "queue", None)
        state = {
            "step": step,
            "checkpoint": str(ck.resolve()),
            "cursor": asdict(self.policy.cursor.state),  # type: ignore[attr-defined]
            "queue": [p.prompt_id for p in queue.snapshot()] if queue is not None else [],
            "policy_version": self.trainer.policy_version,
            "trained_samples": self.trained_samples,
            "timeout_anchors": self.timeouts.to_json(),
            "run_id": self.tracker.run_id,
        }
        tmp = self.run_dir / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.run_dir / "state.json")
        return ck

    def run(self, progress: bool = True) -> RunSummary:
        from tqdm import tqdm

        cfg = self.cfg
        t0 = time.perf_counter()
        val0 = self.validate(self.start_step)
        self.tracker.log(val0, step=self.start_step)
        val_end = val0
        bar = tqdm(
            range(self.start_step, cfg.steps),
            desc=f"RL {self.run_dir.name}",
            unit="step",
            disable=not progress,
        )
        for step in bar:
            rec = self.step(step)
            last = step == cfg.steps - 1
            if (step + 1) % cfg.validation.every == 0 or last:
                val_end = self.validate(step + 1)
                rec.metrics.update(val_end)
            self.tracker.log(rec.metrics, step=step + 1)
            self.tracker.append_groups(rec)
            if (step + 1) % cfg.checkpoint_every == 0 or last:
                self.checkpoint(step)
            bar.set_postfix(
                kind=rec.round_kind,
                reward=f"{rec.metrics['reward/mean']:.2f}",
                val=f"{val_end['val/accuracy']:.2f}",
                s=f"{rec.metrics['step/time_s']:.1f}",
            )
        queue = getattr(self.policy, "queue", None)
        summary = RunSummary(
            run_id=self.tracker.run_id,
            run_dir=str(self.run_dir),
            policy=cfg.rollout.policy.value,
            seed=cfg.seed,
            steps=cfg.steps,
            trained_samples=self.trained_samples,
            val_accuracy_start=val0["val/accuracy"],
            val_accuracy_end=val_end["val/accuracy"],
            wall_s=time.perf_counter() - t0,
            records=self.records,
            leftover_queue=[p.prompt_id for p in queue.snapshot()] if queue is not None else [],
        )
        self.tracker.finish(summary)
        return summary

    def close(self) -> None:
        self.stream.close()
        self.rewards.close()
        self.engine.close()


def build_rewards(
    cfg: ExperimentConfig, examples: Sequence[TaskExample], timeouts: AdaptiveTimeout, quiet: bool = False
) -> RewardRouter:
    """One reward function per reward kind the task uses: math-verify workers, the code sandbox
    (adaptive timeouts), the LLM judge."""
    kinds = {ex.reward_kind for ex in examples}
    fns: list[RewardFunction] = []
    if RewardKind.MATH in kinds:
        from rollpacker.rewards.math_rule import MathReward

        fns.append(MathReward(workers=cfg.reward.workers, timeout_s=cfg.reward.timeout_s))
    if RewardKind.CODE in kinds:
        from rollpacker.rewards.code import CodeReward
        from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

        sb = cfg.reward.sandbox
        limits = SandboxLimits(
            wall_s=sb.t_max_s * 2 + 5,
            cpu_s=sb.t_max_s * 2 + 5,
            memory_mb=sb.memory_mb,
            max_procs=sb.max_procs,
        )
        fns.append(CodeReward(Sandbox(limits), timeouts, workers=sb.workers))
    if RewardKind.JUDGE in kinds:
        fns.append(_judge_reward(cfg, quiet))
    router = RewardRouter(fns)
    router.check_covers(examples)
    return router


def _judge_reward(cfg: ExperimentConfig, quiet: bool) -> RewardFunction:
    """The LLM judge, warmed up locally (cached), resident or layer-wise offloaded."""
    from tqdm import tqdm

    from rollpacker.rewards.judge import JudgeConfig, JudgeReward
    from rollpacker.tasks.judge_task import JudgeWarmupSpec, warm_up_judge

    j = cfg.reward.judge
    spec = JudgeWarmupSpec(model=j.preset, steps=j.warmup_steps)
    bar = tqdm(total=spec.steps, desc="judge warm-up (cached)", unit="step", disable=quiet, leave=False)
    try:
        model_dir = warm_up_judge(spec, progress=lambda _s, _l: bar.update(1))
    finally:
        bar.close()
    return JudgeReward(
        model_dir,
        JudgeConfig(
            max_batch=j.max_batch,
            resident_layers=j.resident_layers if j.resident_layers >= 0 else None,
            memory_budget_bytes=int(j.memory_budget_mb * (1 << 20)) if j.memory_budget_mb > 0 else None,
        ),
    )


def _per_kind(results: Sequence[RewardResult], kinds: Sequence[RewardKind]) -> dict[str, float]:
    """Mean reward per reward kind (``reward/<kind>_mean``) when the step mixes kinds."""
    by: dict[str, list[float]] = {}
    for r, k in zip(results, kinds, strict=True):
        by.setdefault(k.value, []).append(r.reward)
    if len(by) < 2:
        return {}
    return {f"reward/{k}_mean": sum(v) / len(v) for k, v in sorted(by.items())}


def prepare_model(cfg: ExperimentConfig, quiet: bool = False) -> Path:
    """The model RL starts from: ``model.model_dir``, or the warmed-up tiny model (cached)."""
    from rollpacker.tasks.warmup import WarmupSpec, warm_up

    if cfg.model.model_dir:
        p = Path(cfg.model.model_dir)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.model_dir = {p}: not a Hugging Face model directory (no config.json)")
        return p
    if cfg.model.warmup_steps == 0:
        from rollpacker.tasks.tiny_model import build_tiny_model

        return build_tiny_model(cfg.model.preset)
    from tqdm import tqdm

    spec = WarmupSpec(
        model=cfg.model.preset,
        steps=cfg.model.warmup_steps,
        code_fraction=_CODE_SHARE.get(cfg.task.name, 0.0),
    )
    bar = tqdm(
        total=spec.steps, desc="warm-up (cached after the first run)", unit="step", disable=quiet, leave=False
    )

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    try:
        return warm_up(spec, progress=progress)
    finally:
        bar.close()


def _latest_state(run_dir: Path) -> dict[str, Any] | None:
    f = run_dir / "state.json"
    if not f.is_file():
        raise ConfigError(f"--resume: {run_dir} has no state.json (no checkpoint was written there yet)")
    return dict(json.loads(f.read_text()))


def _replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)
