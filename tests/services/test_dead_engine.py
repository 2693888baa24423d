"""The rollout service and a dead engine: an engine whose core process died fails the waiting call
with the engine's error, and the service closes and forgets it, so that the step's next attempt
(its sync) starts a fresh engine on the committed checkpoint instead of calling the dead one again.

The engine is the outer edge faked here: ``FakeEngine`` replicas (whose ``kill`` is what a SIGKILL
of vLLM's engine core does to ``VLLMEngine``: tested on the real engine in
tests/engines/test_engine_core_death.py) behind the real ``LayoutEngine`` and ``SwitchingEngine``;
the service, its round and its sync are the real ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.errors import EngineError, RollpackerError
from rollpacker.core.latency import Layout
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.layout import EnginePool, LayoutEngine, SwitchingEngine
from tests.services.fakes import RoundPeers
from tests.services.test_scaledown_runtime import start_state

DP2 = Layout(1, 2)

CONFIG = """
experiment: dead-test
task: {{name: synthetic_math, num_examples: 200, val_size: 16}}
rollout: {{policy: tail_batching, prompts_per_step: 4, responses_per_prompt: 4, max_tokens: 200}}
planner: {{devices: 2, max_tp: 1}}
store: {{endpoint: "file://{root}"}}
"""


class _Replica(FakeEngine):
    """A simulated replica whose engine core dies at its ``die_at``-th step (never when 0)."""

    kv_capacity_tokens = 1 << 20

    def __init__(self, die_at: int = 0, **kw: Any) -> None:
        super().__init__(**kw)
        self.die_at, self.steps, self.closed = die_at, 0, False

    def step(self) -> Any:
        self.steps += 1
        if self.steps == self.die_at:
            self.kill("SIGKILL planted by the test")
        return super().step()

    def close(self) -> None:
        self.closed = True
        super().close()


def _engine(die_at: int = 0) -> tuple[SwitchingEngine, list[_Replica]]:
    from rollpacker.tasks.tiny_model import vocab

    reps = [
        _Replica(die_at if i == 1 else 0, concurrency=512, vocab_size=len(vocab()), stop_prob=1 / 48)
        for i in range(2)
    ]
    pool = EnginePool.of({DP2: LayoutEngine(DP2, reps, virtual=True)})
    return SwitchingEngine(pool, None, DP2, enabled=False), reps


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A rollout service serving ``file:///ckpt-0`` on fake replicas whose second replica dies at
    its 5th step; its next engine (started by a sync) is recorded in ``svc.started``."""
    import rollpacker.services.rollout as rollout
    from rollpacker.tasks.tiny_model import build_tiny_model

    model = build_tiny_model("micro")
    monkeypatch.setattr(rollout, "cached_download", lambda *_a, **_k: model)
    svc = rollout.RolloutService(CONFIG.format(root=tmp_path), "tail_batching")
    svc.bind(RoundPeers())
    svc.model_dir = model
    svc.engine, svc.replicas = _engine(die_at=5)
    svc.checkpoint_uri, svc.policy_version = "file:///ckpt-0", 0
    svc.started = []

    def start(_ecfg: Any, _first_tp: int = 0) -> SwitchingEngine:
        eng, _ = _engine()
        svc.started.append(eng)
        return eng

    monkeypatch.setattr(svc, "_start_layouts", start)
    return svc


def test_a_round_whose_engine_dies_fails_and_the_next_sync_starts_a_new_engine(service: Any) -> None:
    svc = service
    with pytest.raises(EngineError, match="SIGKILL planted by the test"):
        svc.run_round(start_state("dead-test", "tail_batching", "file:///ckpt-0"), 0, "att1")
    assert svc.engine is None and svc.checkpoint_uri == "", "the dead engine is forgotten"
    assert all(r.closed for r in svc.replicas), "and closed"
    with pytest.raises(RollpackerError, match="no engine for the round"):  # not an AttributeError
        svc.run_round(start_state("dead-test", "tail_batching", "file:///ckpt-0"), 0, "att2")
    # the step's retry: the same committed checkpoint, yet a new engine starts (not a no-op sync)
    sync = svc.sync(start_state("dead-test", "tail_batching", "file:///ckpt-0"))
    assert sync.started and len(svc.started) == 1 and svc.engine is svc.started[0]
    report = svc.run_round(start_state("dead-test", "tail_batching", "file:///ckpt-0"), 0, "att3")
    assert len(report.trained) == 4


def test_a_sync_on_the_same_checkpoint_replaces_an_engine_that_died_between_steps(service: Any) -> None:
    svc = service
    svc.replicas[0].kill("died while idle")
    assert svc.engine.dead
    sync = svc.sync(start_state("dead-test", "tail_batching", "file:///ckpt-0"))
    assert sync.started and svc.engine is svc.started[0] and not svc.engine.dead
    assert all(r.closed for r in svc.replicas)


def test_a_healthy_engine_is_kept_across_syncs_of_the_same_checkpoint(service: Any) -> None:
    svc = service
    eng = svc.engine
    sync = svc.sync(start_state("dead-test", "tail_batching", "file:///ckpt-0"))
    assert not sync.started and svc.engine is eng and not svc.started


def test_weights_pushed_to_a_dead_engine_are_left_to_the_next_sync(service: Any) -> None:
    svc = service
    svc.replicas[1].kill("died before the push")
    assert svc.load_weights(1, "file:///ckpt-1", {"w": [1.0]}) == 0.0
    assert svc.engine is None and svc.checkpoint_uri == "" and svc.policy_version == 0
    sync = svc.sync(start_state("dead-test", "tail_batching", "file:///ckpt-1"))
    assert sync.started and svc.checkpoint_uri == "file:///ckpt-1"


def test_validation_on_a_dying_engine_fails_and_drops_it(service: Any) -> None:
    svc = service
    svc.replicas[1].die_at = 2
    with pytest.raises(EngineError, match="SIGKILL planted"):
        svc.validate(0, "att1")
    assert svc.engine is None


def test_the_weight_probe_samples_the_probe_prompts_and_skips_a_dead_engine(service: Any) -> None:
    """The probe's engine side (services/rollout.py): the task's first training prompts, one
    seeded sample each of exactly ``max_tokens`` tokens with their logprobs; nothing from a dead
    engine (the trainer then skips the check: the next sync loads the checkpoint)."""
    svc = service
    svc.replicas[1].die_at = 0  # healthy until killed below
    got = svc.probe(3, 5)
    assert got.prompt_ids == tuple(p.token_ids for p in svc.data().train_prompts[:3])
    assert [len(r) for r in got.response_ids] == [5, 5, 5]
    assert [len(lp) for lp in got.logprobs] == [5, 5, 5]
    assert got.policy_version == 0 and got.from_json(got.to_json()) == got
    svc.replicas[1].kill("died before the probe")
    assert svc.probe(3, 5).response_ids == () and svc.engine is None
