"""The offline profiler (PAT section 4.2) and the real decoding trajectories that check it.

For each candidate layout (``tp`` x ``dp`` on one node) it starts the layout's engines once and,
for a sparse grid of per-replica batch sizes ``B`` and context lengths ``L`` with ``B * L`` within
the KV budget, injects ``B`` random prefixes of ``L`` tokens into every replica (all replicas
loaded alike, so their interference is measured), times the prefill (until every request has its
first token) and then a short window of decode steps. It also records KV bytes per token, the
engine's KV capacity, and the one-way copy bandwidth a KV migration would run at.

``record_trajectory`` runs real prompts (sampled, natural lengths, the batch draining as responses
finish) on a layout and records each decode step's per-replica load and wall time: the held-out
set the predictor's error is measured on.
"""

from __future__ import annotations

import contextlib
import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import EngineError
from rollpacker.core.latency import (
    Layout,
    LayoutProfile,
    Predictor,
    ProfilePoint,
    ProfileTable,
    TrajectoryStep,
    trajectory_error,
)
from rollpacker.core.planner import PlannerConfig
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.base import KVCapacity
from rollpacker.engines.gpus import engine_device, gpu_name, visible_gpus
from rollpacker.engines.layout import EnginePool, LayoutEngine

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
DEFAULT_CONTEXTS = (16, 64, 256, 768)


@dataclass(frozen=True)
class ProfileSpec:
    layouts: tuple[Layout, ...]
    batches: tuple[int, ...] = DEFAULT_BATCHES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    window: int = 16  # decode steps timed per point
    token_cap: int = 0  # B * L budget per replica; 0 = the engine's KV capacity
    seed: int = 0

    @classmethod
    def for_planner(
        cls, pc: PlannerConfig, layouts: tuple[Layout, ...], max_num_seqs: int, seed: int
    ) -> ProfileSpec:
        """The planner config's grid (batches the engine can hold) over ``layouts``."""
        return cls(
            layouts=layouts,
            batches=tuple(b for b in pc.profile_batches if b <= max_num_seqs),
            contexts=pc.profile_contexts,
            window=pc.profile_window,
            seed=seed,
        )

    def grid(self, kv_capacity: int, max_model_len: int, max_num_seqs: int) -> list[tuple[int, int]]:
        cap = min(self.token_cap or kv_capacity, kv_capacity)
        return [
            (b, length)
            for b in sorted(set(self.batches))
            for length in sorted(set(self.contexts))
            if b * (length + self.window + 1) <= cap
            and length + self.window + 1 <= max_model_len
            and b <= max_num_seqs
        ]


def kv_bytes_per_token(model_dir: str | Path, dtype: str) -> int:
    """K and V of every layer for one token, whole model (a TP rank holds 1/tp of the heads)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * size


def copy_bandwidth_bps(nbytes: int = 64 << 20, repeats: int = 5) -> float:
    """One-way copy bandwidth on this node's devices (host memcpy on a CPU, device-to-device
    between two GPUs when there are two): what a KV migration would move data at."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 1:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
        sync: Callable[[], None] = torch.cuda.synchronize
    else:
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)

        def sync() -> None:
            return None

    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    if src.is_cuda:  # back to the engines that share these GPUs (the allocator would keep it)
        del src, dst
        torch.cuda.empty_cache()
    return nbytes / best


def _engine_kv_capacity(engine: LayoutEngine) -> int:
    rep = engine.replicas[0]
    if isinstance(rep, KVCapacity):  # a simulated engine's (engine.kind: simulated)
        return rep.kv_capacity_tokens
    cc = rep._engine.vllm_config.cache_config
    blocks = cc.num_gpu_blocks
    if not blocks:
        raise EngineError("vLLM did not report its KV cache size (cache_config.num_gpu_blocks)")
    return int(blocks) * int(cc.block_size)


def _random_requests(
    rng: random.Random, tag: str, batch: int, length: int, vocab: int, max_tokens: int
) -> list[GenerationRequest]:
    # random token ids: no two prefixes share a block, so the prefix cache never hits
    return [
        GenerationRequest(
            request_id=f"{tag}/{i}",
            prompt=Prompt(f"{tag}/{i}", tuple(rng.randrange(1, vocab) for _ in range(length))),
            sample_index=0,
            sampling=SamplingSpec(max_tokens=max_tokens, ignore_eos=True, temperature=1.0),
        )
        for i in range(batch)
    ]


class _PointLost(EngineError):
    """A grid point whose batch did not stay whole through the decode window."""


def measure_point(
    engine: LayoutEngine,
    rng: random.Random,
    tag: str,
    batch: int,
    length: int,
    window: int,
    max_model_len: int,
) -> ProfilePoint:
    """Prefill ``batch`` random ``length``-token prefixes per replica, then time ``window`` steps."""
    vocab = engine.vocab_size
    # room to decode while the rest of the batch is still in (chunked) prefill: the window must
    # start with all B requests running; they are aborted after it
    room = max(window + 2, max_model_len - length - 1)
    for rep in range(engine.layout.dp):
        for req in _random_requests(rng, f"{tag}/r{rep}", batch, length, vocab, room):
            engine.add_request(req)
    t0 = time.perf_counter()
    while not engine.all_started():
        if not engine.has_unfinished():
            raise EngineError(f"profile point B={batch} L={length}: the engine ran dry in prefill")
        engine.step()
    prefill = time.perf_counter() - t0
    times: list[float] = []
    tokens: list[float] = []
    for _ in range(window):
        loads = engine.loads()
        if any(b != batch for b, _ in loads):
            # some requests ran out of room while others still prefilled: not this point
            engine.abort(list(engine.held()))
            while engine.has_unfinished():
                engine.step()
            raise _PointLost(
                f"profile point B={batch} L={length}: only {[b for b, _ in loads]} of {batch} requests "
                "per replica still running in the decode window"
            )
        _, st = engine.step()
        times.append(st.duration_s)
        tokens.append(max(tk for _, tk in loads))
    engine.abort(list(engine.held()))
    while engine.has_unfinished():  # let the aborts land before the next point
        engine.step()
    return ProfilePoint(
        batch=batch,
        context=length,
        tokens=sum(tokens) / len(tokens),
        prefill_s=prefill,
        decode_s=sum(times) / len(times),
    )


POINT_TRIES = 3  # a point lost to the race between replicas (below) is measured again, then skipped


def _measure_point_again_if_lost(
    eng: LayoutEngine,
    rng: random.Random,
    tag: str,
    batch: int,
    length: int,
    spec: ProfileSpec,
    cfg: EngineConfig,
    say: Callable[[str], None],
) -> ProfilePoint | None:
    """``measure_point``, tried up to ``POINT_TRIES`` times. A point is lost when the requests
    of one replica ran out of room while another replica still prefilled: the replicas' engine
    cores run on their own, so on a busy machine one can lag the other by a whole decode window
    (the long contexts leave the least room: ``max_model_len - length``). That is a race, not a
    property of the point; None (the point skipped, said) only when every try lost it."""
    for attempt in range(1, POINT_TRIES + 1):
        try:
            return measure_point(eng, rng, f"{tag}/t{attempt}", batch, length, spec.window, cfg.max_model_len)
        except _PointLost as e:
            say(f"{e} (try {attempt} of {POINT_TRIES})")
    return None


def profile_engines(
    cfg: EngineConfig,
    spec: ProfileSpec,
    devices: Sequence[str] | None = None,
    progress: Callable[[str], None] | None = None,
    pool: EnginePool | None = None,
) -> ProfileTable:
    """Measure every layout of ``spec`` (engines from ``pool``, or started here and closed)."""
    t_start = time.perf_counter()
    say = progress or (lambda _m: None)
    own = pool is None
    pool = pool or EnginePool(
        cfg, spec.layouts, devices, on_start=lambda lay, s: say(f"{lay.name}: engines up in {s:.1f} s")
    )
    try:
        rng = random.Random(spec.seed)
        layouts = [_profile_layout(pool[lay], lay, cfg, spec, rng, say) for lay in spec.layouts]
        return ProfileTable(
            model=Path(cfg.model_dir).name,
            hardware=_hardware(cfg.device),
            kv_bytes_per_token=kv_bytes_per_token(cfg.model_dir, cfg.dtype),
            migration_bandwidth_bps=copy_bandwidth_bps(),
            layouts=tuple(layouts),
            decode_window=spec.window,
            created_s=time.time(),
            profile_seconds=time.perf_counter() - t_start,
        )
    finally:
        if own:
            pool.close()


def _profile_layout(
    eng: LayoutEngine,
    lay: Layout,
    cfg: EngineConfig,
    spec: ProfileSpec,
    rng: random.Random,
    say: Callable[[str], None],
) -> LayoutProfile:
    """Every point of ``spec``'s grid that fits ``lay``'s engine, after one throw-away point."""
    cap = _engine_kv_capacity(eng)
    grid = spec.grid(cap, cfg.max_model_len, cfg.max_num_seqs)
    if not grid:
        raise EngineError(
            f"{lay.name}: no profile point fits (KV capacity {cap} tokens, max_model_len "
            f"{cfg.max_model_len}); lower the contexts or raise engine.kv_cache_gib"
        )
    # one throw-away point: the first steps of a fresh engine pay one-off set-up
    tag = f"prof/{time.time_ns()}/{lay.name}"  # request ids are single-use per engine
    with contextlib.suppress(_PointLost):  # a warm-up: only its cost mattered
        measure_point(eng, rng, f"{tag}/warm", grid[0][0], grid[0][1], 4, cfg.max_model_len)
    points = []
    for b, length in grid:
        p = _measure_point_again_if_lost(eng, rng, f"{tag}/b{b}l{length}", b, length, spec, cfg, say)
        if p is None:
            continue
        points.append(p)
        say(
            f"{lay.name} B={b:<3} L={length:<4} prefill {p.prefill_s * 1e3:7.1f} ms  "
            f"decode {p.decode_s * 1e3:6.2f} ms/step"
        )
    if not points:
        raise EngineError(f"{lay.name}: every profile point was lost; raise engine.max_model_len")
    return LayoutProfile(layout=lay, points=tuple(points), kv_capacity_tokens=cap, startup_s=eng.startup_s)


def _hardware(device: str = "auto") -> str:
    if engine_device(device) == "cuda":
        # NVML, not torch.cuda: a CUDA context here would hold memory on a GPU the engines share
        gpus = visible_gpus()
        return f"{len(gpus)}x {gpu_name(gpus[0])}" if gpus else "no GPU"
    import os

    return f"{len(os.sched_getaffinity(0))} CPU cores ({platform.processor() or platform.machine()})"


def record_trajectory(
    engine: LayoutEngine, requests: Sequence[GenerationRequest], max_steps: int = 100_000
) -> list[TrajectoryStep]:
    """Run ``requests`` to completion on ``engine`` and record every pure-decode step (no request
    of the step still in prefill): per-replica (batch, context tokens) before it, and its time."""
    for r in requests:
        engine.add_request(r)
    steps: list[TrajectoryStep] = []
    n = 0
    while engine.has_unfinished():
        n += 1
        if n > max_steps:
            raise EngineError(f"trajectory: gave up after {max_steps} steps")
        decoding = engine.all_started()
        loads = engine.loads()
        _, st = engine.step()
        dt = st.duration_s  # the engines' own step time (their cores run ahead of this loop)
        if decoding and any(b for b, _ in loads):
            steps.append(TrajectoryStep(tuple((b, float(tk)) for b, tk in loads), dt))
    return steps


def table_rows(table: ProfileTable) -> list[dict[str, Any]]:
    return [
        {
            "layout": lp.layout.name,
            "batch": p.batch,
            "context": p.context,
            "tokens": round(p.tokens, 1),
            "prefill_ms": round(p.prefill_s * 1e3, 3),
            "decode_ms": round(p.decode_s * 1e3, 3),
        }
        for lp in table.layouts
        for p in lp.points
    ]


def plot_profile(table: ProfileTable, path: Path | str) -> Path:
    """Decode-step latency against context tokens, one line per batch size, one panel per layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(table.layouts)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False, sharey=True)
    for ax, lp in zip(axes[0], table.layouts, strict=True):
        for b in sorted({p.batch for p in lp.points}):
            pts = sorted((p.tokens, p.decode_s * 1e3) for p in lp.points if p.batch == b)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"B={b}")
        ax.set_xscale("log")
        ax.set_title(f"{lp.layout.name} (KV {lp.kv_capacity_tokens} tokens/replica)")
        ax.set_xlabel("context tokens per replica (T)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode step (ms)")
    axes[0][-1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{table.model} on {table.hardware}")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def profile_and_check(
    pool: EnginePool,
    spec: ProfileSpec,
    held_out: Sequence[Any],
    max_tokens: int,
    temperature: float = 1.0,
    window: int = 32,
    progress: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Profile every layout of ``pool``, then decode the held-out prompts on each layout (real
    sampling, natural lengths, the batch draining) and measure the predictor's error on them."""
    t0 = time.perf_counter()
    table = profile_engines(pool.cfg, spec, pool=pool, progress=progress)
    pred = Predictor(table)
    errors = {}
    # started layouts first, the most recent first: on GPUs, where one layout may be started at a
    # time, every other one costs an engine start
    started = tuple(reversed(pool.started))
    for lay in (*started, *(lay for lay in pool.layouts if lay not in started)):
        sp = SamplingSpec(max_tokens=max_tokens, temperature=temperature)
        reqs = [
            GenerationRequest(f"held-out/{lay.name}/{time.time_ns()}/{i}", p, 0, sp)
            for i, p in enumerate(held_out)
        ]
        steps = record_trajectory(pool[lay], reqs)
        err = trajectory_error(pred, lay, steps, window=window)
        errors[lay.name] = asdict(err)
        progress(
            f"{lay.name}: held-out trajectory of {err.steps} decode steps: measured {err.measured_s:.3f} s, "
            f"predicted {err.predicted_s:.3f} s; error per {window}-step window {err.window_mape:.1%}, "
            f"whole trajectory {err.total_error:.1%}, single steps {err.step_mape:.1%}"
        )
    return {
        "table": asdict(table),
        "validation": {lay.name: errors[lay.name] for lay in pool.layouts},
        "seconds": time.perf_counter() - t0,
        "prompt_tokens_mean": sum(len(p.token_ids) for p in held_out) / max(len(held_out), 1),
    }
