"""The trainer service with ``train.backend: megatron``: a healthy gang reloads the committed
checkpoint in place; a broken one (a rank died) is closed and rebuilt from it; the base model
(no trainer.json) builds a fresh gang from its weights. The gang gets store URIs, never a path of
the service's pod, and the service downloads nothing (the ranks fetch their own parts)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from rollpacker.core.config import ExperimentConfig, MegatronConfig, StoreConfig, TrainerConfig
from rollpacker.services.trainer import TrainerService
from rollpacker.store import open_store
from rollpacker.trainers.megatron import gang
from rollpacker.trainers.megatron.source import StoreSource


class FakeGang:
    """Stands in for the Ray gang (the outer edge); records what the service asks of it."""

    built: ClassVar[list[FakeGang]] = []

    def __init__(
        self, model: StoreSource, cfg: TrainerConfig, temperature: float, longest_tokens: int
    ) -> None:
        assert isinstance(model, StoreSource), model  # a URI in the store, not a path of this pod
        self.model, self.cfg, self.temperature = model.uri, cfg, temperature
        self.longest_tokens = longest_tokens  # the memory preflight's longest sequence
        self.broken = ""
        self.loaded: list[str] = []
        self.closed = False
        FakeGang.built.append(self)

    def restore(self, src: StoreSource) -> None:
        self.loaded.append(src.uri)

    def close(self) -> None:
        self.closed = True


def _checkpoint(store: Any, name: str) -> str:
    store.put_bytes(f"{name}/model/config.json", b"{}")
    store.put_bytes(f"{name}/trainer.json", json.dumps({"version": 1, "backend": "megatron"}).encode())
    return str(store.uri(name))


def test_restore_reuses_a_healthy_gang_and_rebuilds_a_broken_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gang, "MegatronTrainer", FakeGang)
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))  # where a download would land
    FakeGang.built = []
    store_cfg = StoreConfig(endpoint=f"file://{tmp_path / 'store'}")
    cfg = ExperimentConfig(
        store=store_cfg, train=TrainerConfig(backend="megatron", megatron=MegatronConfig(tp=2))
    )
    svc: Any = SimpleNamespace(cfg=cfg, trainer=None)
    store = open_store(store_cfg)

    store.put_bytes("base/config.json", b"{}")
    base = str(store.uri("base"))
    TrainerService._restore_megatron(svc, base)  # the base model: built from it, nothing to load
    first = svc.trainer
    assert FakeGang.built == [first] and first.model == base and first.loaded == []
    assert first.cfg.megatron.tp == 2
    assert first.longest_tokens == cfg.engine.max_model_len  # prompt + response

    ck1 = _checkpoint(store, "ck1")
    TrainerService._restore_megatron(svc, ck1)  # healthy: reloads in place
    assert svc.trainer is first and first.loaded == [ck1] and len(FakeGang.built) == 1

    first.broken = "a rank died during accumulate"
    ck2 = _checkpoint(store, "ck2")
    TrainerService._restore_megatron(svc, ck2)  # broken: closed, rebuilt from ck2, loaded
    assert first.closed and svc.trainer is not first
    assert svc.trainer.model == f"{ck2}/model" and svc.trainer.loaded == [ck2]

    second = svc.trainer
    TrainerService._restore_megatron(svc, base)  # back to the base model: a fresh gang (and optimizer)
    assert second.closed and svc.trainer is not second and svc.trainer.loaded == []
    assert not (tmp_path / "cache").exists()  # the service downloaded nothing
