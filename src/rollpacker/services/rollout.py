"""The rollout service: the vLLM engine (warm across steps), the policy's round, validation.

Per step it rebuilds the policy from the committed state it is given (cursor, long-prompt queue),
so a re-run after a crash plans exactly the same step; it never keeps cross-step policy state.
While a round runs, each finished response goes to its reward service (``score``) and each final
group to the same service (``group``), which hands the rewarded group to the trainer: the reward
scheduler and the stream trainer overlap with rollout although the KFP stages run one by one.

With DAPO's dynamic sampling (``rollout.dynamic_sampling.enabled``) the round decides on rewards:
each complete group's rewards are asked of its reward service (``group_rewards``, a blocking call
bounded by ``services.call_timeout_s``; the responses' scores mostly started as they finished, so
it waits for the last one or two) before the group is final. A group with reward variance is final
and goes on as above (``group``: the reward service reuses the scores, the trainer gets it); one
without is dropped, so it never reaches the trainer or the long-prompt queue, and the round draws a
replacement prompt. The report names the dropped and the extra prompts (``groups.json`` records
them) and logs ``rollout/dropped_groups`` and ``rollout/extra_prompts``.

With ``rollout.scale_down`` (RollPacker 4.4, Algorithm 1) and engines in layouts, a
``ScaleDownRuntime`` watches each round: once 20-50 % of its requests completed and the rest fit
on fewer replicas (projected KV from the state's length history, capacity from the profile), it
migrates them onto the kept replicas, parks the freed ones and hands their devices to the trainer
(``trainer.repurpose``); the replicas serve again when the round ends, and the trainer gives the
devices back in ``finish``, before the next round. The round reports ``rollout/scaled_down_at``
(the completed fraction; ``_s``: seconds into the round) and what moved.

Invariants:
- the engine serves the weights of the state's checkpoint before a round starts (``sync``);
- one round at a time; a round of a newer attempt supersedes an older one (its requests are
  aborted, nothing of it reaches the rewards or the trainer, which only take the current attempt);
- request ids carry the attempt, so a re-run never reuses an id the engine has seen;
- with dynamic sampling, only groups with reward variance reach ``group`` (and so the trainer);
  a dropped prompt is reported as dropped, never as trained or deferred;
- every replica serves again when a round ends, however it ends (scale-down parks them only
  within the round);
- a weight push (``load_weights``, or ``receive_weights`` of the collective path) holds the round
  lock: no request is sampled on half-loaded weights, and a push that failed half way leaves the
  engine claiming no checkpoint, so the next ``sync`` reloads it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.drafts import history_from_json, history_steps_kept, history_to_json, worth_enabling
from rollpacker.core.errors import EngineError, RollpackerError
from rollpacker.core.latency import Layout, Predictor, ProfileTable, layouts_for, predict_step
from rollpacker.core.policies.base import RolloutPolicy
from rollpacker.core.policies.entries import BufferEntry, buffer_to_json
from rollpacker.core.policies.registry import PolicyInputs, build_policy, cursor_window
from rollpacker.core.prompts import CursorState, PromptCursor
from rollpacker.core.scaledown import LengthHistory
from rollpacker.core.state import ControllerState
from rollpacker.core.tasks import RewardKind
from rollpacker.core.types import (
    Completion,
    EngineStepStats,
    Group,
    Role,
    RoundKind,
    RoundResult,
    SamplingSpec,
)
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines.base import DraftMemory, RequestList, RolloutEngine
from rollpacker.engines.gpus import engine_device
from rollpacker.engines.layout import (
    EnginePool,
    LayoutEngine,
    ScaleDownRuntime,
    SwitchingEngine,
    forget_cached,
    kv_capacity_tokens,
    node_devices,
)
from rollpacker.engines.layout_push import PushTargets
from rollpacker.engines.profiler import ProfileSpec, profile_and_check
from rollpacker.engines.simulated import SimulatedEngine, build_engine
from rollpacker.engines.vllm_engine import VLLMEngine
from rollpacker.rollout.driver import RoundRun, generate, run_round, sample_requests
from rollpacker.services.api import (
    EngineSync,
    Pending,
    ProfileSummary,
    RewardAPI,
    RolloutAPI,
    RoundPlan,
    RoundReport,
    ScoreItem,
    Validation,
    WeightPeer,
    WeightProbe,
    WeightPush,
)
from rollpacker.services.base import Service, checkpoint_cache
from rollpacker.store.base import cached_download
from rollpacker.tasks.models import TaskData, task_data

log = logging.getLogger(__name__)


class Superseded(RollpackerError):
    """A newer attempt of the step took the engine over."""


def reward_role(kind: RewardKind) -> Role:
    """The service that scores a reward kind: the judge LLM, or the rule/sandbox workers."""
    return Role.JUDGE if kind is RewardKind.JUDGE else Role.REWARD


class RolloutService(Service, RolloutAPI):
    def __init__(self, config_text: str, arm: str, role: Role = Role.ROLLOUT) -> None:
        super().__init__(config_text, arm, role)
        self.engine: RolloutEngine | None = None
        self.checkpoint_uri = ""
        self.policy_version = -1
        self.model_dir: Path | None = None
        self._round_lock = threading.Lock()
        self._attempt = ""
        # rounds and validations run since the engine's weights (and its prefix cache) were loaded
        self._rounds_on_weights = 0
        self._pred: Predictor | None = None
        self._pred_uri = ""
        self._wt: tuple[PushTargets, int] | None = None  # the engines in a weight-transfer group, its port
        self._keep_dir = ""  # the collective push's copy for layouts started later (engines/layout_push.py)
        self._probes = 0  # weight-sync probes sampled (each request id is used once per engine)

    # -- weights --------------------------------------------------------------------------------
    def sync(self, state: ControllerState) -> EngineSync:
        """Serve the state's checkpoint: start the engine on it, or load its weights in place."""
        t0 = time.perf_counter()
        self.peers.refresh()  # reward services rebuilt since the last step are the ones to reach
        self._attempt = f"sync@{time.time_ns()}"  # a new step supersedes any round still running
        with self._round_lock:
            return self._sync_locked(state, t0)

    def _sync_locked(self, state: ControllerState, t0: float) -> EngineSync:

        self._drop_if_dead("sync")
        started = reloaded = False
        if self.engine is not None and self.checkpoint_uri == state.checkpoint_uri:
            # the same weights again (a step re-run after a failed attempt, or a step after one
            # whose weights were pushed in place): whatever ran since the weights loaded leaves its
            # cached prefixes, which go, so every step meets the engine as a first attempt does.
            if self._rounds_on_weights:
                forget_cached(self.engine)
                self._rounds_on_weights = 0
            return EngineSync(False, False, 0.0, self.policy_version)
        if state.rollback_step is not None:
            raise RollpackerError(
                f"step {state.step}'s weights ({state.checkpoint_uri}) were only pushed into the engine "
                f"(checkpoint.every = {self.cfg.checkpoint.every}), which no longer serves them: re-run "
                f"the step from its plan, which rolls the arm back to step {state.rollback_step}"
            )
        local = cached_download(self.store(), state.checkpoint_uri, checkpoint_cache())
        model_dir = local / "model" if (local / "model").is_dir() else local
        if self.engine is None:
            cfg = self.cfg
            ecfg = dataclasses.replace(cfg.engine, model_dir=str(model_dir), seed=cfg.seed + cfg.engine.seed)
            ecfg = _without_idle_speculation(ecfg, cfg.rollout.temperature)
            if cfg.planner.devices:
                self.engine = self._start_layouts(ecfg, state.tp_plan.short_tp)
            else:
                if ecfg.kind != "simulated":  # a stand-in engine (engines/simulated.py) holds no device
                    rollout_devices(ecfg, 0, self._given_gpus())  # refuses idle GPUs
                self.engine = build_engine(ecfg)
            self._restore_drafts()
            started = True
        else:
            self.engine.load_weights(_read_safetensors(model_dir))
            reloaded = True
        self.model_dir = model_dir
        self.checkpoint_uri = state.checkpoint_uri
        self.policy_version = state.policy_version
        self._rounds_on_weights = 0
        return EngineSync(started, reloaded, time.perf_counter() - t0, self.policy_version)

    def _drop_if_dead(self, during: str) -> bool:
        """Close and forget an engine whose core process died, so the next sync starts a fresh
        one on the committed checkpoint (a dead vLLM engine never serves again)."""

        eng = self.engine
        if eng is None or not eng.dead:
            return False
        log.warning(
            "rollout service: the engine died (seen during %s); the next sync starts a new one", during
        )
        self.engine = None
        self.checkpoint_uri = ""
        self._rounds_on_weights = 0
        try:
            eng.close()
        except Exception as e:  # a half-dead engine may fail to close; its processes are gone
            log.warning("rollout service: closing the dead engine failed: %s", e)
        return True

    def _engine_or_fail(self, call: str) -> RolloutEngine:
        if self.engine is None:
            raise RollpackerError(
                f"rollout service: no engine for {call} (its engine died or was closed since the "
                "last sync); the step's next attempt syncs and starts a new one"
            )
        return self.engine

    def _start_layouts(self, ecfg: EngineConfig, first_tp: int = 0) -> SwitchingEngine:
        """The engines of every layout of ``planner.devices`` devices, behind a switching engine
        (the round's TP, from the state's TP plan, picks the layout; PAT may switch inside the
        round). The layout of ``first_tp`` (the state's short-round TP; 0: planner.initial_tp)
        starts first: on GPUs it may be the only one started (``resident_layouts``)."""

        pc = self.cfg.planner
        devices = rollout_devices(ecfg, pc.devices, self._given_gpus())
        tp = max(pc.min_tp, min(first_tp or pc.initial_tp, pc.max_tp, pc.devices))
        initial = Layout(tp, pc.devices // tp)
        # the planner never leaves [min_tp, max_tp]: a layout outside it would never serve
        others = [lay for lay in layouts_for(pc.devices, pc.max_tp) if lay.tp >= pc.min_tp and lay != initial]
        layouts = (initial, *others)
        pool = EnginePool(ecfg, layouts, devices)
        pool.warm()
        return SwitchingEngine(
            pool, None, initial, check_every=pc.check_every, min_gain_s=pc.min_gain_s, enabled=False
        )

    @staticmethod
    def _given_gpus() -> list[str] | None:
        """The GPUs Ray gave this actor (``ray.get_gpu_ids()``), None outside a Ray worker."""
        import sys

        ray = sys.modules.get("ray")  # a Ray actor has it loaded; in-process services do not
        if ray is None or not ray.is_initialized():
            return None
        try:
            ids = ray.get_gpu_ids()
        except Exception:  # the driver, not a worker
            return None
        return [str(i) for i in ids] or None

    def _predictor(self, profile_uri: str) -> Predictor | None:
        """The latency predictor of the state's profile (cached per URI), or None without one."""

        if not profile_uri:
            return None
        if self._pred_uri != profile_uri:
            doc = self.store().get_json(self.store().key_of(profile_uri))
            table = ProfileTable.from_dict(doc.get("table", doc), profile_uri)
            self._pred = Predictor(table, switch_overhead_s=self.cfg.planner.switch_overhead_s)
            self._pred_uri = profile_uri
        return self._pred

    def _prepare_layout(self, state: ControllerState, round_kind: RoundKind) -> dict[str, float]:
        """Put the round on the planned layout (short and long rounds keep their own TP)."""

        eng = self.engine
        if not isinstance(eng, SwitchingEngine):
            return {}
        pc = self.cfg.planner
        tp = state.tp_plan.long_tp if round_kind is RoundKind.LONG else state.tp_plan.short_tp
        tp = max(pc.min_tp, min(tp, pc.max_tp, pc.devices))
        eng.set_layout(Layout(tp, pc.devices // tp))
        eng.predictor = self._predictor(state.profile_uri)
        eng.enabled = pc.switching and eng.predictor is not None
        eng.events.clear()
        eng.trajectory.clear()
        eng.record = True
        return {"rollout/tp": float(tp), "rollout/dp": float(pc.devices // tp)}

    def _layout_metrics(self) -> tuple[dict[str, float], float]:
        """Switches made in the round, and the predictor's view of its decode steps; with the
        drift that triggers a re-profile (0.0 without a prediction)."""

        eng = self.engine
        if not isinstance(eng, SwitchingEngine):
            return {}, 0.0
        eng.record = False
        out = {
            "rollout/switches": float(len(eng.events)),
            "rollout/switch_s": sum(e.seconds for e in eng.events),
            "rollout/tp_end": float(eng.current.tp),
        }
        drift = 0.0
        if eng.predictor is not None and eng.trajectory:
            pred = sum(predict_step(eng.predictor, lay, st) for lay, st in eng.trajectory)
            meas = sum(st.seconds for _, st in eng.trajectory)
            drift = abs(pred - meas) / meas if meas > 0 else 0.0
            out.update(
                {
                    "planner/predicted_decode_s": pred,
                    "planner/measured_decode_s": meas,
                    "planner/drift": drift,
                }
            )
        return out, drift

    def load_weights(self, policy_version: int, checkpoint_uri: str, weights: dict[str, Any]) -> float:
        """The trainer's new weights, pushed in place after its update; returns the seconds taken."""
        t0 = time.perf_counter()
        with self._round_lock:
            if self._drop_if_dead("load_weights") or self.engine is None:
                # rebuilt, or its engine died, since the state was synced: the next sync starts an
                # engine on the committed checkpoint, which holds these weights
                log.warning("rollout service: no engine to load weights into; the next step syncs them")
                return 0.0
            try:
                self.engine.load_weights(weights.items())
            except Exception:
                if self._drop_if_dead("load_weights"):
                    log.warning("rollout service: the engine died loading weights; the next step syncs them")
                    return 0.0
                raise
            self.policy_version = policy_version
            self.checkpoint_uri = checkpoint_uri
            self._rounds_on_weights = 0  # the engine dropped its prefix cache with the old weights
        return time.perf_counter() - t0

    def probe(self, prompts: int, max_tokens: int) -> WeightProbe:
        """The weight-sync probe's engine side: ``max_tokens`` seeded samples (EOS ignored) on the
        task's first ``prompts`` training prompts with the served weights (core/fidelity.py)."""
        with self._round_lock:
            if self._drop_if_dead("probe") or self.engine is None:
                return WeightProbe(self.policy_version, (), (), ())  # the next sync loads the checkpoint
            chosen = self.data().train_prompts[:prompts]
            sp = SamplingSpec(
                max_tokens=max_tokens,
                temperature=self.cfg.rollout.temperature,
                seed=self.cfg.seed,
                ignore_eos=True,
            )
            # an id of its own per probe: a re-run of the step probes the same version again, and
            # vLLM refuses a request id it has seen
            self._probes += 1
            tag = f"probe/{self.arm}/v{self.policy_version}/{self._probes}"
            reqs = sample_requests(chosen, 1, sp, tag)
            try:
                comps = generate(self.engine, reqs)
            except BaseException:
                self._drop_if_dead("probe")
                raise
        return WeightProbe(
            policy_version=self.policy_version,
            prompt_ids=tuple(p.token_ids for p in chosen),
            response_ids=tuple(c.token_ids for c in comps),
            logprobs=tuple(c.logprobs for c in comps),
        )

    # -- the collective weight push (train.weight_sync: collective) ---------------------------------
    def _push_targets(self, call: str) -> PushTargets:
        """The engines a push reaches now (one engine, or every started layout's replicas)."""
        self._drop_if_dead(call)
        if self.engine is None:
            raise RollpackerError(
                f"{call}: train.weight_sync: collective needs a running vLLM engine, and this rollout "
                "service has none; the trainer pushes through the object store instead"
            )
        if not self._keep_dir and isinstance(self.engine, SwitchingEngine):  # for layouts started later
            self._keep_dir = tempfile.mkdtemp(prefix="rollpacker-pushed-", dir=_shared_memory_dir())
        try:
            return PushTargets(self.engine, self._keep_dir)
        except EngineError as e:
            raise RollpackerError(f"{call}: {e}; the trainer pushes through the object store instead") from e

    def weight_peer(self, port: int) -> WeightPeer:
        with self._round_lock:
            targets = self._push_targets("weight_peer")
            joined = self._wt is not None and self._wt[1] == port and self._wt[0].key == targets.key
            return WeightPeer(targets.workers, joined)

    def init_weight_transfer(self, group: TransferGroup) -> None:
        with self._round_lock:
            targets = self._push_targets("init_weight_transfer")
            self._wt = None
            targets.join(group)
            self._wt = (targets, group.port)

    def receive_weights(self, policy_version: int, checkpoint_uri: str) -> WeightPush:
        """The push, received while no round runs (the round lock): no request is ever sampled on
        half-loaded weights; a digest mismatch leaves the engine unusable until the next sync."""
        t0 = time.perf_counter()
        with self._round_lock:
            targets = self._push_targets("receive_weights")
            if self._wt is None or self._wt[0].key != targets.key:
                raise RollpackerError(
                    "receive_weights: the engines changed since they joined the weight transfer group "
                    "(a layout started or closed); the trainer opens a new group at its next push"
                )
            try:
                reports = self._wt[0].receive(policy_version)
            except Exception:
                self.checkpoint_uri = ""  # a mix of old and new weights: the next sync reloads them
                raise
            self.policy_version = policy_version
            self.checkpoint_uri = checkpoint_uri
            self._rounds_on_weights = 0  # the engine dropped its prefix cache with the old weights
        r = reports[0]
        return WeightPush(time.perf_counter() - t0, len(reports), r.buckets, r.payload_bytes)

    def holds(self, checkpoint_uri: str) -> bool:
        with self._round_lock:
            return (
                not self._drop_if_dead("holds")
                and self.engine is not None
                and (self.checkpoint_uri == checkpoint_uri)
            )

    # -- planning ---------------------------------------------------------------------------------
    def data(self) -> TaskData:
        if self.model_dir is None:
            raise RollpackerError("rollout service: sync(state) first (no model loaded)")
        t = self.cfg.task
        model = str(self.model_dir)
        return task_data(self.dataset(), t.seed, t.num_examples, t.val_size, model, t.shape.items())

    def _policy(self, state: ControllerState, attempt: str) -> RolloutPolicy:
        """The arm's policy for one step, rebuilt from the committed state."""
        data = self.data()
        r = self.cfg.rollout
        in_flight = r.partial.in_flight or min(
            self._concurrency(), r.prompts_per_step * r.responses_per_prompt
        )
        cursor = PromptCursor(
            data.train_prompts,
            seed=state.cursor_seed,
            state=CursorState(state.cursor_seed, state.cursor_epoch, state.cursor_position),
            window=min(cursor_window(r, in_flight), len(data.train_prompts) // 2),
        )
        spec = SamplingSpec(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p)
        inputs = PolicyInputs(
            rollout=r,
            cursor=cursor,
            sampling=lambda _p, _j: spec,
            prompts=data.by_id,
            long_queue=state.long_queue,
            buffer=state.partial_cache,
            policy_version=state.policy_version,
            in_flight=in_flight,
            namespace=f"{self.arm}/{attempt}",
        )
        return build_policy(r.policy.value, inputs)

    def _concurrency(self) -> int:
        eng = self.engine
        return int(eng.concurrency) if eng is not None else self.cfg.engine.max_num_seqs

    def plan(self, state: ControllerState, step: int) -> RoundPlan:
        plan = self._policy(state, "plan").plan_step(step)
        return RoundPlan(
            round_kind=plan.round_kind,
            prompts=tuple(p.prompt_id for p in plan.prompts),
            from_queue=tuple(plan.from_queue),
            target_prompts=plan.target_prompts,
            roles=tuple(sorted({reward_role(ex.reward_kind) for ex in self.data().examples.values()})),
        )

    # -- the round --------------------------------------------------------------------------------
    def begin_round(self, state: ControllerState, step: int, attempt: str) -> Pending[RoundReport]:
        return self._run_ahead("round", attempt, RoundReport, lambda: self.run_round(state, step, attempt))

    def run_round(self, state: ControllerState, step: int, attempt: str) -> RoundReport:
        """Roll out step ``step`` of ``attempt``; finished responses and groups go to the reward
        services while the round runs."""
        self._attempt = attempt  # an older round still running sees this and stops
        with self._round_lock:
            if self._attempt != attempt:
                raise Superseded(f"step {step}: attempt {attempt} was superseded before it started")
            policy = self._policy(state, attempt)
            plan = policy.plan_step(step)
            rnd = policy.open_round(plan)
            # every prompt's kind: dynamic sampling draws prompts beyond the plan during the round
            kinds = {pid: ex.reward_kind for pid, ex in self.data().examples.items()}
            calls = _RewardCalls(self, step, attempt, kinds, _tokenizer(str(self.model_dir)))
            layout_metrics = self._prepare_layout(state, plan.round_kind)
            scaler = self._scale_down(state, attempt)

            def on_step(_stats: EngineStepStats, completed: int) -> None:
                self._check_running(step, attempt)
                if scaler is not None:
                    scaler.observe(completed)

            engine = self._engine_or_fail("the round")
            self._remember_cached(state)
            self._rounds_on_weights += 1
            try:
                run = run_round(
                    engine,
                    rnd,
                    policy_version=self.policy_version,
                    on_group=calls.group,
                    on_response=calls.score if self.cfg.reward.per_response else None,
                    on_step=on_step,
                    group_rewards=calls.group_rewards if rnd.needs_rewards else None,
                )
            except Superseded:
                if not self._drop_if_dead("the round"):
                    self._drain_engine()
                raise
            except BaseException:
                self._drop_if_dead("the round")
                raise
            finally:
                if scaler is not None:  # every replica serves again, however the round ended
                    layout_metrics.update(scaler.close().logged())
            policy.commit(run.result)  # this attempt's policy object only: the next state's cursor/queue
            self._persist_drafts(step, run.result.groups)
            return self._report(step, attempt, policy, run, kinds, layout_metrics)

    def _check_running(self, step: int, attempt: str) -> None:
        """Stop the round when a newer attempt took over or a reward service failed."""
        if self._attempt != attempt:
            raise Superseded(f"step {step}: attempt {attempt} superseded by {self._attempt}")
        failed = self.peers.cast_failure(attempt)
        if failed is not None:  # a reward service raised or died: its rewards will never come
            raise RollpackerError(f"step {step}: the round of attempt {attempt} stops: {failed}")

    # -- draft history (engine.speculation) -------------------------------------------------------
    def _drafts_kept(self) -> bool:
        spec = self.cfg.engine.speculation
        return spec.enabled and "history" in spec.sources and spec.history_prompts > 0

    def _drafts_prefix(self) -> str:
        return f"{self.cfg.experiment}/{self.arm}/drafts/"

    def _persist_drafts(self, step: int, groups: Sequence[Group]) -> None:
        """The round's responses by prompt, to the store (a re-run of the step overwrites them), so
        that an engine started later drafts from them; the oldest beyond ``history_prompts``
        prompts' worth of steps are deleted."""
        if not self._drafts_kept() or not groups:
            return
        spec = self.cfg.engine.speculation
        per = spec.history_per_prompt
        by_prompt = {g.prompt.prompt_id: [c.token_ids for c in g.responses[-per:]] for g in groups}
        store, prefix = self.store(), self._drafts_prefix()
        store.put_bytes(f"{prefix}step-{step:06d}/responses.json", history_to_json(step, by_prompt).encode())
        keep = history_steps_kept(spec, self.cfg.rollout.prompts_per_step)
        for key in sorted(store.list(prefix))[:-keep]:
            store.delete_prefix(key.rpartition("/")[0] + "/")

    def _restore_drafts(self) -> None:
        """Seed a newly started engine's draft store from the newest persisted rounds (oldest
        first, so the newest responses win); a malformed document is skipped with a warning."""
        engine = self.engine
        if not self._drafts_kept() or not isinstance(engine, DraftMemory):
            return
        store = self.store()
        keep = history_steps_kept(self.cfg.engine.speculation, self.cfg.rollout.prompts_per_step)
        taken = 0
        for key in sorted(store.list(self._drafts_prefix()))[-keep:]:
            try:
                taken += engine.remember_drafts(history_from_json(store.get_bytes(key), store.uri(key)))
            except RollpackerError as e:
                log.warning("draft history skipped: %s", e)
        if taken:
            log.info("draft history: %d prompts' responses from the store", taken)

    def _remember_cached(self, state: ControllerState) -> None:
        """The partial-rollout cache's responses as drafts for their prompts' siblings."""
        engine = self.engine
        if self._drafts_kept() and state.partial_cache and isinstance(engine, DraftMemory):
            engine.remember_drafts(
                {e.prompt_id: [x.token_ids for x in e.samples] for e in state.partial_cache if e.samples}
            )

    def _scale_down(self, state: ControllerState, attempt: str) -> ScaleDownRuntime | None:
        """Algorithm 1 for this round (``rollout.scale_down.enabled`` on engines in layouts)."""
        sd, eng = self.cfg.rollout.scale_down, self.engine
        if not sd.enabled or not isinstance(eng, SwitchingEngine):
            return None
        history = LengthHistory.from_lengths(
            (min(n, self.cfg.rollout.max_tokens) for _, n in state.length_history),
            self.cfg.rollout.max_tokens,
        )

        def capacity(layout: Layout) -> int:
            pred = eng.predictor
            if pred is not None and layout in pred.candidates:
                return int(pred.kv_capacity(layout))
            return kv_capacity_tokens(eng.pool[layout])  # no profile yet: the engine's own figure

        def release(devices: tuple[str, ...]) -> None:
            self.peers.trainer().repurpose(attempt, devices)

        return ScaleDownRuntime(eng, sd, history, capacity, release)

    def _report(
        self,
        step: int,
        attempt: str,
        policy: RolloutPolicy,
        run: RoundRun,
        kinds: dict[str, RewardKind],
        layout_metrics: dict[str, float],
    ) -> RoundReport:
        result = run.result
        queue, buffer = policy.long_queue(), policy.rollout_buffer()
        switch_metrics, drift = self._layout_metrics()
        return RoundReport(
            step=step,
            attempt=attempt,
            round_kind=result.plan.round_kind,
            trained=tuple(g.prompt.prompt_id for g in result.groups),
            deferred=tuple(p.prompt_id for p in result.deferred),
            from_queue=tuple(result.plan.from_queue),
            groups_by_role=_count_roles(result.groups, kinds),
            lengths=tuple(c.num_tokens for g in result.groups for c in g.responses),
            longest=tuple(
                (g.prompt.prompt_id, max(c.num_tokens for c in g.responses)) for g in result.groups
            ),
            next_cursor=policy.cursor.state,
            next_queue=tuple(p.prompt_id for p in queue),
            # the buffer (cached tokens and logprobs) is too big for a KFP task argument: it goes
            # to the store, and the commit copies it into the state document
            next_buffer_uri=self._put_buffer(step, attempt, buffer) if buffer else "",
            dropped=tuple(p.prompt_id for p in result.filtered),
            extra=tuple(p.prompt_id for p in result.extra_prompts),
            metrics={
                **run.metrics.logged(len(queue)),
                **self._dynamic_sampling_metrics(result),
                "rollout/buffer_size": float(len(buffer)),
                "rollout/buffer_samples": float(sum(len(e.samples) for e in buffer)),
                **layout_metrics,
                **switch_metrics,
            },
            preemptions=run.metrics.preemptions,
            decode_drift=drift,
            end_wall=time.time(),
        )

    def _dynamic_sampling_metrics(self, result: RoundResult) -> dict[str, float]:
        """``rollout/extra_prompts`` (drawn beyond the plan) and ``rollout/dropped_groups`` (no
        reward variance: neither trained nor queued), with DAPO's dynamic sampling on."""
        if not self.cfg.rollout.dynamic_sampling.enabled:
            return {}
        return {
            "rollout/extra_prompts": float(len(result.extra_prompts)),
            "rollout/dropped_groups": float(len(result.filtered)),
        }

    def _put_buffer(self, step: int, attempt: str, buffer: Sequence[BufferEntry]) -> str:
        key = f"{self.cfg.experiment}/{self.arm}/buffers/step-{step:06d}-{attempt}.json"
        return self.store().put_bytes(key, buffer_to_json(buffer).encode(), "application/json")

    def _drain_engine(self) -> None:
        engine = self.engine
        if engine is None:
            return
        live = engine.live_request_ids() if isinstance(engine, RequestList) else []
        if live:
            engine.abort(live)
        for _ in range(10_000):
            if not engine.has_unfinished():
                break
            engine.step()

    # -- validation and profiling -----------------------------------------------------------------
    def validate(self, step: int, attempt: str) -> Validation:
        """Accuracy on the held-out split under the served weights, scored by the reward services."""
        with self._round_lock:
            data = self.data()
            v = self.cfg.validation
            sp = SamplingSpec(max_tokens=v.max_tokens, temperature=v.temperature)
            prompts = data.train_prompts if v.split == "train" else data.val_prompts
            reqs = sample_requests(prompts, v.samples, sp, f"val/{self.arm}/{attempt}/s{step}")
            t0 = time.perf_counter()
            engine = self._engine_or_fail("validation")
            self._rounds_on_weights += 1  # its prompts' prefixes are cached too
            try:
                comps = generate(engine, reqs)
            except BaseException:
                self._drop_if_dead("validation")
                raise
        tok = _tokenizer(str(self.model_dir))
        by_role: dict[Role, list[ScoreItem]] = {}
        for c in comps:
            role = reward_role(data.examples[c.prompt_id].reward_kind)
            text = tok.decode(list(c.token_ids), skip_special_tokens=True)
            by_role.setdefault(role, []).append(ScoreItem(c.request_id, c.prompt_id, text))
        correct: list[bool] = []
        for role, items in sorted(by_role.items()):
            correct.extend(self.peers.reward(role).score_now(tuple(items)))
        return Validation(
            accuracy=sum(correct) / len(correct),
            mean_response_len=sum(c.num_tokens for c in comps) / len(comps),
            time_s=time.perf_counter() - t0,
        )

    def profile(self, key: str) -> ProfileSummary:
        """Profile the served engines (every layout, or the one engine) over the planner's grid,
        check the predictor on real decoding of validation prompts, and write the document to the
        store at ``key``."""

        pc = self.cfg.planner
        with self._round_lock:
            eng = self._engine_or_fail("profiling")
            if isinstance(eng, SwitchingEngine):
                pool = eng.pool
            elif isinstance(eng, (VLLMEngine, SimulatedEngine)):  # one engine: the single layout tp x 1
                single = LayoutEngine(Layout(eng.tp_size, 1), [eng])
                pool = EnginePool.of({single.layout: single}, eng.cfg)
            else:
                raise RollpackerError(
                    f"profiling measures vLLM engines; this service runs {type(eng).__name__}"
                )
            spec = ProfileSpec.for_planner(pc, pool.layouts, self.cfg.engine.max_num_seqs, self.cfg.seed)
            data = self.data()
            try:
                doc = profile_and_check(
                    pool,
                    spec,
                    data.val_prompts[: min(64, len(data.val_prompts))],
                    self.cfg.rollout.max_tokens,
                    self.cfg.validation.temperature,
                )
            except BaseException:
                self._drop_if_dead("profiling")
                raise
        uri = self.store().put_json(key, doc)
        return ProfileSummary(
            uri=uri,
            points=sum(len(x["points"]) for x in doc["table"]["layouts"]),
            window_error={k: float(v["window_mape"]) for k, v in doc["validation"].items()},
            seconds=float(doc.get("seconds", 0.0)),
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self._keep_dir:
            shutil.rmtree(self._keep_dir, ignore_errors=True)
            self._keep_dir = ""


def _shared_memory_dir() -> str | None:
    """``/dev/shm`` where this node has it (memory: where the object-store path's push would have
    gone through Ray's object store; the pod's ``/tmp`` is sized for checkpoints), else None (the
    temp directory)."""
    import os

    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


class _RewardCalls:
    """What a round sends its reward services (the one each prompt's kind routes to): each finished
    response (``score``), each complete group's rewards when the round decides on them (dynamic
    sampling: ``group_rewards``, a blocking call), each final group (``group``: it goes on to the
    trainer; a dropped group never gets here)."""

    def __init__(
        self, svc: RolloutService, step: int, attempt: str, kinds: dict[str, RewardKind], tok: Any
    ) -> None:
        self.svc, self.step, self.attempt, self.kinds, self.tok = svc, step, attempt, kinds, tok
        self._texts: dict[str, tuple[str, ...]] = {}  # decoded for group_rewards, reused by group

    def _peer(self, prompt_id: str) -> RewardAPI:
        return self.svc.peers.reward(reward_role(self.kinds[prompt_id]))

    def _decode(self, g: Group) -> tuple[str, ...]:
        texts = self._texts.pop(g.prompt.prompt_id, None)
        if texts is None:
            texts = tuple(self.tok.decode(list(c.token_ids), skip_special_tokens=True) for c in g.responses)
        return texts

    def score(self, c: Completion) -> None:
        text = self.tok.decode(list(c.token_ids), skip_special_tokens=True)
        self._peer(c.prompt_id).score(self.attempt, c.request_id, c.prompt_id, text)

    def group_rewards(self, g: Group) -> tuple[float, ...]:
        self.svc._check_running(self.step, self.attempt)  # a failed or newer attempt: no wait
        texts = self._decode(g)
        got = self._peer(g.prompt.prompt_id).group_rewards(self.attempt, g, texts)
        if got.prompt_id != g.prompt.prompt_id or len(got.rewards) != len(g.responses):
            raise RollpackerError(
                f"reward service answered {len(got.rewards)} rewards for {got.prompt_id!r}; "
                f"asked for {len(g.responses)} of {g.prompt.prompt_id!r}"
            )
        self._texts[g.prompt.prompt_id] = texts
        return got.rewards

    def group(self, g: Group) -> None:
        self._peer(g.prompt.prompt_id).group(self.attempt, g, self._decode(g))


def rollout_devices(ecfg: EngineConfig, planned: int, given_gpus: Sequence[str] | None = None) -> list[str]:
    """The devices the rollout engines use: ``planned`` (``planner.devices``; 0: one engine of
    ``engine.tensor_parallel_size``) of this node's. On CUDA they are exactly the GPUs this service
    was given (Ray's ``get_gpu_ids()``, else the visible ones), so engines x TP use every one of
    them; a mismatch is refused, since a GPU left out sits idle for the whole run."""
    if engine_device(ecfg.device) != "cuda":
        cores = node_devices(ecfg.device)
        if len(cores) < planned:
            raise RollpackerError(
                f"planner.devices = {planned} but this node offers {len(cores)} ({','.join(cores)}); "
                "lower planner.devices"
            )
        return cores[:planned]
    have = list(given_gpus) if given_gpus else node_devices(ecfg.device)
    need = planned or ecfg.tensor_parallel_size
    if len(have) != need:
        tp = ecfg.tensor_parallel_size
        what = (
            f"planner.devices = {planned}" if planned else f"one engine of engine.tensor_parallel_size = {tp}"
        )
        raise RollpackerError(
            f"the rollout service holds {len(have)} GPUs ({','.join(have)}) but {what} uses {need}: "
            f"set planner.devices = {len(have)} (engines x TP = the rollout GPUs), or give the rollout "
            "service that many GPUs"
        )
    return have


def _without_idle_speculation(ecfg: EngineConfig, temperature: float) -> EngineConfig:
    """``ecfg`` with speculation off when its engine would draft nothing for the rollout's sampled
    requests (``sampled: auto`` where vLLM's expand kernel is wrong even with the override,
    ``engines/verification.py``): vLLM's speculative step costs time even then."""
    from rollpacker.engines.speculation import platform_verifies_sampled_exactly

    spec = ecfg.speculation
    if not spec.enabled or worth_enabling(spec, temperature, platform_verifies_sampled_exactly()):
        return ecfg
    log.warning(
        "engine.speculation is on, but this engine cannot verify drafts of sampled requests exactly "
        "(vLLM's expand kernel failed its probe; sampled: auto) and the rollout samples at temperature "
        "%g: running without vLLM's speculative path, which costs time even when it drafts nothing",
        temperature,
    )
    return dataclasses.replace(ecfg, speculation=dataclasses.replace(spec, enabled=False))


def _count_roles(groups: Sequence[Group], kinds: dict[str, RewardKind]) -> dict[Role, tuple[str, ...]]:
    out: dict[Role, list[str]] = {Role.REWARD: [], Role.JUDGE: []}
    for g in groups:
        out[reward_role(kinds[g.prompt.prompt_id])].append(g.prompt.prompt_id)
    return {k: tuple(v) for k, v in out.items()}


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _read_safetensors(model_dir: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        out.extend(load_file(str(f)).items())
    if not out:
        raise RollpackerError(f"{model_dir}: no *.safetensors weights in the checkpoint")
    if not any(n == "lm_head.weight" for n, _ in out):
        # tied embeddings: vLLM on CPU keeps a separate packed lm_head (see TorchTrainer.weights)
        emb = dict(out).get("model.embed_tokens.weight")
        if emb is not None:
            out.append(("lm_head.weight", emb))
    return out
