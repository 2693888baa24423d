"""Engines arranged in a parallel layout, and a rollout engine that switches layout mid-step (PAT).

- ``LayoutEngine``: ``dp`` vLLM replicas of TP size ``tp`` behind the rollout engine port. Each
  replica's engine core runs in its own process pinned to its own devices (CPU cores here,
  GPUs on a cluster), so replicas decode side by side while one driver thread steps them in turn.
  A request goes to the replica with the fewest unfinished requests.
- ``EnginePool``: the warm engines of every candidate layout of one node (started once, kept
  while memory allows), with in-place weight loading into all of them.
- ``SwitchingEngine``: the port over a pool. Every ``check_every`` steps it asks PAT's Algorithm 1
  (``rollpacker.core.latency.choose_layout``) whether another layout finishes the unfinished
  requests sooner, switch cost included, and if so switches by **recompute migration**: it aborts
  the unfinished requests, keeps the tokens and logprobs they generated, and resubmits each as
  prompt + generated tokens with the remaining ``max_tokens`` to the new layout's engines (DP
  replicas merged into fewer, larger-TP engines, or split the other way). The caller sees one
  seamless stream per request: no token is lost or repeated, and every token keeps the logprob
  it was sampled with.

Invariants (tests/engines/test_layout.py, on real vLLM):
- a request's reported tokens are exactly the tokens it was generated with, across any switch,
  and it never gets more than its ``max_tokens``;
- every added request finishes exactly once (or is aborted by the caller);
- ``num_preemptions`` sums every engine of every layout (non-decreasing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import EngineError
from rollpacker.core.latency import (
    Layout,
    Predictor,
    ReplicaLoad,
    SwitchDecision,
    TrajectoryStep,
    choose_layout,
)
from rollpacker.core.types import EngineStepStats, GenerationRequest, Prompt, RequestUpdate, SamplingSpec

log = logging.getLogger(__name__)
_ENV_LOCK = threading.Lock()


def device_groups(layout: Layout, devices: Sequence[str]) -> list[list[str]]:
    """The devices of each replica: consecutive groups of ``tp`` (TP stays within a group)."""
    if len(devices) < layout.devices:
        raise EngineError(
            f"layout {layout.name} needs {layout.devices} devices, this node has {len(devices)} "
            f"({','.join(devices)}); lower planner.max_tp / the candidate layouts"
        )
    return [list(devices[i * layout.tp : (i + 1) * layout.tp]) for i in range(layout.dp)]


def node_devices() -> list[str]:
    """This node's devices: GPUs when vLLM runs on CUDA, otherwise the CPU cores we may use."""
    if os.environ.get("ROLLPACKER_VLLM_DEVICE", "cpu") != "cpu":
        vis = os.environ.get("CUDA_VISIBLE_DEVICES")
        if vis:
            return [d for d in vis.split(",") if d]
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    return [str(c) for c in sorted(os.sched_getaffinity(0))]


def _replica_env(group: Sequence[str]) -> dict[str, str]:
    if os.environ.get("ROLLPACKER_VLLM_DEVICE", "cpu") != "cpu":
        return {"CUDA_VISIBLE_DEVICES": ",".join(group)}
    # one core list per TP rank, ranks separated by "|" (vLLM's CPU worker binding)
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(group)}


def start_replica(cfg: EngineConfig, tp: int, group: Sequence[str], index: int = 0) -> Any:
    """One vLLM engine of TP ``tp`` pinned to ``group``, its engine core in its own process.
    Replica ``index`` samples with seed ``engine.seed + index``: replicas never draw the same
    random stream."""
    from rollpacker.engines.vllm_engine import VLLMEngine

    env = _replica_env(group)
    with _ENV_LOCK:  # the engine's processes inherit the environment at start
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            return VLLMEngine(
                dataclasses.replace(cfg, tensor_parallel_size=tp, seed=cfg.seed + index),
                in_process=False,
            )
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@dataclass
class _Held:
    replica: int
    context: int  # tokens the engine holds for it (prompt + prefix + generated)
    generated: int  # tokens generated for it on this layout
    max_tokens: int
    started: bool = False  # produced its first token on this layout (prefill done)


class LayoutEngine:
    """``dp`` replicas of TP ``tp`` behind the rollout engine port."""

    def __init__(self, layout: Layout, replicas: Sequence[Any], virtual: bool = False) -> None:
        """``virtual``: the replicas are simulated (``FakeEngine``); a step lasts as long as the
        slowest replica's step, on a virtual clock."""
        if len(replicas) != layout.dp:
            raise EngineError(f"layout {layout.name} needs {layout.dp} replicas, got {len(replicas)}")
        self.layout = layout
        self.virtual = virtual
        self._clock = 0.0
        self.replicas = list(replicas)
        self._held: dict[str, _Held] = {}
        self.startup_s = sum(getattr(r, "startup_s", 0.0) for r in replicas)

    @classmethod
    def start(cls, cfg: EngineConfig, layout: Layout, devices: Sequence[str]) -> LayoutEngine:
        reps = []
        try:
            for i, group in enumerate(device_groups(layout, devices)):
                reps.append(start_replica(cfg, layout.tp, group, i))
        except BaseException:
            for r in reps:
                r.close()
            raise
        return cls(layout, reps)

    # -- port ---------------------------------------------------------------------------------
    @property
    def concurrency(self) -> int:
        return sum(int(r.concurrency) for r in self.replicas)

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def vocab_size(self) -> int:
        return int(self.replicas[0].vocab_size)

    @property
    def eos_token_id(self) -> int:
        return int(self.replicas[0].eos_token_id)

    def now(self) -> float:
        return self._clock if self.virtual else time.perf_counter()

    def add_request(self, request: GenerationRequest) -> None:
        counts = [0] * len(self.replicas)
        for h in self._held.values():
            counts[h.replica] += 1
        i = min(range(len(self.replicas)), key=lambda k: counts[k])
        self.replicas[i].add_request(request)
        self._held[request.request_id] = _Held(
            i, len(request.engine_input_ids), 0, request.sampling.max_tokens
        )

    def abort(self, request_ids: Sequence[str]) -> None:
        by_rep: dict[int, list[str]] = {}
        for rid in request_ids:
            h = self._held.pop(rid, None)
            if h is not None:
                by_rep.setdefault(h.replica, []).append(rid)
        for i, ids in by_rep.items():
            self.replicas[i].abort(ids)

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        start = time.perf_counter()
        updates: list[RequestUpdate] = []
        stats = []
        for rep in self.replicas:
            if rep.has_unfinished():
                ups, st = rep.step()
                updates.extend(ups)
                stats.append(st)
        for u in updates:
            h = self._held.get(u.request_id)
            if h is None:
                continue
            n = len(u.new_token_ids)
            h.context += n
            h.generated += n
            h.started = h.started or n > 0
            if u.finished:
                del self._held[u.request_id]
        dur = time.perf_counter() - start
        if stats:
            # replicas step side by side: the pass lasts as long as its slowest replica step
            # (their engine cores' own step times; wall time around a pass includes run-ahead)
            dur = max(s.duration_s for s in stats)
        if self.virtual:
            start = self._clock
            dur = max((s.duration_s for s in stats), default=0.0)
            self._clock += dur
        return updates, EngineStepStats(
            start_s=start,
            duration_s=dur,
            num_running=sum(s.num_running for s in stats),
            num_waiting=sum(s.num_waiting for s in stats),
            num_preemptions_total=self.num_preemptions(),
            kv_cache_usage=max((s.kv_cache_usage for s in stats), default=0.0),
        )

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def num_preemptions(self) -> int:
        return sum(int(r.num_preemptions()) for r in self.replicas)

    def kv_cache_usage(self) -> float:
        return max(float(r.kv_cache_usage()) for r in self.replicas)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        weights = list(named_tensors)  # each replica's engine takes its own copy
        for r in self.replicas:
            r.load_weights(iter(weights))

    def close(self) -> None:
        for r in self.replicas:
            r.close()
        self._held.clear()

    # -- what the predictor needs --------------------------------------------------------------
    def loads(self) -> list[tuple[int, int]]:
        """Per replica: (requests decoding, their context tokens)."""
        out = [[0, 0] for _ in self.replicas]
        for h in self._held.values():
            out[h.replica][0] += 1
            out[h.replica][1] += h.context
        return [(b, t) for b, t in out]

    def all_started(self) -> bool:
        return all(h.started for h in self._held.values())

    def held(self) -> dict[str, _Held]:
        return self._held


class EnginePool:
    """The warm engines of each candidate layout on this node's devices."""

    def __init__(
        self,
        cfg: EngineConfig,
        layouts: Sequence[Layout],
        devices: Sequence[str] | None = None,
        on_start: Callable[[Layout, float], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.devices = list(devices) if devices is not None else node_devices()
        self.engines: dict[Layout, LayoutEngine] = {}
        try:
            for lay in layouts:
                t0 = time.perf_counter()
                self.engines[lay] = LayoutEngine.start(cfg, lay, self.devices)
                if on_start is not None:
                    on_start(lay, time.perf_counter() - t0)
        except BaseException:
            self.close()
            raise

    @classmethod
    def of(cls, engines: dict[Layout, LayoutEngine], cfg: EngineConfig | None = None) -> EnginePool:
        """A pool of engines built elsewhere (one already-running engine, simulated replicas)."""
        pool = cls.__new__(cls)
        pool.cfg = cfg if cfg is not None else EngineConfig()
        pool.devices = []
        pool.engines = dict(engines)
        return pool

    def warm(self) -> dict[str, float]:
        """Run one short request through every replica of every layout: a fresh engine's first
        steps pay one-off set-up (seconds on a CPU) that a layout switch must not."""

        out = {}
        for lay, eng in self.engines.items():
            t0 = time.perf_counter()
            for i in range(lay.dp * 2):
                eng.add_request(
                    GenerationRequest(
                        f"warm/{lay.name}/{time.time_ns()}/{i}",
                        Prompt("warm", tuple(range(1, 33))),
                        0,
                        SamplingSpec(max_tokens=8, ignore_eos=True),
                    )
                )
            while eng.has_unfinished():
                eng.step()
            out[lay.name] = time.perf_counter() - t0
        return out

    def __getitem__(self, layout: Layout) -> LayoutEngine:
        if layout not in self.engines:
            have = ", ".join(lay.name for lay in self.engines) or "none"
            raise EngineError(f"layout {layout.name} is not in the engine pool (it has {have})")
        return self.engines[layout]

    @property
    def layouts(self) -> tuple[Layout, ...]:
        return tuple(self.engines)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        weights = list(named_tensors)  # each replica's engine takes its own copy
        for eng in self.engines.values():
            eng.load_weights(iter(weights))

    def num_preemptions(self) -> int:
        return sum(e.num_preemptions() for e in self.engines.values())

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.engines.clear()


@dataclass(frozen=True)
class SwitchEvent:
    at_step: int
    source: str
    target: str
    requests: int  # unfinished requests migrated
    context_tokens: int  # their whole contexts, re-prefilled on the target
    control_s: float  # abort + resubmit
    recompute_s: float  # until every migrated request produced a token on the target
    predicted_switch_s: float
    predicted_stay_s: float  # remaining time if it had stayed
    predicted_target_s: float  # remaining time on the target, switch included

    @property
    def seconds(self) -> float:
        return self.control_s + self.recompute_s


@dataclass
class _Req:
    original: GenerationRequest
    internal_id: str
    tokens: list[int] = field(default_factory=list)  # generated since the original request
    logprobs: list[float] = field(default_factory=list)
    moves: int = 0


class SwitchingEngine:
    """The rollout engine port over an ``EnginePool``, switching layout when it pays (PAT)."""

    def __init__(
        self,
        pool: EnginePool,
        predictor: Predictor | None,
        initial: Layout,
        check_every: int = 16,
        min_gain_s: float = 0.0,
        enabled: bool = True,
        decide: Callable[[Layout, list[ReplicaLoad], int], SwitchDecision] | None = None,
    ) -> None:
        self.pool = pool
        self.predictor = predictor
        self.current = initial
        pool[initial]  # fail early on a layout the pool lacks
        self.check_every = check_every
        self.min_gain_s = min_gain_s
        self.enabled = enabled
        self._decide = decide
        self._reqs: dict[str, _Req] = {}
        self._by_internal: dict[str, str] = {}
        self._steps = 0
        self.events: list[SwitchEvent] = []
        self._pending_recompute: tuple[float, int] | None = None  # (start, event index)
        self.record = False
        self.trajectory: list[tuple[Layout, TrajectoryStep]] = []  # decode steps, when recording
        # simulated pools (the planner benchmark) run on a virtual clock: engine step times plus
        # the predictor's fixed switch overhead; recompute is charged by the engines themselves
        self.virtual = all(e.virtual for e in pool.engines.values()) and bool(pool.engines)
        self._clock = 0.0

    def _t(self) -> float:
        return self._clock if self.virtual else time.perf_counter()

    def set_layout(self, layout: Layout) -> None:
        """Serve the next requests on ``layout`` (between rounds: nothing may be in flight)."""
        if self._reqs:
            raise EngineError(
                f"set_layout({layout.name}) with {len(self._reqs)} requests in flight; "
                "switch_to moves running requests"
            )
        self.pool[layout]
        self.current = layout

    def live_request_ids(self) -> list[str]:
        return sorted(self._reqs)

    @property
    def engine(self) -> LayoutEngine:
        return self.pool[self.current]

    # -- port ---------------------------------------------------------------------------------
    @property
    def concurrency(self) -> int:
        return self.engine.concurrency

    @property
    def tp_size(self) -> int:
        return self.current.tp

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_id(self) -> int:
        return self.engine.eos_token_id

    def now(self) -> float:
        return self._t()

    def add_request(self, request: GenerationRequest) -> None:
        rid = request.request_id
        if rid in self._reqs:
            raise EngineError(f"request id {rid!r} was already used on this engine")
        self.engine.add_request(request)
        self._reqs[rid] = _Req(request, rid)
        self._by_internal[rid] = rid

    def abort(self, request_ids: Sequence[str]) -> None:
        internal = []
        for rid in request_ids:
            r = self._reqs.pop(rid, None)
            if r is not None:
                internal.append(r.internal_id)
                self._by_internal.pop(r.internal_id, None)
        if internal:
            self.engine.abort(internal)

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        eng, lay = self.engine, self.current
        decoding = self.record and eng.all_started()
        loads = eng.loads() if decoding else []
        ups, stats = eng.step()
        dt = stats.duration_s
        if self.virtual:
            self._clock += stats.duration_s
        if decoding and any(b for b, _ in loads):
            self.trajectory.append((lay, TrajectoryStep(tuple((b, float(t)) for b, t in loads), dt)))
        self._steps += 1
        out = []
        for u in ups:
            ext = self._by_internal.get(u.request_id)
            if ext is None:
                continue
            r = self._reqs[ext]
            r.tokens.extend(u.new_token_ids)
            r.logprobs.extend(u.new_logprobs)
            if u.finished:
                del self._reqs[ext]
                del self._by_internal[u.request_id]
            out.append(dataclasses.replace(u, request_id=ext))
        if self._pending_recompute is not None and self.engine.all_started():
            t0, idx = self._pending_recompute
            self.events[idx] = dataclasses.replace(self.events[idx], recompute_s=time.perf_counter() - t0)
            self._pending_recompute = None
        if (
            self.enabled
            and (self.predictor is not None or self._decide is not None)
            and self._reqs
            and self._pending_recompute is None
            and self._steps % self.check_every == 0
        ):
            self._maybe_switch()
        return out, stats

    def has_unfinished(self) -> bool:
        return bool(self._reqs) and self.engine.has_unfinished()

    def num_preemptions(self) -> int:
        return self.pool.num_preemptions()

    def kv_cache_usage(self) -> float:
        return self.engine.kv_cache_usage()

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.pool.load_weights(named_tensors)

    def close(self) -> None:
        self.pool.close()

    # -- switching -----------------------------------------------------------------------------
    def replica_loads(self) -> tuple[list[ReplicaLoad], int]:
        """The unfinished requests per replica as the predictor sees them, and the bound they
        decode to (PAT: the max response length; here each request's own ``max_tokens``)."""
        held = self.engine.held()
        bound = max((r.original.sampling.max_tokens for r in self._reqs.values()), default=0)
        per: list[tuple[list[int], list[int]]] = [([], []) for _ in self.engine.replicas]
        for r in self._reqs.values():
            h = held.get(r.internal_id)
            if h is None:
                continue
            left = r.original.sampling.max_tokens - len(r.tokens)
            per[h.replica][0].append(h.context)
            per[h.replica][1].append(bound - left)
        return [ReplicaLoad(tuple(c), tuple(g)) for c, g in per], bound

    def _maybe_switch(self) -> None:
        loads, bound = self.replica_loads()
        if self._decide is not None:
            d = self._decide(self.current, loads, bound)
        else:
            assert self.predictor is not None
            d = choose_layout(
                self.predictor,
                self.current,
                loads,
                bound,
                candidates=self.pool.layouts,
                min_gain_s=self.min_gain_s,
            )
        if d.switch:
            self.switch_to(d.target, d)

    def switch_to(self, target: Layout, decision: SwitchDecision | None = None) -> SwitchEvent:
        """Move every unfinished request to ``target`` by recompute migration."""
        src = self.current
        dst_engine = self.pool[target]
        w0 = time.perf_counter()
        live = list(self._reqs.values())
        self.engine.abort([r.internal_id for r in live])
        ctx = 0
        for r in live:
            o = r.original
            left = o.sampling.max_tokens - len(r.tokens)
            if left <= 0:  # cannot happen: it would have finished; keep the engine honest
                raise EngineError(f"request {o.request_id!r} has no tokens left to migrate")
            r.moves += 1
            new_id = f"{o.request_id}~m{r.moves}"
            cont = dataclasses.replace(
                o,
                request_id=new_id,
                sampling=dataclasses.replace(o.sampling, max_tokens=left),
                prefix_token_ids=o.prefix_token_ids + tuple(r.tokens),
                prefix_logprobs=o.prefix_logprobs + tuple(r.logprobs),
            )
            dst_engine.add_request(cont)
            del self._by_internal[r.internal_id]
            r.internal_id = new_id
            self._by_internal[new_id] = o.request_id
            ctx += len(cont.engine_input_ids)
        control = time.perf_counter() - w0
        if self.virtual and self.predictor is not None:
            control = self.predictor.switch_overhead_s
            self._clock += control
        self.current = target
        ev = SwitchEvent(
            at_step=self._steps,
            source=src.name,
            target=target.name,
            requests=len(live),
            context_tokens=ctx,
            control_s=control,
            recompute_s=0.0,
            predicted_switch_s=decision.switch_s if decision else 0.0,
            predicted_stay_s=decision.current_s if decision else 0.0,
            predicted_target_s=decision.best_s if decision else 0.0,
        )
        self.events.append(ev)
        if live:
            self._pending_recompute = (self._t(), len(self.events) - 1)
        log.info(
            "layout switch %s -> %s: %d requests, %d context tokens", src.name, target.name, len(live), ctx
        )
        return ev
