"""Engine layouts on GPUs, on a fake-CUDA layer: vLLM's platform says cuda, the process was given
GPUs (``CUDA_VISIBLE_DEVICES``, as Ray sets it), NVML reports memory, and each vLLM engine started
is a simulated one that takes its ``gpu_memory_utilization`` share of the GPUs it was pinned to.
Nothing under test is faked: the layouts, the pool, the rollout service's layout start and vLLM's
``EngineArgs`` builder run as on a cluster.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import rollpacker.engines.gpus as gpus
import rollpacker.engines.layout as layout
import rollpacker.engines.vllm_engine as vllm_engine
from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import ConfigError, EngineError, RollpackerError
from rollpacker.core.latency import Layout
from rollpacker.core.state import TPPlan
from rollpacker.core.types import GenerationRequest, Prompt, RoundKind, SamplingSpec
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.layout import EnginePool, SwitchingEngine, node_devices, resident_layouts
from rollpacker.engines.vllm_engine import engine_args
from rollpacker.rollout.driver import generate
from tests.services.test_scaledown_runtime import start_state

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30
RAY_GPUS = "8,9,10,11,12,13,14,15"  # the 8 GPUs Ray gave the rollout actor on a 16-GPU node


class FakeCuda:
    """The GPUs of a node: total memory each, and what the running simulated engines hold."""

    def __init__(self, total_gib: float = 80.0) -> None:
        self.total = int(total_gib * GIB)
        self.used: dict[str, int] = {}
        self.started: list[dict[str, Any]] = []  # per engine start: env, tp, utilization

    # -- NVML, as vLLM's vendored pynvml answers (device handles by index or UUID) --------------
    def nvmlDeviceGetCount(self) -> int:
        return 16

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        assert isinstance(i, int) and 0 <= i < 16
        return str(i)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return str(int(uuid.rsplit("-", 1)[1]))

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(free=self.total - self.used.get(handle, 0), total=self.total)

    def nvmlDeviceGetName(self, handle: str) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def engine_class(self) -> type:
        cuda = self

        class SimulatedVLLM(FakeEngine):
            """vLLM started on the GPUs ``CUDA_VISIBLE_DEVICES`` names, as its processes see them."""

            def __init__(self, cfg: EngineConfig, in_process: bool = True, step_curve: Any = None) -> None:
                super().__init__(concurrency=cfg.max_num_seqs, tp_size=cfg.tensor_parallel_size)
                self.cfg = cfg
                self.gpus = os.environ["CUDA_VISIBLE_DEVICES"].split(",")
                share = int(cfg.gpu_memory_utilization * cuda.total)
                for g in self.gpus:  # vLLM's start-up check: the share must be free
                    if cuda.total - cuda.used.get(g, 0) < share:
                        raise EngineError(f"simulated vLLM: GPU {g} lacks free memory")
                for g in self.gpus:
                    cuda.used[g] = cuda.used.get(g, 0) + share
                self.share = share
                # what the profiler reads of vLLM: the KV cache's blocks
                cache = SimpleNamespace(num_gpu_blocks=4096, block_size=16)
                self._engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))
                self.closed = False
                cuda.started.append(
                    {
                        "gpus": tuple(self.gpus),
                        "tp": cfg.tensor_parallel_size,
                        "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                        "engine": self,
                    }
                )

            def close(self) -> None:
                if not self.closed:
                    for g in self.gpus:
                        cuda.used[g] -= self.share
                self.closed = True
                super().close()

        return SimulatedVLLM


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """vLLM on CUDA (its platform, not $ROLLPACKER_VLLM_DEVICE, says so), 8 GPUs given by Ray."""
    fake = FakeCuda()
    monkeypatch.delenv(gpus.DEVICE_ENV, raising=False)
    monkeypatch.setattr(gpus, "_vllm_platform", lambda: "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", RAY_GPUS)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(gpus, "_nvml", lambda: fake)
    monkeypatch.setattr(layout, "GPU_FREE_WAIT_S", 0.0)
    monkeypatch.setattr(vllm_engine, "VLLMEngine", fake.engine_class())
    return fake


def _cfg(**kw: Any) -> EngineConfig:
    return EngineConfig(**{"model_dir": "/models/Qwen2.5-7B", "dtype": "bfloat16", **kw})


def _live(cuda: FakeCuda) -> list[dict[str, Any]]:
    return [s for s in cuda.started if not s["engine"].closed]


def test_layout_replicas_bind_disjoint_gpus_of_the_given_ones_not_cpu_cores(cuda: FakeCuda) -> None:
    devices = node_devices()
    assert devices == RAY_GPUS.split(","), "the GPUs Ray gave, not this machine's CPU cores"
    pool = EnginePool(_cfg(), [Layout(2, 4)], devices)
    try:
        groups = [s["gpus"] for s in cuda.started]
        assert groups == [("8", "9"), ("10", "11"), ("12", "13"), ("14", "15")]
        flat = [g for grp in groups for g in grp]
        assert len(set(flat)) == len(flat) == 8, "disjoint, and engines x TP = every given GPU"
        assert all(s["tp"] == 2 and s["omp_bind"] is None for s in cuda.started)
    finally:
        pool.close()
    assert all(v == 0 for v in cuda.used.values()), "closing the pool frees every GPU"


def test_the_pool_keeps_as_many_layouts_started_as_the_gpus_hold(cuda: FakeCuda) -> None:
    lays = [Layout(1, 8), Layout(2, 4), Layout(4, 2), Layout(8, 1)]
    assert resident_layouts("cuda", 0.9, 4) == 1 and resident_layouts("cuda", 0.45, 4) == 2
    assert resident_layouts("cuda", 0.25, 4) == 4 and resident_layouts("cpu", 0.9, 4) == 4
    pool = EnginePool(_cfg(), lays, node_devices())
    try:
        assert pool.started == (Layout(1, 8),) and pool.layouts == tuple(lays)
        pool.load_weights([("w", 1.0)])  # the trainer's push, before another layout starts
        eng = pool[Layout(4, 2)]  # the TP plan moved: one layout closes, the other starts
        assert pool.started == (Layout(4, 2),)
        live = _live(cuda)
        assert [s["gpus"] for s in live] == [("8", "9", "10", "11"), ("12", "13", "14", "15")]
        assert all(s["tp"] == 4 for s in live)
        assert max(cuda.used.values()) <= cuda.total, "one engine per GPU at 0.9"
        ref = FakeEngine()
        ref.load_weights([("w", 1.0)])
        assert all(r._weights_version == ref._weights_version for r in eng.replicas), (
            "a layout started later serves the last pushed weights"
        )
    finally:
        pool.close()
    half = EnginePool(_cfg(gpu_memory_utilization=0.45), lays, node_devices())
    try:
        half[Layout(2, 4)]
        assert half.started == (Layout(1, 8), Layout(2, 4)), "two layouts warm at 0.45"
        half[Layout(8, 1)]
        assert half.started == (Layout(2, 4), Layout(8, 1)), "the least recently used one closed"
        assert max(cuda.used.values()) <= cuda.total
    finally:
        half.close()


def test_preemptions_of_a_closed_layout_still_count(cuda: FakeCuda) -> None:
    pool = EnginePool(_cfg(), [Layout(1, 8), Layout(2, 4)], node_devices())
    try:
        pool[Layout(1, 8)].replicas[0]._preemptions = 3
        pool[Layout(2, 4)]
        assert pool.num_preemptions() == 3, "num_preemptions never decreases"
    finally:
        pool.close()


def test_a_gpu_that_cannot_hold_its_engines_is_refused_by_name(cuda: FakeCuda) -> None:
    with pytest.raises(EngineError, match=r"GPU 8 would hold 2 engines .* 1\.20 of its memory"):
        gpus.check_gpu_shares({"tp1dp8/r0": ["8"], "tp2dp4/r0": ["8", "9"]}, 0.6)
    gpus.check_gpu_shares({"a": ["8"], "b": ["8"]}, 0.5)  # exactly full is allowed
    cuda.used["11"] = 30 * GIB  # another arm's engine (or a leftover one) holds GPU 11
    with pytest.raises(EngineError, match=r"GPU 11 has 50\.0 GiB free of 80\.0 GiB; .* needs 72\.0 GiB"):
        EnginePool(_cfg(), [Layout(1, 8)], node_devices())
    assert not _live(cuda), "nothing stays started after the refusal"


def test_gpu_memory_utilization_is_validated() -> None:
    assert EngineConfig().gpu_memory_utilization == 0.9
    for bad in (0, 1.5, -0.1, True):
        with pytest.raises(ConfigError, match=r"engine.gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match=r"engine.cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(ConfigError, match=r"engine.device"):
        EngineConfig(device="tpu")


def test_vllm_args_on_cuda_capture_graphs_and_take_the_memory_share() -> None:
    a = engine_args(Path("/m"), _cfg(gpu_memory_utilization=0.8, tensor_parallel_size=4), "cuda")
    assert a["enforce_eager"] is False, "CUDA graphs on by default on GPUs"
    assert a["gpu_memory_utilization"] == 0.8
    assert a["async_scheduling"] is False, "vLLM's async scheduling (on by default on CUDA) is off"
    assert a["tensor_parallel_size"] == 4 and a["distributed_executor_backend"] == "mp"
    # the collective weight push through vLLM's weight-transfer API, its backend registered by the
    # worker extension in every worker process (engines/weight_transfer.py)
    assert a["weight_transfer_config"] == {"backend": "rollpacker"}
    assert a["worker_extension_cls"] == "rollpacker.engines.vllm_transfer_ext.PushReportExtension"
    assert engine_args(Path("/m"), _cfg(cuda_graphs=False), "cuda")["enforce_eager"] is True
    c = engine_args(Path("/m"), _cfg(), "cpu")
    assert c["enforce_eager"] is True and "gpu_memory_utilization" not in c
    assert c["async_scheduling"] is False
    with pytest.raises(EngineError, match="cuda_graphs = true needs vLLM on CUDA"):
        engine_args(Path("/m"), _cfg(cuda_graphs=True), "cpu")


def _cluster_service(text: str) -> Any:
    from rollpacker.services.rollout import RolloutService

    return RolloutService(text, "tail_batching")


def test_the_cluster_config_runs_the_planned_tp_on_every_rollout_gpu(cuda: FakeCuda) -> None:
    """configs/cluster.yaml on 8 GPUs: engines x TP = 8, and the state's TP plan picks the layout."""
    text = (REPO / "configs" / "cluster.yaml").read_text()
    svc = _cluster_service(text)
    ecfg = dataclasses.replace(svc.cfg.engine, model_dir="/models/Qwen2.5-7B")
    svc.engine = svc._start_layouts(ecfg)
    try:
        assert isinstance(svc.engine, SwitchingEngine)
        assert sorted(g for s in _live(cuda) for g in s["gpus"]) == sorted(RAY_GPUS.split(","))
        state = dataclasses.replace(start_state("c", "tail_batching", "s3://b/ckpt"), tp_plan=TPPlan(4, 2))
        m = svc._prepare_layout(state, RoundKind.SHORT)
        assert m == {"rollout/tp": 4.0, "rollout/dp": 2.0}
        for s in _live(cuda):  # started on demand, and warmed before it serves (as the pool's first)
            assert any(rid.startswith("warm/tp4dp2/") for rid in s["engine"]._all_ids)
        assert [(s["tp"], s["gpus"]) for s in _live(cuda)] == [
            (4, ("8", "9", "10", "11")),
            (4, ("12", "13", "14", "15")),
        ]
        reqs = [
            GenerationRequest(f"r{i}", Prompt(f"p{i}", (1, 2, 3)), 0, SamplingSpec(max_tokens=4))
            for i in range(6)
        ]
        assert len(generate(svc.engine, reqs)) == 6, "the TP-4 layout serves the round"
        svc._prepare_layout(state, RoundKind.LONG)
        assert [s["tp"] for s in _live(cuda)] == [2] * 4, "long rounds keep their own TP"
    finally:
        svc.close()


def test_a_rollout_service_that_would_leave_gpus_idle_is_refused(cuda: FakeCuda) -> None:
    from rollpacker.services.rollout import rollout_devices

    assert rollout_devices(_cfg(), 8) == RAY_GPUS.split(",")
    with pytest.raises(RollpackerError, match=r"holds 8 GPUs .* planner.devices = 4 uses 4"):
        rollout_devices(_cfg(), 4)
    with pytest.raises(RollpackerError, match=r"one engine of engine.tensor_parallel_size = 1"):
        rollout_devices(_cfg(), 0)
    assert rollout_devices(_cfg(), 2, ["3", "5"]) == ["3", "5"], "Ray's get_gpu_ids() first"
    assert rollout_devices(_cfg(tensor_parallel_size=8), 0) == RAY_GPUS.split(",")


def test_a_process_given_no_gpu_is_refused(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(EngineError, match="was given no GPU"):
        node_devices()


def test_nvml_answers_for_the_given_gpus_by_index_or_uuid(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.engines.profiler import _hardware

    cuda.used["9"] = 8 * GIB
    assert gpus.gpu_memory(["9", "GPU-aaaa-10"]) == {
        "9": (72 * GIB, 80 * GIB),
        "GPU-aaaa-10": (80 * GIB, 80 * GIB),
    }
    assert _hardware() == "8x NVIDIA H100 80GB HBM3", "named from NVML, no CUDA context in the service"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert len(gpus.visible_gpus()) == 16, "no CUDA_VISIBLE_DEVICES: every GPU the pod's NVML sees"


def test_a_resumed_run_starts_on_its_planned_tp_and_never_starts_layouts_below_min_tp(
    cuda: FakeCuda,
) -> None:
    text = (
        (REPO / "configs" / "cluster.yaml")
        .read_text()
        .replace("  initial_tp: 1", "  min_tp: 2\n  initial_tp: 2")
    )
    svc = _cluster_service(text)
    ecfg = dataclasses.replace(svc.cfg.engine, model_dir="/models/Qwen2.5-7B")
    svc.engine = svc._start_layouts(ecfg, 4)  # the committed state's short-round TP
    try:
        assert [s["tp"] for s in cuda.started] == [4, 4], "no engine started on a layout left at once"
        assert svc.engine.current == Layout(4, 2)
        assert Layout(1, 8) not in svc.engine.pool.layouts and Layout(2, 4) in svc.engine.pool.layouts
    finally:
        svc.close()


def test_profiling_on_gpus_restarts_as_few_layouts_as_it_can(cuda: FakeCuda, tmp_path: Path) -> None:
    """One layout started at a time: the held-out check starts on the layout profiled last."""
    import json

    from rollpacker.engines.profiler import ProfileSpec, profile_and_check

    model = tmp_path / "model"
    model.mkdir()
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}
    (model / "config.json").write_text(json.dumps(shape))
    lays = (Layout(1, 8), Layout(2, 4))
    pool = EnginePool(_cfg(model_dir=str(model), max_num_seqs=8), lays, node_devices())
    try:
        spec = ProfileSpec(layouts=lays, batches=(1, 2), contexts=(16,), window=4)
        held_out = [Prompt(f"h{i}", tuple(range(1, 9))) for i in range(4)]
        doc = profile_and_check(pool, spec, held_out, max_tokens=8, window=4)
        started = [s["tp"] for s in cuda.started]
        assert started == [1] * 8 + [2] * 4 + [1] * 8, "tp1, tp2, then tp1 again: never tp2 twice"
        assert list(doc["validation"]) == ["tp1dp8", "tp2dp4"] and doc["table"]["hardware"].startswith("8x")
    finally:
        pool.close()


def test_the_rollout_service_takes_the_gpus_ray_gave_its_actor(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from rollpacker.services.rollout import RolloutService

    ray = SimpleNamespace(is_initialized=lambda: True, get_gpu_ids=lambda: [3, 5])
    monkeypatch.setitem(sys.modules, "ray", ray)
    assert RolloutService._given_gpus() == ["3", "5"]
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert RolloutService._given_gpus() is None, "none given: the visible devices decide"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert RolloutService._given_gpus() is None, "services in this process: no Ray"
