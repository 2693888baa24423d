"""The stream trainer's update equals the monolithic-batch update (RollPacker section 4.4)."""

from __future__ import annotations

import pytest
import torch

from rollpacker.core.config import TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch, random_chunks


def _grads(trainer: TorchTrainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in trainer.model.parameters() if p.grad is not None])


LOSS_BUDGET = 48  # the constant normaliser's generation budget (test responses have <= 30 tokens)


def _trainer(model_dir, dtype, norm, kl=0.0, budget=64) -> TorchTrainer:
    cfg = TrainerConfig(
        loss_norm=norm,
        kl_coef=kl,
        grad_clip=0.0,
        tokens_per_micro_batch=budget,
        loss_budget_tokens=LOSS_BUDGET,
    )
    return TorchTrainer(model_dir, cfg, temperature=0.8, dtype=dtype)


def _monolithic(model_dir, dtype, norm, batch, kl=0.0) -> torch.Tensor:
    tr = _trainer(model_dir, dtype, norm, kl, budget=10_000)  # one micro-batch: the whole batch
    tr.accumulate([s for g in batch for s in g])
    tr.reduce_grads()
    return _grads(tr)


def _streamed(model_dir, dtype, norm, batch, seed, kl=0.0) -> torch.Tensor:
    tr = _trainer(model_dir, dtype, norm, kl)
    for chunk in random_chunks(batch, seed):
        tr.accumulate(chunk)
    tr.reduce_grads()
    return _grads(tr)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("norm", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-6), (torch.float32, 1e-5)])
def test_streamed_gradient_equals_monolithic(small_model_dir, norm, dtype, tol):
    batch = make_batch(num_groups=8, group_size=4, seed=1)
    ref = _monolithic(small_model_dir, dtype, norm, batch)
    assert float(ref.norm()) > 0
    for seed in range(3):  # three random arrival orders and chunkings
        got = _streamed(small_model_dir, dtype, norm, batch, seed)
        assert _rel(got, ref) <= tol, (norm, dtype, seed, _rel(got, ref))


def test_streamed_gradient_with_kl_term_equals_monolithic(small_model_dir):
    batch = make_batch(num_groups=6, group_size=3, seed=2)
    ref = _monolithic(small_model_dir, torch.float64, "token_mean", batch, kl=0.1)
    got = _streamed(small_model_dir, torch.float64, "token_mean", batch, seed=5, kl=0.1)
    assert _rel(got, ref) <= 1e-6


def test_constant_norm_is_token_sum_over_budget_times_responses(small_model_dir):
    """Dr. GRPO's normaliser scales the token-mean gradient by ``tokens / (L * N)``: the same
    direction, a scale fixed by the batch's shape, not by its response lengths."""
    batch = make_batch(num_groups=6, group_size=4, seed=4)
    samples = [s for g in batch for s in g]
    tokens = sum(s.num_tokens for s in samples)
    assert max(s.num_tokens for s in samples) <= LOSS_BUDGET
    assert tokens / (LOSS_BUDGET * len(samples)) < 0.9  # a scale the check can tell from 1
    tok = _monolithic(small_model_dir, torch.float64, "token_mean", batch)
    const = _monolithic(small_model_dir, torch.float64, "constant", batch)
    assert _rel(const, tok * (tokens / (LOSS_BUDGET * len(samples)))) <= 1e-9


def test_constant_norm_without_a_budget_is_refused(small_model_dir):
    with pytest.raises(TrainerError, match="loss_budget_tokens"):
        TorchTrainer(small_model_dir, TrainerConfig(loss_norm="constant"), temperature=0.8)


@pytest.mark.parametrize("norm", ["token_mean", "seq_mean", "constant"])
def test_naive_per_chunk_mean_does_not_match(small_model_dir, norm):
    """Averaging per-chunk normalized gradients (what plain all-reduce averaging does) is biased."""
    batch = make_batch(num_groups=8, group_size=4, seed=1)
    ref = _monolithic(small_model_dir, torch.float64, norm, batch)
    chunks = [batch[0:1], batch[1:3], batch[3:8]]  # unequal chunk sizes
    naive = None
    for chunk in chunks:
        tr = _trainer(small_model_dir, torch.float64, norm)
        tr.accumulate([s for g in chunk for s in g])
        tr.reduce_grads()  # each chunk normalized by its own count
        g = _grads(tr) / len(chunks)
        naive = g if naive is None else naive + g
    assert _rel(naive, ref) > 1e-3


def test_accumulate_changes_no_weight_and_no_optimizer_state(small_model_dir):
    tr = _trainer(small_model_dir, torch.float32, "token_mean")
    before = {k: v.clone() for k, v in tr.model.state_dict().items()}
    tr.accumulate([s for g in make_batch(4, 2, seed=3) for s in g])
    assert all(torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
    assert not tr.opt.state
    assert tr.policy_version == 0
    tr.finish_step()
    assert tr.policy_version == 1
    assert any(not torch.equal(before[k], v) for k, v in tr.model.state_dict().items())
