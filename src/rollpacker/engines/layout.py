"""Engines arranged in a parallel layout, and a rollout engine that switches layout mid-step (PAT).

- ``LayoutEngine``: ``dp`` vLLM replicas of TP size ``tp`` behind the rollout engine port. Each
  replica's engine core runs in its own process pinned to its own devices (CPU cores here,
  GPUs on a cluster), so replicas decode side by side while one driver thread steps them in turn.
  A request goes to the replica with the fewest unfinished requests.
- ``EnginePool``: the engines of the candidate layouts of one node, with in-place weight loading
  into all of them. On CPU every layout stays started and warm; on GPUs each started layout puts
  one engine on every GPU at ``engine.gpu_memory_utilization``, so floor(1 / that) layouts stay
  started (one at 0.9) and the others start on demand, closing the least recently used one.
- ``SwitchingEngine``: the port over a pool. Every ``check_every`` steps it asks PAT's Algorithm 1
  (``rollpacker.core.latency.choose_layout``) whether another layout finishes the unfinished
  requests sooner, switch cost included, and if so switches by **recompute migration**: it aborts
  the unfinished requests, keeps the tokens and logprobs they generated, and resubmits each as
  prompt + generated tokens with the remaining ``max_tokens`` to the new layout's engines (DP
  replicas merged into fewer, larger-TP engines, or split the other way). The caller sees one
  seamless stream per request: no token is lost or repeated, and every token keeps the logprob
  it was sampled with.

- ``ScaleDownRuntime``: RollPacker's Algorithm 1 (section 4.4) acting on a switching engine during
  one round. After each engine step that completed requests it feeds the pure
  ``rollpacker.core.scaledown.ScaleDownMonitor``; on a decision it moves the freed replicas'
  requests to the kept ones by the same recompute migration (``SwitchingEngine.scale_down``),
  **parks** the freed replicas (they stay loaded, take no request and are not stepped, so giving
  them back is instant) and hands their devices to training through a callback (the rollout
  service calls ``trainer.repurpose``). ``close`` at the round's end unparks them. PAT switching
  is off while replicas are parked (a switch would take the lent devices back).

Devices: a replica's devices are CPU cores here (its engine core's OpenMP threads are bound to
them, ``VLLM_CPU_OMP_THREADS_BIND``) and, when vLLM runs on CUDA, GPUs: the ones this process was
given (``engines.gpus``), replica ``i`` of a TP-``t`` layout started with ``CUDA_VISIBLE_DEVICES``
set to the ``i``-th group of ``t``. A scale-down frees whole replicas, never part of a TP group.

Invariants (tests/engines/test_layout.py on real vLLM, tests/services/test_scaledown_runtime.py):
- a request's reported tokens are exactly the tokens it was generated with, across any switch
  or scale-down, and it never gets more than its ``max_tokens``;
- every added request finishes exactly once (or is aborted by the caller);
- ``num_preemptions`` sums every engine of every layout, closed ones included (non-decreasing);
- on GPUs the replicas of a layout hold disjoint GPU groups, and no GPU's started engines take more
  than its memory (tests/engines/test_gpu_layouts.py, on a fake-CUDA layer);
- a parked replica holds no request, gets none and is not stepped; after a scale-down every
  request of a freed replica runs on the kept replica the decision named.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.environ import environ_set
from rollpacker.core.errors import EngineError
from rollpacker.core.latency import (
    Layout,
    Predictor,
    ReplicaLoad,
    SwitchDecision,
    TrajectoryStep,
    choose_layout,
    resident_layouts,
)
from rollpacker.core.metrics import sum_per_position
from rollpacker.core.scaledown import (
    LengthHistory,
    Replica,
    RolloutLayout,
    RunningRequest,
    ScaleDecision,
    ScaleDownConfig,
    ScaleDownMonitor,
    ScaleDownOutcome,
)
from rollpacker.core.types import EngineStepStats, GenerationRequest, Prompt, RequestUpdate, SamplingSpec
from rollpacker.engines.base import PrefixCache
from rollpacker.engines.gpus import check_gpu_shares, engine_device, gpu_memory, visible_gpus

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


def node_devices(device: str = "auto") -> list[str]:
    """This node's devices: the GPUs this process was given when vLLM runs on CUDA (Ray's
    ``CUDA_VISIBLE_DEVICES`` for the actor, or the pod's), otherwise the CPU cores we may use."""
    if engine_device(device) == "cuda":
        gpus = visible_gpus()
        if not gpus:
            raise EngineError(
                "vLLM runs on CUDA but this process was given no GPU (CUDA_VISIBLE_DEVICES is empty): "
                "the rollout service must ask Ray for its GPUs (num_gpus = engines x TP)"
            )
        return gpus
    return [str(c) for c in sorted(os.sched_getaffinity(0))]


def replica_env(group: Sequence[str], device: str) -> dict[str, str]:
    """The environment a replica's engine starts in: its GPUs on CUDA, its cores on CPU."""
    if device == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(group)}
    # one core list per TP rank, ranks separated by "|" (vLLM's CPU worker binding)
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(group)}


def start_replica(cfg: EngineConfig, tp: int, group: Sequence[str], index: int = 0) -> Any:
    """One vLLM engine of TP ``tp`` pinned to ``group``, its engine core in its own process.
    Replica ``index`` samples with seed ``engine.seed + index``: replicas never draw the same
    random stream."""
    from rollpacker.engines.vllm_engine import VLLMEngine

    if len(group) != tp:
        raise EngineError(f"a TP-{tp} engine needs {tp} devices, got {len(group)} ({','.join(group)})")
    # the engine's processes inherit the environment at start
    with _ENV_LOCK, environ_set(replica_env(group, engine_device(cfg.device))):
        return VLLMEngine(
            dataclasses.replace(cfg, tensor_parallel_size=tp, seed=cfg.seed + index),
            in_process=False,
        )


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
        self._parked: set[int] = set()  # replicas lent out (scale-down): no requests, not stepped
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
        i = min(self.active, key=lambda k: counts[k])
        self.add_to(request, i)

    def add_to(self, request: GenerationRequest, replica: int) -> None:
        """``request`` on replica ``replica`` (a migration's target), not the least loaded one."""
        if replica in self._parked or not 0 <= replica < len(self.replicas):
            raise EngineError(f"layout {self.layout.name}: replica {replica} is parked or does not exist")
        self.replicas[replica].add_request(request)
        self._held[request.request_id] = _Held(
            replica, len(request.engine_input_ids), 0, request.sampling.max_tokens
        )

    @property
    def active(self) -> list[int]:
        """The replicas that take requests and are stepped (every one unless some are parked)."""
        return [i for i in range(len(self.replicas)) if i not in self._parked]

    @property
    def parked(self) -> frozenset[int]:
        """The replicas lent out (scale-down) until ``unpark``."""
        return frozenset(self._parked)

    def park(self, replicas: Iterable[int]) -> None:
        """Stop routing to and stepping ``replicas`` (they must hold no request; they stay loaded)."""
        ids = set(replicas)
        busy = sorted({h.replica for h in self._held.values()} & ids)
        if busy:
            raise EngineError(
                f"layout {self.layout.name}: cannot park replica(s) {busy} with requests on them"
            )
        if not set(range(len(self.replicas))) - self._parked - ids:
            raise EngineError(f"layout {self.layout.name}: parking {sorted(ids)} would leave no replica")
        self._parked |= ids

    def unpark(self) -> None:
        """Every replica serves again (the devices are back)."""
        self._parked.clear()

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
        for rep in (self.replicas[i] for i in self.active):
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
            new_tokens=sum(s.new_tokens for s in stats),
            spec_draft_tokens=sum(s.spec_draft_tokens for s in stats),
            spec_accepted_tokens=sum(s.spec_accepted_tokens for s in stats),
            spec_draft_s=sum(s.spec_draft_s for s in stats),
            spec_draft_tokens_per_pos=sum_per_position(s.spec_draft_tokens_per_pos for s in stats),
            spec_accepted_tokens_per_pos=sum_per_position(s.spec_accepted_tokens_per_pos for s in stats),
        )

    def has_unfinished(self) -> bool:
        return any(self.replicas[i].has_unfinished() for i in self.active)

    def num_preemptions(self) -> int:
        return sum(int(r.num_preemptions()) for r in self.replicas)

    def kv_cache_usage(self) -> float:
        return max(float(r.kv_cache_usage()) for r in self.replicas)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        weights = list(named_tensors)  # each replica's engine takes its own copy
        for r in self.replicas:
            r.load_weights(iter(weights))

    def forget_cached(self) -> None:
        for r in self.replicas:
            forget_cached(r)

    @property
    def dead(self) -> bool:
        """Whether a replica's engine core died (the layout cannot serve until it is rebuilt)."""
        return any(bool(getattr(r, "dead", False)) for r in self.replicas)

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


def _warm_up(lay: Layout, eng: LayoutEngine) -> float:
    """Two short requests per replica of ``eng``, run to the end; the seconds taken."""
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
    return time.perf_counter() - t0


GPU_FREE_WAIT_S = 60.0  # a closed engine's processes may take a while to give their GPU memory back


class EnginePool:
    """The engines of each candidate layout on this node's devices: every candidate started and
    warm where memory allows (CPU), else as many as fit, the others started on demand, closing the
    least recently used layout first (GPUs; ``resident_layouts``)."""

    def __init__(
        self,
        cfg: EngineConfig,
        layouts: Sequence[Layout],
        devices: Sequence[str] | None = None,
        on_start: Callable[[Layout, float], None] | None = None,
        resident: int | None = None,
    ) -> None:
        """``resident``: how many layouts stay started at once (default: ``resident_layouts``)."""
        self.cfg = cfg
        self.device = engine_device(cfg.device)
        self.devices = list(devices) if devices is not None else node_devices(cfg.device)
        self.candidates = tuple(layouts)
        fit = resident_layouts(self.device, cfg.gpu_memory_utilization, len(self.candidates))
        if resident is not None and not 0 < resident <= fit:
            raise EngineError(f"{resident} resident layouts: between 1 and the {fit} that fit")
        self.resident = fit if resident is None else resident
        self.on_start = on_start
        self.engines: dict[Layout, LayoutEngine] = {}  # started ones, least recently used first
        self._weights: list[tuple[str, Any]] | None = None  # the last pushed, for later starts
        self._kept: Callable[[], list[tuple[str, Any]]] | None = None  # or where a collective push kept them
        self._closed_preemptions = 0
        self._warm = False  # warm() was called: layouts started later are warmed too
        try:
            for lay in self.candidates[: self.resident]:
                self._start(lay)
        except BaseException:
            self.close()
            raise

    @classmethod
    def of(cls, engines: dict[Layout, LayoutEngine], cfg: EngineConfig | None = None) -> EnginePool:
        """A pool of engines built elsewhere (one already-running engine, simulated replicas)."""
        pool = cls.__new__(cls)
        pool.cfg = cfg if cfg is not None else EngineConfig()
        pool.device = "cpu"
        pool.devices = []
        pool.candidates = tuple(engines)
        pool.resident = len(engines)
        pool.on_start = None
        pool.engines = dict(engines)
        pool._weights = None
        pool._kept = None
        pool._closed_preemptions = 0
        pool._warm = False
        return pool

    def _start(self, lay: Layout) -> LayoutEngine:
        """Start ``lay``'s engines (with the last pushed weights), after checking GPU memory."""
        if self.device == "cuda":
            self._check_gpus(lay)
        t0 = time.perf_counter()
        eng = LayoutEngine.start(self.cfg, lay, self.devices)
        self.engines[lay] = eng
        if self._weights is not None:
            eng.load_weights(iter(self._weights))
        elif self._kept is not None:
            eng.load_weights(iter(self._kept()))
        if self._warm:
            _warm_up(lay, eng)
        if self.on_start is not None:
            self.on_start(lay, time.perf_counter() - t0)
        return eng

    def _check_gpus(self, lay: Layout) -> None:
        """Refuse ``lay`` when its GPUs, with the started layouts' engines, cannot hold it."""
        placed = {
            f"{other.name}/r{i}": group
            for other in (*self.engines, lay)
            for i, group in enumerate(device_groups(other, self.devices))
        }
        util = self.cfg.gpu_memory_utilization
        check_gpu_shares(placed, util)
        gpus = self.devices[: lay.devices]
        deadline = time.monotonic() + GPU_FREE_WAIT_S
        while True:
            memory = gpu_memory(gpus)
            short = [g for g in gpus if memory[g][0] < util * memory[g][1]]
            if not short or time.monotonic() >= deadline:
                break
            time.sleep(1.0)
        check_gpu_shares(placed, util, gpus, memory)

    def _make_room(self) -> None:
        while len(self.engines) >= self.resident:
            lay, eng = next(iter(self.engines.items()))
            if eng.held():
                raise EngineError(
                    f"layout {lay.name} must close to make room for another ({self.resident} fit on "
                    f"the GPUs at engine.gpu_memory_utilization = {self.cfg.gpu_memory_utilization}) "
                    f"but serves {len(eng.held())} requests; change layouts between rounds"
                )
            log.info("closing layout %s to start another (%d fit at once)", lay.name, self.resident)
            self._closed_preemptions += eng.num_preemptions()
            del self.engines[lay]
            eng.close()

    def warm(self) -> dict[str, float]:
        """Run one short request through every replica of every started layout: a fresh engine's
        first steps pay one-off set-up (seconds on a CPU) that a layout switch must not. Layouts
        started later (on GPUs, on demand) are warmed as they start."""

        self._warm = True
        return {lay.name: _warm_up(lay, eng) for lay, eng in self.engines.items()}

    def __getitem__(self, layout: Layout) -> LayoutEngine:
        """``layout``'s engines, started now (closing the least recently used layout) if they
        are not running."""
        eng = self.engines.pop(layout, None)
        if eng is not None:
            self.engines[layout] = eng  # the most recently used now
            return eng
        if layout not in self.candidates:
            have = ", ".join(lay.name for lay in self.candidates) or "none"
            raise EngineError(f"layout {layout.name} is not in the engine pool (it has {have})")
        self._make_room()
        return self._start(layout)

    @property
    def layouts(self) -> tuple[Layout, ...]:
        """Every candidate layout, started or not."""
        return self.candidates

    @property
    def started(self) -> tuple[Layout, ...]:
        """The layouts whose engines are running now (a switch inside a round picks among them)."""
        return tuple(self.engines)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        weights = list(named_tensors)  # each replica's engine takes its own copy
        for eng in self.engines.values():
            eng.load_weights(iter(weights))
        if self.resident < len(self.candidates):  # a layout started later serves them too
            self._weights, self._kept = weights, None

    def remember(self, read: Callable[[], list[tuple[str, Any]]]) -> None:
        """What a layout started later loads, read when it starts: a collective push's copy, kept
        on this node by an engine's worker (``engines/layout_push.py``)."""
        self._weights = None
        self._kept = read

    def forget_cached(self) -> None:
        for eng in self.engines.values():
            forget_cached(eng)

    def num_preemptions(self) -> int:
        return self._closed_preemptions + sum(e.num_preemptions() for e in self.engines.values())

    @property
    def dead(self) -> bool:
        """Whether an engine core of any layout died."""
        return any(e.dead for e in self.engines.values())

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
        self.scale_events: list[SwitchEvent] = []  # scale-downs (source = target layout)
        # (start, the event list, index): the migration whose recompute is still being timed
        self._pending_recompute: tuple[float, list[SwitchEvent], int] | None = None
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
        self.pool[layout].unpark()
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
            t0, events, idx = self._pending_recompute
            events[idx] = dataclasses.replace(events[idx], recompute_s=self._t() - t0)
            self._pending_recompute = None
        if (
            self.enabled
            and (self.predictor is not None or self._decide is not None)
            and self._reqs
            and self._pending_recompute is None
            and not self.engine.parked  # devices are lent to training: no layout switch
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

    def forget_cached(self) -> None:
        self.pool.forget_cached()

    @property
    def dead(self) -> bool:
        return self.pool.dead

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
                candidates=self.pool.started,  # a switch never waits for engines to start
                min_gain_s=self.min_gain_s,
            )
        if d.switch:
            self.switch_to(d.target, d)

    def _migrate(self, live: Sequence[_Req], place: Callable[[GenerationRequest, _Req], None]) -> int:
        """Recompute migration of ``live`` off the current engine: abort them there and ``place``
        each continuation (prompt + the tokens generated so far, the remaining ``max_tokens``)
        where it goes; returns the context tokens the targets re-prefill."""
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
                # the engine never reads versions; the caller reports the original request's
                prefix_versions=(),
            )
            place(cont, r)
            del self._by_internal[r.internal_id]
            r.internal_id = new_id
            self._by_internal[new_id] = o.request_id
            ctx += len(cont.engine_input_ids)
        return ctx

    def switch_to(self, target: Layout, decision: SwitchDecision | None = None) -> SwitchEvent:
        """Move every unfinished request to ``target`` by recompute migration."""
        src = self.current
        dst_engine = self.pool[target]
        w0 = time.perf_counter()
        live = list(self._reqs.values())
        ctx = self._migrate(live, lambda cont, _r: dst_engine.add_request(cont))
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
            self._pending_recompute = (self._t(), self.events, len(self.events) - 1)
        log.info(
            "layout switch %s -> %s: %d requests, %d context tokens", src.name, target.name, len(live), ctx
        )
        return ev

    # -- scale-down (RollPacker 4.4) -----------------------------------------------------------
    def running(self) -> list[tuple[str, int, int, int]]:
        """Every unfinished request as ``(request id, replica, prompt tokens, generated tokens)``
        on the current layout; resumed tokens (a partial response's prefix) count as generated."""
        held = self.engine.held()
        out = []
        for rid, r in sorted(self._reqs.items()):
            h = held.get(r.internal_id)
            if h is not None:
                o = r.original
                out.append((rid, h.replica, len(o.prompt.token_ids), len(o.prefix_token_ids) + len(r.tokens)))
        return out

    def scale_down(self, freed: Sequence[int], moves: Mapping[str, int]) -> SwitchEvent:
        """Move every unfinished request on the ``freed`` replicas of the current layout to the kept
        replica ``moves`` names for it (by recompute migration), then park the freed replicas."""
        eng, lay = self.engine, self.current
        freed_set = set(freed)
        held = eng.held()
        live = [
            r
            for r in self._reqs.values()
            if r.internal_id in held and held[r.internal_id].replica in freed_set
        ]
        missing = sorted(r.original.request_id for r in live if r.original.request_id not in moves)
        if missing:
            raise EngineError(f"scale-down: no kept replica named for request(s) {missing[:3]}")
        bad = sorted({moves[r.original.request_id] for r in live} & freed_set)
        if bad or len(freed_set) >= len(eng.replicas):
            raise EngineError(
                f"scale-down: freed {sorted(freed_set)} leaves no replica for the moves ({bad})"
            )
        w0 = time.perf_counter()
        ctx = self._migrate(live, lambda cont, r: eng.add_to(cont, moves[r.original.request_id]))
        eng.park(freed_set)
        ev = SwitchEvent(
            at_step=self._steps,
            source=lay.name,
            target=f"{lay.name}-{len(freed_set)}",
            requests=len(live),
            context_tokens=ctx,
            control_s=time.perf_counter() - w0,
            recompute_s=0.0,
            predicted_switch_s=0.0,
            predicted_stay_s=0.0,
            predicted_target_s=0.0,
        )
        self.scale_events.append(ev)
        if live:
            self._pending_recompute = (self._t(), self.scale_events, len(self.scale_events) - 1)
        log.info(
            "scale-down on %s: replicas %s parked, %d requests migrated",
            lay.name,
            sorted(freed_set),
            len(live),
        )
        return ev

    def restore_replicas(self) -> None:
        """Every replica of every layout serves again (the end of a round: devices given back)."""
        for eng in self.pool.engines.values():
            eng.unpark()


def kv_capacity_tokens(engine: LayoutEngine) -> int:
    """One replica's KV cache capacity in tokens, as the engine reports it (vLLM's block count x
    block size; a simulated replica's ``kv_capacity_tokens``); 0 when it does not say."""
    rep = engine.replicas[0]
    cap = getattr(rep, "kv_capacity_tokens", None)
    if isinstance(cap, int):
        return cap
    vllm = getattr(rep, "_engine", None)
    cc = getattr(getattr(vllm, "vllm_config", None), "cache_config", None)
    blocks = getattr(cc, "num_gpu_blocks", 0) or 0
    return int(blocks) * int(getattr(cc, "block_size", 0) or 0)


class ScaleDownRuntime:
    """Algorithm 1 of RollPacker (section 4.4) acting on ``engine`` for one round.

    Call ``observe(completed)`` after each engine step with the round's completed count (the
    driver's ``on_step``); it feeds the pure monitor only when the count moved (Algorithm 1 line 9)
    and, on a decision, migrates the freed replicas' requests, parks those replicas and calls
    ``release(devices)`` with their devices (Algorithm 1 lines 18-20). ``close()`` at the round's
    end unparks every replica and returns what happened (``ScaleDownOutcome``).

    ``|R|`` is fixed at the first observation: the requests the round has submitted by then
    (completed + unfinished); requests a buffered policy adds later are placed and projected but
    do not grow ``|R|``, and the completed count is capped at it (as the replay benchmark does).
    ``kv_capacity(layout)`` is one replica's KV capacity in tokens on ``layout`` (the profile's,
    or the engine's own); a PAT switch before the decision moves the monitor to the new layout.
    """

    def __init__(
        self,
        engine: SwitchingEngine,
        config: ScaleDownConfig,
        history: LengthHistory,
        kv_capacity: Callable[[Layout], int],
        release: Callable[[tuple[str, ...]], None],
    ) -> None:
        self.engine = engine
        self.config = config
        self.history = history
        self.kv_capacity = kv_capacity
        self.release = release
        self._lay: Layout | None = None
        self.groups: list[list[str]] = []
        self.layout = RolloutLayout(())
        self._monitor: ScaleDownMonitor | None = None
        self._completed = -1
        self._t0 = engine.now()
        self.decision: ScaleDecision | None = None
        self._outcome = ScaleDownOutcome()
        self._event: int | None = None  # index into engine.scale_events

    def _sync_layout(self) -> None:
        """The monitor's replicas are the current layout's (rebuilt after a PAT switch)."""
        lay = self.engine.current
        if lay == self._lay:
            return
        names = list(self.engine.pool.devices) or [str(i) for i in range(lay.devices)]
        self.groups = device_groups(lay, names)
        cap = max(1, int(self.kv_capacity(lay)))
        self.layout = RolloutLayout(
            tuple(
                Replica(f"r{i}", tuple(range(i * lay.tp, (i + 1) * lay.tp)), "node", cap)
                for i in range(lay.dp)
            )
        )
        if self._monitor is not None:
            self._monitor = ScaleDownMonitor.restore(
                self.config, self.layout, self.history, self._monitor.state
            )
        self._lay = lay

    def observe(self, completed: int) -> ScaleDecision | None:
        """Algorithm 1 after one engine step; acts on a decision and returns it (at most once)."""
        if completed == self._completed or self.decision is not None:
            return None
        self._sync_layout()
        running = [RunningRequest(rid, f"r{rep}", p, g) for rid, rep, p, g in self.engine.running()]
        if self._monitor is None:
            total = max(1, completed + len(running))
            self._monitor = ScaleDownMonitor(self.config, self.layout, self.history, total)
        m = self._monitor
        self._completed = completed
        before = m.state.attempts
        d = m.observe(min(completed, m.state.total_requests), running)
        if m.state.attempts > before and d is None:
            check = m.last_check
            pick = check is not None and check.reason.startswith("pick:")
            self._outcome = dataclasses.replace(
                self._outcome,
                attempts=m.state.attempts,
                refused=self._outcome.refused + (not pick),
                aborted_pick=self._outcome.aborted_pick + pick,
            )
        if d is not None:
            self._act(d, m.state.attempts)
        return d

    def _act(self, d: ScaleDecision, attempts: int) -> None:
        at_s = self.engine.now() - self._t0
        index = {f"r{i}": i for i in range(len(self.groups))}
        freed = [index[r] for r in d.freed]
        ev = self.engine.scale_down(freed, {rid: index[to] for rid, to in d.migrate})
        self._event = len(self.engine.scale_events) - 1
        devices = tuple(dev for i in freed for dev in self.groups[i])
        self.decision = d
        self._outcome = dataclasses.replace(
            self._outcome,
            attempts=attempts,
            scaled_down=True,
            completed_fraction=d.completed_fraction,
            at_s=at_s,
            freed_replicas=len(freed),
            freed_devices=devices,
            migrated_requests=ev.requests,
            migrated_tokens=ev.context_tokens,
        )
        self.release(devices)

    def close(self) -> ScaleDownOutcome:
        """Every replica back (the round is over); what the round's scale-down did."""
        self.engine.restore_replicas()
        out = self._outcome
        if self._event is not None:
            ev = self.engine.scale_events[self._event]
            out = dataclasses.replace(out, migrate_s=ev.control_s, recompute_s=ev.recompute_s)
        return out


def forget_cached(engine: object) -> None:
    """``engine.forget_cached()`` where the engine keeps a prefix cache (vLLM); nothing otherwise."""
    if isinstance(engine, PrefixCache):
        engine.forget_cached()
