"""The trainer service with ``train.backend: megatron``: a healthy gang reloads the committed
checkpoint in place; a broken one (a rank died) is closed and rebuilt from it; the base model
(no trainer.json) builds a fresh gang from its weights."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from rollpacker.core.config import ExperimentConfig, MegatronConfig, TrainerConfig
from rollpacker.services.trainer import TrainerService
from rollpacker.trainers.megatron import gang


class FakeGang:
    """Stands in for the Ray gang (the outer edge); records what the service asks of it."""

    built: ClassVar[list[FakeGang]] = []

    def __init__(self, model_dir: Path, cfg: TrainerConfig, temperature: float, longest_tokens: int) -> None:
        self.model_dir, self.cfg, self.temperature = model_dir, cfg, temperature
        self.longest_tokens = longest_tokens  # the memory preflight's longest sequence
        self.broken = ""
        self.loaded: list[Path] = []
        self.closed = False
        FakeGang.built.append(self)

    def load_checkpoint(self, path: Path) -> None:
        self.loaded.append(path)

    def close(self) -> None:
        self.closed = True


def _checkpoint(tmp: Path, name: str) -> Path:
    ck = tmp / name
    (ck / "model").mkdir(parents=True)
    (ck / "trainer.json").write_text(json.dumps({"version": 1, "backend": "megatron"}))
    return ck


def test_restore_reuses_a_healthy_gang_and_rebuilds_a_broken_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gang, "MegatronTrainer", FakeGang)
    FakeGang.built = []
    cfg = ExperimentConfig(train=TrainerConfig(backend="megatron", megatron=MegatronConfig(tp=2)))
    svc: Any = SimpleNamespace(cfg=cfg, trainer=None)

    base = tmp_path / "base"
    base.mkdir()
    TrainerService._restore_megatron(svc, base)  # the base model: built from it, nothing to load
    first = svc.trainer
    assert FakeGang.built == [first] and first.model_dir == base and first.loaded == []
    assert first.cfg.megatron.tp == 2
    assert first.longest_tokens == cfg.engine.max_model_len  # prompt + response

    ck1 = _checkpoint(tmp_path, "ck1")
    TrainerService._restore_megatron(svc, ck1)  # healthy: reloads in place
    assert svc.trainer is first and first.loaded == [ck1] and len(FakeGang.built) == 1

    first.broken = "a rank died during accumulate"
    ck2 = _checkpoint(tmp_path, "ck2")
    TrainerService._restore_megatron(svc, ck2)  # broken: closed, rebuilt from ck2, loaded
    assert first.closed and svc.trainer is not first
    assert svc.trainer.model_dir == ck2 / "model" and svc.trainer.loaded == [ck2]

    second = svc.trainer
    TrainerService._restore_megatron(svc, base)  # back to the base model: a fresh gang (and optimizer)
    assert second.closed and svc.trainer is not second and svc.trainer.loaded == []
