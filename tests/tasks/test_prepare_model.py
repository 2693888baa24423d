"""The model RL starts from: a cached warm-up is one line, not a progress bar stuck at 0."""

from __future__ import annotations

from rollpacker.core.config import config_from_text
from rollpacker.tasks.models import model_identity, prepare_model


def test_a_cached_warm_up_says_cached_instead_of_a_bar(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path))
    cfg = config_from_text("experiment: e\nmodel: {preset: micro, warmup_steps: 7}\n")
    cached = tmp_path / "models" / model_identity(cfg)  # as warm_up caches it
    cached.mkdir(parents=True)
    (cached / "warmup.json").write_text("{}")
    assert prepare_model(cfg) == cached
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"warm-up: cached ({cached})\n")
    assert prepare_model(cfg, quiet=True) == cached
    assert capsys.readouterr() == ("", "")
