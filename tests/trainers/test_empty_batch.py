"""A batch that DAPO's overlong filtering emptied (every response truncated) is an exact zero
update: no optimizer step, weights and optimizer state bit-for-bit unchanged, the policy version
still advanced; the next real step equals the one a trainer that never saw the empty batch takes."""

from __future__ import annotations

import pytest
import torch

from rollpacker.core.advantages import RewardShaping, train_samples
from rollpacker.core.config import TrainerConfig
from rollpacker.core.types import Completion, FinishReason, Group, Prompt
from rollpacker.trainers.stream import StreamTrainer
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch


def _flat(tr: TorchTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()])


def _moments(tr: TorchTrainer) -> list[torch.Tensor]:
    return [v.clone() for st in tr.opt.state.values() for v in st.values() if torch.is_tensor(v)]


def _truncated_group() -> Group:
    """A group whose every response hit max_tokens (finish reason ``length``), rewards varied."""
    prompt = Prompt("p0", (3, 4, 5))
    responses = tuple(
        Completion(
            request_id=f"p0/k{j}",
            prompt_id="p0",
            sample_index=j,
            token_ids=(7, 8, 9, 10),
            logprobs=(-1.0, -1.5, -2.0, -2.5),
            finish_reason=FinishReason.LENGTH,
        )
        for j in range(2)
    )
    return Group(prompt, responses)


@pytest.mark.parametrize("stream", [True, False])
def test_a_batch_overlong_filtering_emptied_is_an_exact_zero_update(small_model_dir, stream) -> None:
    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1, tokens_per_micro_batch=256, stream=stream)
    first, second = ([s for g in make_batch(3, 2, seed=s) for s in g] for s in (21, 22))
    shaping = RewardShaping(max_tokens=4, overlong_filter=True)
    empty = train_samples(_truncated_group(), [0.0, 1.0], shaping=shaping)
    assert empty == ()  # the filter removed every sample of the batch

    tr = TorchTrainer(small_model_dir, cfg)
    # the worker keeps this process's thread count (torch's is process-wide: an in-process vLLM
    # engine started later in the same test run checks it)
    st = StreamTrainer(tr, stream=stream, threads=torch.get_num_threads())
    try:
        st.submit(first)
        st.finish()  # a real step first: Adam's moments are non-zero, so a stray step would move
        weights, moments = _flat(tr), _moments(tr)
        st.submit(empty)
        report = st.finish()
        assert (report.stats.samples, report.stats.optimizer_steps, report.stats.tokens) == (0, 0, 0)
        assert report.stats.policy_version == tr.policy_version == 2  # one version per RL step
        assert torch.equal(_flat(tr), weights), "the zero update moved the weights"
        after = _moments(tr)
        assert len(after) == len(moments) > 0
        assert all(torch.equal(a, b) for a, b in zip(after, moments, strict=True)), "moments moved"
        st.submit(second)
        st.finish()
    finally:
        st.close()

    # the same two real steps without the empty batch: identical weights (and the test can fail:
    # an optimizer step on zero gradients still moves AdamW's weights by momentum and decay)
    ref = TorchTrainer(small_model_dir, cfg)
    ref.train_batch(first)
    ref.train_batch(second)
    assert torch.equal(_flat(tr), _flat(ref))
    stray = TorchTrainer(small_model_dir, cfg)
    stray.train_batch(first)
    moved_from = _flat(stray)
    for p in stray.model.parameters():
        p.grad = torch.zeros_like(p)
    stray.opt.step()
    assert not torch.equal(_flat(stray), moved_from)
