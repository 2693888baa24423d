"""Model preparation: the model an arm's RL starts from, built (the warm-up) and put in the store
before the arm's first step. It runs in the runners (``rollpacker run``, ``make run-experiment``,
``rollpacker train``) with its own progress bar, and in the pipeline's ``prepare-model`` task (the
training image: it has torch); never inside a stage (the layer test forbids ``stages`` importing
this module). The plan stage only reads the prepared model from the store (``tasks.models.base_key``).

Invariants (tests/tasks/test_prepare.py):
- an arm's start model is in the store under ``base_key`` with ``PREPARED_MARKER`` written after
  its last file: a prefix without the marker (an interrupted upload) is uploaded again;
- a start model already in the store is neither built nor uploaded again;
- the terminal says "cached" only when the warmed-up model came from the cache, "shipped" when it
  was installed from the models shipped with rollpacker (tasks/shipped.py); a warm-up that trains
  shows a bar with its steps and the time left.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.logs import console
from rollpacker.store.base import ObjectStore
from rollpacker.tasks.models import PREPARED_MARKER, base_key, check_model, model_identity, warmup_spec


@dataclass(frozen=True)
class PreparedModel:
    """An arm's start model in the store: its URI, and how it got there."""

    uri: str
    # "store" (already there), "model_dir", "tiny", "cache" (a cached warm-up), "shipped" (the
    # warm-up shipped with rollpacker for the same key, installed into the cache), "warm-up"
    source: str


def prepare_model(
    cfg: ExperimentConfig, quiet: bool = False, say: Callable[[str], None] | None = None
) -> Path:
    """The model RL starts from on this machine: ``model.model_dir``, or the warmed-up tiny model
    (cached; unless ``quiet``, a bar with the steps and the time left while it trains, or one line
    saying it is cached, to ``logs.console()``)."""
    return _prepare(cfg, quiet, say)[0]


def prepare_arm(
    cfg: ExperimentConfig,
    store: ObjectStore,
    arm: str,
    quiet: bool = False,
    say: Callable[[str], None] | None = None,
) -> PreparedModel:
    """Put ``arm``'s start model in ``store`` under ``base_key`` unless it is there (marker and all)."""
    key = base_key(cfg, arm)
    uri = store.uri(key)
    if store.exists(key + PREPARED_MARKER):
        _say(say, quiet, f"[{arm}] start model: in the store ({uri})")
        return PreparedModel(uri, "store")
    path, source = _prepare(cfg, quiet, say, arm)
    store.upload_dir(path, key)
    marker = {"identity": model_identity(cfg), "source": source, "path": str(path)}
    store.put_bytes(key + PREPARED_MARKER, json.dumps(marker).encode(), "application/json")
    _say(say, quiet, f"[{arm}] start model: uploaded to {uri}")
    return PreparedModel(uri, source)


def _prepare(
    cfg: ExperimentConfig, quiet: bool, say: Callable[[str], None] | None, arm: str = ""
) -> tuple[Path, str]:
    from rollpacker.tasks.warmup import cached_warm_up, shipped_warm_up, warm_up

    check_model(cfg)  # nothing is built for a config the model cannot take
    who = f"[{arm}] " if arm else ""
    if cfg.model.model_dir:
        p = Path(cfg.model.model_dir)
        if not (p / "config.json").is_file():
            raise ConfigError(f"model.model_dir = {p}: not a Hugging Face model directory (no config.json)")
        return p, "model_dir"
    if cfg.model.warmup_steps == 0:
        from rollpacker.tasks.tiny_model import build_tiny_model

        return build_tiny_model(cfg.model.preset), "tiny"
    spec = warmup_spec(cfg)
    cached = cached_warm_up(spec)
    if cached is not None:
        _say(say, quiet, f"{who}warm-up: cached ({cached})")
        return cached, "cache"
    installed = shipped_warm_up(spec)
    if installed is not None:
        _say(say, quiet, f"{who}warm-up: shipped with rollpacker, installed to {installed}")
        return installed, "shipped"
    from tqdm import tqdm

    _say(say, quiet, f"{who}warm-up: not cached; training {cfg.model.preset!r} for {spec.steps} steps (once)")
    bar = tqdm(total=spec.steps, desc=f"{who}warm-up", unit="step", disable=quiet, file=console())

    def progress(step: int, loss: float) -> None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")

    try:
        return warm_up(spec, progress=progress), "warm-up"
    finally:
        bar.close()


def _say(say: Callable[[str], None] | None, quiet: bool, line: str) -> None:
    if quiet:
        return
    if say is not None:
        say(line)
    else:
        print(line, file=console(), flush=True)


def prepare(config: str, arm: str) -> str:
    """The pipeline's prepare-model task (JSON text in, text out): ``arm``'s start model in the
    config's store; its URI, or "" when the arm already has a committed state (nothing to prepare)."""
    from rollpacker.core.config import arm_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    cfg = arm_config(config, arm)
    store = open_store(cfg.store)
    store.check()
    if StateStore(store, cfg.experiment, arm).latest() is not None:
        return ""
    return prepare_arm(cfg, store, arm).uri
