"""Weights from the megatron gang (TP=2: gathered over TP, converted to HF names, in buckets) into
a real vLLM engine: the engine's logprobs equal the gang's within the torch backend's tolerance
before and after an update, and a stale engine is caught (tests/trainers/test_weight_sync.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.config import EngineConfig, MegatronConfig, TrainerConfig
from tests.trainers.test_weight_sync import LOGPROB_TOL, _max_diff, _sample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rollpacker.tasks.tiny_model import build_tiny_model

    return Path(build_tiny_model("tiny"))  # 4 heads, 2 KV heads: TP=2 splits whole KV groups


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[Any]:
    from rollpacker.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(
        EngineConfig(model_dir=str(model_dir), max_num_seqs=16, max_model_len=256, kv_cache_gib=1)
    )
    yield eng
    eng.close()


def test_engine_logprobs_match_the_tp2_gang_before_and_after_a_step(engine: Any, model_dir: Path) -> None:
    import ray

    from rollpacker.trainers.megatron.gang import MegatronTrainer

    started = not ray.is_initialized()
    m = MegatronConfig(tp=2, bucket_mb=0.25)  # several buckets for a 3M-parameter model
    cfg = TrainerConfig(lr=5e-3, grad_clip=0.0, backend="megatron", megatron=m)
    trainer = MegatronTrainer(model_dir, cfg, temperature=1.0)
    try:
        assert len(list(trainer.weight_buckets())) > 2
        engine.load_weights(trainer.weights())  # start both from the same weights
        before = _sample(engine, "mg/before", 1.0)
        assert _max_diff(trainer, before) <= LOGPROB_TOL

        trainer.accumulate(before)
        trainer.finish_step()
        assert _max_diff(trainer, before) > 20 * LOGPROB_TOL, "the step did not move the logprobs"

        engine.load_weights(trainer.weights())
        after = _sample(engine, "mg/after", 1.0)
        assert _max_diff(trainer, after) <= LOGPROB_TOL
    finally:
        trainer.close()
        if started:
            ray.shutdown()
