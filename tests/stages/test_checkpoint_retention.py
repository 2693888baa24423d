"""checkpoint.keep: the commit stage keeps the newest ``keep`` committed step checkpoints and the
start model, deletes the rest (failed attempts included), and never the committed state's one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rollpacker.core.config import arm_config
from rollpacker.stages import commit
from rollpacker.stages.context import StageContext
from rollpacker.store.local import FileStore
from rollpacker.store.state_store import StateStore
from tests.store.chain import initial

ARM = "sync"


def _ctx(tmp_path: Path, keep: int) -> StageContext:
    (tmp_path / "store").mkdir()
    store = FileStore(tmp_path / "store")
    cfg = arm_config(f"experiment: x\ncheckpoint: {{keep: {keep}}}\n", ARM)
    return StageContext("", ARM, cfg, store, StateStore(store, "x", ARM), services=None)  # type: ignore[arg-type]


def _write(ctx: StageContext, name: str) -> str:
    ctx.store.put_bytes(f"x/{ARM}/ckpt/{name}/model.safetensors", b"w")
    return ctx.store.uri(f"x/{ARM}/ckpt/{name}/")


def _dirs(ctx: StageContext) -> list[str]:
    return sorted({k.split("/")[3] for k in ctx.store.list(f"x/{ARM}/ckpt/")})


def _run(ctx: StageContext, steps: int, every: int = 1) -> list[list[str]]:
    """``steps`` commits as the commit stage makes them (a failed attempt's checkpoint at step 2;
    with ``every`` > 1 a step without a checkpoint points at the last one); the directories after each."""
    state = dataclasses.replace(initial(ctx.states), checkpoint_uri=_write(ctx, "base-m"))
    ctx.states.init(state)
    seen = []
    for n in range(steps):
        if n == 2:
            _write(ctx, f"step-{n:06d}-failed")
        uri = _write(ctx, f"step-{n:06d}-a") if n % every == 0 else state.checkpoint_uri
        new = state.successor(checkpoint_uri=uri)
        commit._collect_garbage(ctx, new, state)
        assert ctx.store.exists(ctx.store.key_of(state.checkpoint_uri) + "model.safetensors")  # committed
        ctx.states.commit(new)
        commit._drop_superseded(ctx, new, state)
        assert ctx.store.exists(ctx.store.key_of(new.checkpoint_uri) + "model.safetensors")  # committed
        state = new
        seen.append(_dirs(ctx))
    return seen


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_the_store_keeps_the_newest_keep_step_checkpoints_and_the_start_model(
    tmp_path: Path, keep: int
) -> None:
    seen = _run(_ctx(tmp_path, keep), 6)
    assert seen[-1] == ["base-m", *(f"step-{n:06d}-a" for n in range(6 - keep, 6))]
    assert all(len(d) <= 1 + keep + (1 if i == 2 else 0) for i, d in enumerate(seen))


def test_steps_sharing_a_checkpoint_count_it_once(tmp_path: Path) -> None:
    """With a checkpoint every 2 steps the last 2 checkpoints span 4 committed states."""
    assert _run(_ctx(tmp_path, 2), 7, every=2)[-1] == ["base-m", "step-000004-a", "step-000006-a"]


def test_keep_must_be_positive() -> None:
    from rollpacker.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint.keep = 0: must be a positive integer"):
        arm_config("checkpoint: {keep: 0}\n", ARM)
