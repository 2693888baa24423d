"""The torch backend trains on the device and in the dtype it is given (``train.device``,
``train.dtype``): ``auto`` is cuda where a GPU is visible (faked at torch's edge here), refused on
a config that declares GPUs when none is, and a real CPU run in bfloat16 through the service."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollpacker.core.config import TrainerConfig
from rollpacker.core.errors import ConfigError
from rollpacker.trainers.torch_trainer import TorchTrainer, train_placement
from tests.services.test_scaledown_runtime import _group
from tests.services.test_trainer_attempts import _service

GPU_CONFIG = ("train.megatron.gpus_per_rank: 1",)


def fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """torch sees ``n`` GPUs (the outer edge: nothing is ever placed on one here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_auto_trains_on_a_visible_gpu_in_the_configured_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 1)
    assert train_placement(TrainerConfig(dtype="bfloat16")) == ("cuda", torch.bfloat16)
    assert train_placement(TrainerConfig(device="cuda:0"), GPU_CONFIG) == ("cuda:0", torch.float32)
    assert train_placement(TrainerConfig(device="cpu"), GPU_CONFIG) == ("cpu", torch.float32)  # told
    fake_gpus(monkeypatch, 0)
    assert train_placement(TrainerConfig()) == ("cpu", torch.float32)  # a CPU config: the CPU


def test_auto_on_the_cpu_is_refused_where_the_config_declares_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"train\.device: auto found no GPU.*set train\.device: cpu"):
        train_placement(TrainerConfig(), GPU_CONFIG)
    with pytest.raises(ConfigError, match=r"train\.device = cuda: this process sees no GPU"):
        train_placement(TrainerConfig(device="cuda"))
    assert train_placement(TrainerConfig(device="cpu"), GPU_CONFIG)[0] == "cpu"


def test_the_service_trains_in_the_configured_dtype_on_the_cpu(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A real run: the trainer service builds the torch trainer in bfloat16 on the given device,
    takes an update, and its checkpoint reloads in bfloat16."""
    svc, state, base = _service(tmp_path, monkeypatch, "train: {device: cpu, dtype: bfloat16}\n")
    svc.begin("a0", state, base)
    params = list(svc.trainer.model.parameters())
    assert {(p.device.type, p.dtype) for p in params} == {("cpu", torch.bfloat16)}
    before = [p.detach().clone() for p in params]
    svc.submit("a0", "g0", _group("g0", 0))
    report = svc.finish("a0", 0, ("g0",), "t/ckpt/a0/", "t/batch/a0")
    assert report.policy_version == 1
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))  # it trained
    assert all(torch.isfinite(p).all() for p in params)
    svc.close()
    from rollpacker.store.base import cached_download

    ck = cached_download(svc.store(), report.checkpoint_uri, tmp_path / "ck")
    again = TorchTrainer(ck / "model", TrainerConfig(), dtype=torch.bfloat16)
    again.load_checkpoint(ck)
    assert again.policy_version == 1
    assert all(torch.equal(a, b) for a, b in zip(again.model.parameters(), params, strict=True))


def test_the_service_refuses_a_cpu_fallback_on_a_gpu_config(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    fake_gpus(monkeypatch, 0)
    judge_on_gpu = "reward: {judge: {model: /models/judge, device: cuda}}\n"
    svc, state, base = _service(tmp_path, monkeypatch, judge_on_gpu)
    with pytest.raises(ConfigError, match=r"train\.device: auto found no GPU.*reward\.judge\.device: cuda"):
        svc.begin("a0", state, base)
    svc.close()


@pytest.mark.gpu
def test_the_torch_backend_trains_on_a_real_gpu_in_bfloat16(small_model_dir: Path, tmp_path: Path) -> None:
    """On a GPU: auto is cuda, the update runs there in bfloat16, and its checkpoint reloads."""
    from tests.trainers.conftest import make_batch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = TrainerConfig(dtype="bfloat16")
    device, dtype = train_placement(cfg, ("train.device: cuda",))
    tr = TorchTrainer(small_model_dir, cfg, dtype=dtype, device=device)
    assert {(p.device.type, p.dtype) for p in tr.model.parameters()} == {("cuda", torch.bfloat16)}
    tr.accumulate([s for g in make_batch(2, 4, seed=0) for s in g])
    stats = tr.finish_step()
    assert stats.policy_version == 1 and torch.isfinite(torch.tensor(stats.loss))
    ck = tr.save_checkpoint(tmp_path / "ck")
    again = TorchTrainer(ck / "model", cfg, dtype=dtype, device=device)
    again.load_checkpoint(ck)
    assert all(
        torch.equal(a, b) for a, b in zip(again.model.parameters(), tr.model.parameters(), strict=True)
    )
