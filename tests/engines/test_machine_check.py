"""The config against the machine, at load time (``engines/gpus.py``: ``check_machine``): a cuda
engine, trainer or judge where no GPU is visible, a TP or layout larger than the GPUs visible."""

from __future__ import annotations

import pytest

from rollpacker.core.config import config_from_text
from rollpacker.engines.gpus import installed_engine_device, machine_gpus, machine_refusals


def _cfg(extra: str = ""):  # type: ignore[no-untyped-def]
    return config_from_text(f"experiment: x\narms: [sync]\n{extra}")


def test_a_cpu_config_fits_any_machine() -> None:
    assert machine_refusals(_cfg(), 0, "cpu") == []
    assert machine_refusals(_cfg("engine: {tensor_parallel_size: 2}"), 0, "cpu") == []


def test_a_cuda_engine_needs_a_gpu_per_tp_rank_or_layout_device() -> None:
    tp4 = _cfg("engine: {device: cuda, tensor_parallel_size: 4}")
    assert machine_refusals(tp4, 4, "cuda") == []
    (why,) = machine_refusals(tp4, 2, "cuda")
    assert why.startswith("engine.tensor_parallel_size = 4 with engine.device: cuda: it needs 4 GPUs")
    assert "lower it to 2" in why
    (why,) = machine_refusals(_cfg("engine: {device: cuda}"), 0, "cuda")
    assert "shows no GPU" in why and "engine.device: cpu" in why
    layouts = _cfg("engine: {device: cuda}\nplanner: {devices: 4, max_tp: 4}")
    assert machine_refusals(layouts, 2, "cuda")[0].startswith("planner.devices = 4 with engine.device")
    # auto on the CUDA vLLM is named as such; a simulated engine holds no GPU
    assert "(the installed vLLM's)" in machine_refusals(_cfg(), 0, "cuda")[0]
    sim = _cfg("engine: {kind: simulated}\ntrain: {sync_probe: {enabled: false}}")
    assert machine_refusals(sim, 0, "cuda") == []


def test_the_trainer_and_the_judge_on_a_gpu_this_machine_lacks() -> None:
    (why,) = machine_refusals(_cfg("train: {device: 'cuda:1'}"), 1, "cpu")
    assert why.startswith("train.device = cuda:1: this machine shows 1 GPU(s)")
    assert machine_refusals(_cfg("train: {device: 'cuda:0'}"), 1, "cpu") == []
    (why,) = machine_refusals(_cfg("reward: {judge: {device: cuda, model: /m}}"), 0, "cpu")
    assert why.startswith("reward.judge.device = cuda: this machine shows no GPU")


def test_gpus_and_the_engine_device_are_counted_without_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    assert machine_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert machine_gpus() == 0
    monkeypatch.setenv("ROLLPACKER_VLLM_DEVICE", "cuda")
    assert installed_engine_device("auto") == "cuda"
    assert installed_engine_device("cpu") == "cpu"
    monkeypatch.delenv("ROLLPACKER_VLLM_DEVICE")
    assert installed_engine_device("auto") in ("cpu", "cuda", "")  # vLLM unimported: tests/test_refusals.py
