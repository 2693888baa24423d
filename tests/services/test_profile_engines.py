"""The rollout service profiles the engine it serves: a vLLM engine or the simulated one
(``engine.kind: simulated``, the dry run the interrupt tests use) as the single layout TP x 1,
writing the profile document the planner reads; an engine it cannot measure is refused by name.

The service, the profiler and the store (a directory) are the real ones; the engine is the
simulated one on the micro model (the outer edge)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from rollpacker.core.errors import RollpackerError
from rollpacker.core.latency import ProfileTable
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.simulated import SimulatedEngine
from tests.services.fakes import RoundPeers

if TYPE_CHECKING:
    from rollpacker.services.rollout import RolloutService

CONFIG = """
experiment: profile-test
task: {{name: synthetic_math, num_examples: 64, val_size: 8}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 32}}
engine: {{kind: simulated, max_num_seqs: 16, max_model_len: 200}}
planner: {{profile_batches: [1, 4], profile_contexts: [16, 64], profile_window: 4}}
train: {{sync_probe: {{enabled: false}}}}
store: {{endpoint: "file://{root}"}}
"""


def _service(tmp_path: Path) -> RolloutService:
    import rollpacker.services.rollout as rollout
    from rollpacker.tasks.tiny_model import build_tiny_model

    (tmp_path / "store").mkdir()
    svc = rollout.RolloutService(CONFIG.format(root=tmp_path / "store"), "sync")
    svc.bind(RoundPeers())
    svc.model_dir = build_tiny_model("micro")
    return svc


def test_the_simulated_engine_is_profiled_as_one_layout(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    svc.engine = SimulatedEngine(dataclasses.replace(svc.cfg.engine, model_dir=str(svc.model_dir)))
    summary = svc.profile("profile-test/sync/profile.json")
    assert summary.points > 0
    doc = svc.store().get_json(svc.store().key_of(summary.uri))
    table = ProfileTable.from_dict(doc["table"], summary.uri)
    assert [lp.layout.name for lp in table.layouts] == ["tp1dp1"]


def test_an_engine_profiling_cannot_measure_is_refused_by_name(tmp_path: Path) -> None:
    svc = _service(tmp_path)
    svc.engine = FakeEngine(concurrency=4)
    with pytest.raises(
        RollpackerError, match="profiling measures vLLM engines; this service runs FakeEngine"
    ):
        svc.profile("profile-test/sync/profile.json")
