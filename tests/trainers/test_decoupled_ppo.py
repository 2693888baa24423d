"""The decoupled PPO objective (partial rollout, AReaL): its value, its gradient, and its proximal policy."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rollpacker.core.config import TrainerConfig
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch


def _trainer(model_dir, objective: str, **kw) -> TorchTrainer:
    cfg = TrainerConfig(objective=objective, **{"grad_clip": 0.0, "tokens_per_micro_batch": 10_000, **kw})
    return TorchTrainer(model_dir, cfg, temperature=0.8, dtype=torch.float64)


def _grads(t: TorchTrainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in t.model.parameters() if p.grad is not None])


def _flat(batch):
    return [s for g in batch for s in g]


def test_loss_is_the_recipes_formula(small_model_dir) -> None:
    samples = _flat(make_batch(num_groups=4, group_size=3, seed=2))
    tr = _trainer(small_model_dir, "decoupled_ppo", clip_eps_low=0.2, clip_eps_high=0.28)
    prox = tr.logprobs(samples)  # the weights the update starts from
    want = 0.0
    for s, q in zip(samples, prox, strict=True):
        for p_t, b_t in zip(q, s.behaviour_logprobs, strict=True):
            a = s.advantage
            r = math.exp(p_t - p_t)  # pi_theta / pi_prox = 1 before the update
            obj = min(math.exp(p_t - b_t) * a, math.exp(p_t - b_t) * min(max(r, 0.8), 1.28) * a)
            want += -obj
    got = tr.accumulate(samples).loss_sum
    assert got == pytest.approx(want, rel=1e-9)


def test_on_policy_data_gives_the_ppo_gradient(small_model_dir) -> None:
    """With behaviour == proximal logprobs the two objectives are the same function."""
    samples = _flat(make_batch(num_groups=4, group_size=3, seed=3))
    probe = _trainer(small_model_dir, "ppo")
    on_policy = [
        dataclasses.replace(s, behaviour_logprobs=tuple(q))
        for s, q in zip(samples, probe.logprobs(samples), strict=True)
    ]
    a, b = _trainer(small_model_dir, "ppo"), _trainer(small_model_dir, "decoupled_ppo")
    a.accumulate(on_policy)
    b.accumulate(on_policy)
    ga, gb = _grads(a), _grads(b)
    assert float(ga.norm()) > 0
    assert float((ga - gb).norm() / ga.norm()) < 1e-9


def test_stale_tokens_change_the_gradient_and_the_weight_is_logged(small_model_dir) -> None:
    samples = _flat(make_batch(num_groups=4, group_size=3, seed=4))
    a, b = _trainer(small_model_dir, "ppo"), _trainer(small_model_dir, "decoupled_ppo")
    a.accumulate(samples)
    b.accumulate(samples)
    ga, gb = _grads(a), _grads(b)
    assert float((ga - gb).norm() / ga.norm()) > 1e-3
    st_b = b.finish_step()
    assert st_b.behav_weight > 1.0  # behaviour logprobs of the fixture are far below the model's
    assert a.finish_step().behav_weight == 1.0


def test_streamed_decoupled_gradient_equals_monolithic(small_model_dir) -> None:
    batch = make_batch(num_groups=6, group_size=4, seed=5)
    mono = _trainer(small_model_dir, "decoupled_ppo")
    mono.accumulate(_flat(batch))
    mono.reduce_grads()
    streamed = _trainer(small_model_dir, "decoupled_ppo", tokens_per_micro_batch=40)
    for g in reversed(batch):
        streamed.accumulate(g)
    streamed.reduce_grads()
    ref = _grads(mono)
    assert float((_grads(streamed) - ref).norm() / ref.norm()) < 1e-9


def test_mini_batches_keep_the_proximal_policy_of_the_first_step(small_model_dir) -> None:
    samples = _flat(make_batch(num_groups=4, group_size=4, seed=6))
    tr = _trainer(small_model_dir, "decoupled_ppo", mini_batches=2, stream=False, lr=1e-2)
    q0 = tr.logprobs(samples)
    want = sum(
        math.exp(q - b)
        for s, qs in zip(samples, q0, strict=True)
        for q, b in zip(qs, s.behaviour_logprobs, strict=True)
    )
    tokens = sum(s.num_tokens for s in samples)
    st = tr.train_batch(samples)
    assert st.optimizer_steps == 2
    # token-weighted over both mini-batches, with q from the weights before the first step
    assert st.behav_weight == pytest.approx(want / tokens, rel=1e-9)
