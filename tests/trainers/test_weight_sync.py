"""Weight sync: after an optimizer step the engine serves the trainer's weights, in place.

The engine's behaviour logprobs must match the trainer's recomputed logprobs for the same weights
within ``LOGPROB_TOL`` (max absolute difference per token). A stale engine (weights not pushed) or a
mis-mapped push fails the check by orders of magnitude.
"""

from __future__ import annotations

import pytest

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import EngineConfig, TrainerConfig
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec

LOGPROB_TOL = 2e-3  # vLLM CPU kernels vs torch eager, float32

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    from rollpacker.tasks.tiny_model import build_tiny_model

    return build_tiny_model("micro")


@pytest.fixture(scope="module")
def engine(model_dir):
    from rollpacker.engines.vllm_engine import VLLMEngine

    eng = VLLMEngine(
        EngineConfig(model_dir=str(model_dir), max_num_seqs=16, max_model_len=256, kv_cache_gib=1)
    )
    yield eng
    eng.close()


def _sample(engine, tag: str, temperature: float) -> list[TrainSample]:
    from rollpacker.rollout.driver import generate

    prompts = [
        Prompt(prompt_id=f"p{i}", token_ids=tuple(3 + b for b in f"start {i}, add 3\n".encode()))
        for i in range(6)
    ]
    reqs = [
        GenerationRequest(
            request_id=f"{tag}/{p.prompt_id}",
            prompt=p,
            sample_index=0,
            sampling=SamplingSpec(max_tokens=32, temperature=temperature, ignore_eos=True),
        )
        for p in prompts
    ]
    comps = generate(engine, reqs)
    return [
        TrainSample(
            sample_id=c.request_id,
            prompt_id=c.prompt_id,
            prompt_ids=p.token_ids,
            response_ids=c.token_ids,
            behaviour_logprobs=c.logprobs,
            advantage=1.0 if i % 2 else -1.0,
            reward=float(i % 2),
        )
        for i, (p, c) in enumerate(zip(prompts, comps, strict=True))
    ]


def _max_diff(trainer, samples) -> float:
    got = trainer.logprobs(samples)
    return max(
        abs(a - b)
        for s, row in zip(samples, got, strict=True)
        for a, b in zip(row, s.behaviour_logprobs, strict=True)
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_trainer_before_and_after_a_step(engine, model_dir, temperature):
    from rollpacker.trainers.torch_trainer import TorchTrainer

    trainer = TorchTrainer(model_dir, TrainerConfig(lr=5e-3, grad_clip=0.0), temperature=temperature)
    engine.load_weights(trainer.weights())  # start both from the same weights
    before = _sample(engine, f"t{temperature}/before", temperature)
    assert _max_diff(trainer, before) <= LOGPROB_TOL

    trainer.accumulate(before)
    trainer.finish_step()
    stale = _max_diff(trainer, before)  # the engine has not seen the update yet
    assert stale > 20 * LOGPROB_TOL, "the optimizer step did not move the logprobs; the test cannot tell"

    engine.load_weights(trainer.weights())
    after = _sample(engine, f"t{temperature}/after", temperature)
    assert _max_diff(trainer, after) <= LOGPROB_TOL
