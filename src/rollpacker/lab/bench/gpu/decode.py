"""The profile phase: decode step time of a model with random weights, over batch x context.

The measurement engine is transformers' Qwen2 forward (``sdpa`` attention) on a **static KV cache**
(``transformers.StaticCache``) sized to each point: a point ``(B, L)`` decodes ``B`` requests whose
caches hold ``L`` positions, one token per request per step, and times ``window`` steps after two
warm-up steps. The cache positions below ``L`` are not prefilled (a decode step reads them whatever
they hold), so a point costs its decode steps only. The model is built on the device from its shape
(``ModelSpec``: the shipped ``qwen2.5-7b`` on a GPU, a tiny one with ``--tiny``) with random bf16
weights: nothing is downloaded.

Random weights are valid here because the work is forced-length: a step's time depends on the
shapes (weights read, KV read, FLOPs), not on the values. They are not valid for anything that
depends on what the model says (acceptance of drafts, rewards, response lengths, learning).

How a step here relates to a vLLM step: it is one eager forward (no CUDA graphs, no paged KV, no
scheduler, no sampler, no detokenization). vLLM adds scheduling and sampling (~ms) but removes the
kernel-launch overhead with CUDA graphs; at small batch an eager step is launch-bound, so the
measured small-batch step is an upper bound on vLLM's, at large batch the weight and KV reads
dominate both. The table records this in ``engine``.

Prefill (needed by the table) is measured per context on 1 request and on ``n`` requests (as many
as ``PREFILL_TOKENS`` tokens allow) and interpolated linearly in the batch: compute-bound prefill is
linear in tokens. Points are measured context by context (all batches at the shortest context
first), so a run cut by its deadline still has every batch at the shorter contexts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollpacker.core.costmodel import ModelSpec
from rollpacker.core.latency import Layout, LayoutProfile, ProfilePoint, ProfileTable
from rollpacker.lab.bench.gpu.context import Context, Skip

GPU_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GPU_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
TINY_BATCHES = (1, 2, 4, 8, 16)
TINY_CONTEXTS = (16, 64, 256)
GPU_WINDOW, TINY_WINDOW = 8, 4
PREFILL_TOKENS = 16384  # per prefill forward on a GPU (activations); 256 on the CPU
MEMORY_UTILIZATION = 0.9  # the KV capacity the table reports: vLLM's default gpu_memory_utilization
HEADROOM_BYTES = 6 << 30  # activations, logits and the allocator's slack beside a point's KV
RATIO_CONTEXT = 1024  # the batch-128 / batch-1 step ratio is reported at this context


def tiny_model_spec() -> ModelSpec:
    """The tiny Qwen2 shape of ``--tiny`` (a ModelSpec, so the roofline and calibration read it)."""
    shape: dict[str, Any] = {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 32,
        "intermediate_size": 128,
        "vocab_size": 320,
    }
    probe = ModelSpec(
        name="tiny", num_params=1, tie_word_embeddings=True, bytes_per_param=4, kv_bytes_per_value=4, **shape
    )
    return dataclasses.replace(probe, num_params=probe.derived_params)


def model_spec(tiny: bool) -> ModelSpec:
    if tiny:
        return tiny_model_spec()
    from rollpacker.lab.bench.whatif.specfiles import load_model

    return load_model("qwen2.5-7b")


def build_model(spec: ModelSpec, device: str, dtype: Any) -> Any:
    """A Qwen2ForCausalLM of ``spec``'s shape with random weights, built on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config_cls: Any = Qwen2Config
    auto: Any = AutoModelForCausalLM
    cfg = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=max(GPU_CONTEXTS) * 2,
        tie_word_embeddings=spec.tie_word_embeddings,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = auto.from_config(cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


class DecodeTimer:
    """Times decode steps and prefills of one model on one device (see the module docstring)."""

    def __init__(self, model: Any, device: str, window: int) -> None:
        import torch

        self.model, self.device, self.window = model, device, window
        self.sync: Callable[[], object] = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def decode_s(self, batch: int, context: int) -> float:
        """Mean seconds of one decode step of ``batch`` requests at ``context`` cached positions."""
        import torch
        from transformers import StaticCache

        cache = StaticCache(config=self.model.config, max_cache_len=context + self.window + 3)
        ids = torch.randint(1, self.model.config.vocab_size, (batch, 1), device=self.device)

        def step(pos: int) -> None:
            cp = torch.tensor([pos], device=self.device)
            self.model(
                input_ids=ids,
                past_key_values=cache,
                cache_position=cp,
                position_ids=cp.expand(batch, 1),
                use_cache=True,
                logits_to_keep=1,
            )

        with torch.no_grad():
            for pos in (context, context + 1):  # warm-up: allocation, kernel selection
                step(pos)
            self.sync()
            t0 = time.perf_counter()
            for pos in range(context + 2, context + 2 + self.window):
                step(pos)
            self.sync()
        return (time.perf_counter() - t0) / self.window

    def prefill_s(self, rows: int, context: int) -> float:
        """Seconds to prefill ``rows`` prompts of ``context`` tokens (no cache kept, last logits only)."""
        import torch

        ids = torch.randint(1, self.model.config.vocab_size, (rows, context), device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)  # warm-up
            self.sync()
            t0 = time.perf_counter()
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            self.sync()
        return time.perf_counter() - t0


def _free_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        free, _total = torch.cuda.mem_get_info()
        return int(free)
    return 4 << 30  # the tiny grid is far below any CPU's memory


def _clear(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()


def sweep(
    ctx: Context, timer: DecodeTimer, spec: ModelSpec, batches: tuple[int, ...], contexts: tuple[int, ...]
) -> tuple[list[ProfilePoint], list[str]]:
    """Every (B, L) that fits, context by context; stops when the deadline is near."""
    import torch

    points: list[ProfilePoint] = []
    notes: list[str] = []
    w = timer.window
    rows_cap = PREFILL_TOKENS if ctx.device == "cuda" else 256
    for length in contexts:
        n = max(1, min(max(batches), rows_cap // length))
        p1, pn = timer.prefill_s(1, length), timer.prefill_s(n, length)
        for b in batches:
            need = b * (length + w + 3) * spec.kv_bytes_per_token
            if need > _free_bytes(ctx.device) - (HEADROOM_BYTES if ctx.device == "cuda" else 0):
                notes.append(f"B={b} L={length}: its KV ({need / 2**30:.1f} GiB) does not fit; not measured")
                continue
            last = points[-1].decode_s * (w + 2) if points else 0.0
            if ctx.left_s() < 3 * last + 5:
                notes.append(f"B={b} L={length} and after: not measured (the phase's deadline)")
                return points, notes
            try:
                dec = timer.decode_s(b, length)
            except torch.OutOfMemoryError:
                _clear(ctx.device)
                notes.append(f"B={b} L={length}: out of device memory; not measured")
                continue
            pre = p1 + (pn - p1) * (b - 1) / (n - 1) if n > 1 else p1 * b
            points.append(ProfilePoint(b, length, b * (length + 2 + w / 2), max(pre, 0.0), dec))
            _clear(ctx.device)
    return points, notes


def step_ratio(points: list[ProfilePoint], hi: int = 128, lo: int = 1) -> dict[str, float] | None:
    """The batch-``hi`` / batch-``lo`` decode step ratio at the context nearest ``RATIO_CONTEXT``
    that both were measured at (the figure that says how flat the step is in batch)."""
    by = {(p.batch, p.context): p.decode_s for p in points}
    common = sorted({c for b, c in by if b == hi} & {c for b, c in by if b == lo})
    if not common:
        return None
    c = min(common, key=lambda x: abs(x - RATIO_CONTEXT))
    return {"batch_hi": hi, "batch_lo": lo, "context": c, "ratio": by[(hi, c)] / by[(lo, c)]}


def run(ctx: Context) -> dict[str, Any]:
    import torch

    cuda = ctx.device == "cuda"
    spec = model_spec(ctx.tiny)
    dtype = torch.bfloat16 if cuda else torch.float32
    t0 = time.perf_counter()
    model = build_model(spec, ctx.device, dtype)
    build_s = time.perf_counter() - t0
    timer = DecodeTimer(model, ctx.device, TINY_WINDOW if ctx.tiny else GPU_WINDOW)
    batches, contexts = (TINY_BATCHES, TINY_CONTEXTS) if ctx.tiny else (GPU_BATCHES, GPU_CONTEXTS)
    points, notes = sweep(ctx, timer, spec, batches, contexts)
    if not points:
        raise Skip("no grid point fit in memory and time")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model, timer
    _clear(ctx.device)
    table = _table(ctx, spec, points, weight_bytes, time.perf_counter() - t0)
    path = write_profile(ctx.out / "profile.json", table, time.perf_counter() - t0)
    hi = max(p.batch for p in points) if ctx.tiny else 128
    ratio = step_ratio(points, hi=hi)
    return {
        "model": spec.name,
        "dtype": str(dtype).removeprefix("torch."),
        "build_s": build_s,
        "points": len(points),
        "not_measured": notes,
        "profile_path": str(path),
        "table": dataclasses.asdict(table),
        "step_ratio": ratio,
        "headline": f"{len(points)} points"
        + (
            f"; B={ratio['batch_hi']}/B=1 step at L={ratio['context']}: {ratio['ratio']:.2f}x"
            if ratio
            else ""
        ),
    }


def _table(
    ctx: Context, spec: ModelSpec, points: list[ProfilePoint], weight_bytes: int, seconds: float
) -> ProfileTable:
    probe = ctx.results.get("probe", {})
    copy = probe.get("ceilings", {}).get("copy_gb_s")
    total = probe.get("gpu_memory_bytes") or 8 << 30
    kv_cap = int((total * MEMORY_UTILIZATION - weight_bytes) // spec.kv_bytes_per_token)
    return ProfileTable(
        model=f"{spec.name} (random weights)",
        hardware=probe.get("gpu") or "cpu",
        kv_bytes_per_token=spec.kv_bytes_per_token,
        migration_bandwidth_bps=(copy or 10.0) * 1e9 / 2,  # one-way: half the copy's traffic
        layouts=(LayoutProfile(Layout(1, 1), tuple(points), max(kv_cap, 1)),),
        decode_window=TINY_WINDOW if ctx.tiny else GPU_WINDOW,
        created_s=time.time(),
        profile_seconds=seconds,
    )


ENGINE_NOTE = (
    "rollpacker lab bench gpu: transformers eager forward, sdpa attention, static KV cache per point, "
    "random weights; no CUDA graphs, scheduler or sampler (docs/benchmarks.md)"
)


def write_profile(path: Path, table: ProfileTable, seconds: float) -> Path:
    """The profile document ``rollpacker lab profile`` writes (``table``, ``validation``, ``seconds``),
    so ``--hardware cpu-profile:PATH``, ``bench planner --profile`` and the predictor read it."""
    from rollpacker.lab.bench.gpu.context import write_json

    doc = {
        "table": dataclasses.asdict(table),
        "validation": {},
        "seconds": seconds,
        "total_seconds": seconds,
        "engine": ENGINE_NOTE,
    }
    write_json(doc, path)
    return path
