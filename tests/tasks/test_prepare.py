"""The model preparation (tasks/prepare.py): the start model in the store before an arm's first
step; "cached" said only when the warm-up came from the cache; a warm-up that trains shows a bar
with its steps and the time left; a start model already in the store is not built or uploaded again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollpacker.core.config import config_from_text
from rollpacker.store.local import FileStore
from rollpacker.tasks import prepare as prep
from rollpacker.tasks.models import PREPARED_MARKER, base_key, model_identity


def _cached(tmp_path: Path, cfg) -> Path:  # type: ignore[no-untyped-def]
    cached = tmp_path / "cache" / "models" / model_identity(cfg)  # as warm_up caches it
    cached.mkdir(parents=True)
    (cached / "warmup.json").write_text("{}")
    (cached / "config.json").write_text("{}")
    return cached


@pytest.fixture
def cfg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    return config_from_text("experiment: e\nmodel: {preset: micro, warmup_steps: 7}\n")


def test_a_cached_warm_up_says_cached_instead_of_a_bar(tmp_path, cfg, capsys) -> None:  # type: ignore[no-untyped-def]
    cached = _cached(tmp_path, cfg)
    assert prep.prepare_model(cfg) == cached
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"warm-up: cached ({cached})\n")
    assert prep.prepare_model(cfg, quiet=True) == cached
    assert capsys.readouterr() == ("", "")


def test_a_warm_up_that_trains_shows_steps_and_time_left_and_never_says_cached(
    tmp_path, cfg, monkeypatch, capsys
):  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "warm"

    def fake_warm_up(spec, progress=None):  # type: ignore[no-untyped-def]
        for s in range(spec.steps):
            progress(s, 1.0 / (s + 1))
        out_dir.mkdir()
        return out_dir

    monkeypatch.setattr("rollpacker.tasks.warmup.warm_up", fake_warm_up)
    said: list[str] = []
    assert prep.prepare_model(cfg, say=said.append) == out_dir
    assert said == ["warm-up: not cached; training 'micro' for 7 steps (once)"]
    bar = capsys.readouterr().err
    assert "cached" not in bar and "warm-up" in bar
    assert "7/7" in bar and "<00:00" in bar  # steps done of all, and the time left


def test_prepare_arm_uploads_once_with_its_marker_last(tmp_path, cfg, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cached = _cached(tmp_path, cfg)
    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    key = base_key(cfg, "sync")
    said: list[str] = []
    got = prep.prepare_arm(cfg, store, "sync", say=said.append)
    assert got == prep.PreparedModel(store.uri(key), "cache")
    assert sorted(store.list(key)) == [key + n for n in ("config.json", PREPARED_MARKER, "warmup.json")]
    assert json.loads(store.get_bytes(key + PREPARED_MARKER))["identity"] == model_identity(cfg)
    assert said == [f"[sync] warm-up: cached ({cached})", f"[sync] start model: uploaded to {store.uri(key)}"]

    def never(*_a, **_k):  # type: ignore[no-untyped-def]
        raise AssertionError("a start model in the store is built again")

    monkeypatch.setattr(prep, "_prepare", never)
    said.clear()
    assert prep.prepare_arm(cfg, store, "sync", say=said.append) == prep.PreparedModel(
        store.uri(key), "store"
    )
    assert said == [f"[sync] start model: in the store ({store.uri(key)})"]


def test_an_interrupted_upload_without_its_marker_is_uploaded_again(tmp_path, cfg) -> None:  # type: ignore[no-untyped-def]
    _cached(tmp_path, cfg)
    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    key = base_key(cfg, "sync")
    store.put_bytes(key + "config.json", b"{}")  # a half upload: no marker
    assert prep.prepare_arm(cfg, store, "sync", quiet=True).source == "cache"
    assert store.exists(key + PREPARED_MARKER)


def test_the_pipeline_edge_prepares_only_an_arm_without_a_state(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from rollpacker.core.state import ControllerState
    from rollpacker.store.state_store import StateStore

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    (tmp_path / "store").mkdir()
    text = (
        f"experiment: e\nstore: {{endpoint: 'file://{tmp_path / 'store'}'}}\n"
        "model: {preset: micro, warmup_steps: 7}\n"
    )
    cfg = config_from_text(text)
    _cached(tmp_path, cfg)
    store = FileStore(tmp_path / "store")
    assert prep.prepare(text, "sync") == store.uri(base_key(cfg, "sync"))
    StateStore(store, "e", "tail_batching").init(ControllerState("e", "tail_batching", -1, 0, 0, 0))
    assert prep.prepare(text, "tail_batching") == ""  # committed already: nothing to prepare
    assert not store.exists(base_key(cfg, "tail_batching") + PREPARED_MARKER)
