"""Each objective and advantage estimator equals its formula, computed independently on a small
model in float64 (<= 1e-6 relative, loss and gradient), and the stream trainer's update stays
exact for each, including REINFORCE++'s whole-batch normalization.

The reference runs the Hugging Face model on one unpadded sequence at a time, takes each response
token's logprob from ``log_softmax(logits / T)``, writes the paper's formula out per sequence and
per token, and lets autograd differentiate it; it shares nothing with the trainer's padded,
micro-batched, masked path but the weights.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from rollpacker.core.advantages import ReturnStats, TrainSample, normalized
from rollpacker.core.config import TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.trainers.stream import StreamTrainer
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch, random_chunks

TEMP = 0.8
EPS_LOW, EPS_HIGH = 0.2, 0.28
BUDGET = 40  # the constant normaliser's L (test responses have <= 30 tokens)


def _trainer(model_dir, **kw) -> TorchTrainer:
    cfg = TrainerConfig(
        grad_clip=0.0, tokens_per_micro_batch=64, clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, **kw
    )
    return TorchTrainer(model_dir, cfg, temperature=TEMP, dtype=torch.float64)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _rel(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    return float((a - b).norm() / b.norm())


def _loss_close(a: float, b: float) -> bool:
    """Within 1e-6 relative, or 1e-12 absolute: at ratio 1 with centred advantages the loss is ~0."""
    return abs(a - b) <= 1e-6 * abs(b) + 1e-12


def _with_old(samples: list[TrainSample]) -> list[TrainSample]:
    """pi_old away from the current weights (a later mini-batch's): the engine's logprobs stand in."""
    return [dataclasses.replace(s, old_logprobs=s.behaviour_logprobs) for s in samples]


# -- the independent reference -------------------------------------------------------------------
def _token_logprobs(model, s: TrainSample) -> torch.Tensor:
    """Logprobs of the response tokens, one unpadded sequence."""
    ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
    logits = model(input_ids=ids).logits[0]
    out = []
    for t, tok in enumerate(s.response_ids):
        out.append(torch.log_softmax(logits[len(s.prompt_ids) - 1 + t] / TEMP, -1)[tok])
    return torch.stack(out)


def _clip(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(1 - EPS_LOW, 1 + EPS_HIGH)


def _seq_loss(
    name: str, p: torch.Tensor, old: torch.Tensor, b: torch.Tensor, adv: torch.Tensor
) -> torch.Tensor:
    """One sequence's per-token loss values by the objective's formula, the ratio against ``old``
    (pi_old); the engine's ``b`` enters only decoupled PPO's behaviour weight."""
    if name == "ppo":
        r = torch.exp(p - old)
        return -torch.minimum(r * adv, _clip(r) * adv)
    if name == "decoupled_ppo":
        q = old
        return -torch.minimum(torch.exp(p - b) * adv, torch.exp(q - b) * _clip(torch.exp(p - q)) * adv)
    if name == "gspo":  # one sequence ratio, the geometric mean of the token ratios
        s = torch.exp((p - old).mean())
        return (-torch.minimum(s * adv, _clip(s) * adv)).expand(len(p))
    raise AssertionError(name)


def _reference(model, samples, name: str, norm: str, token_adv=None, kl_coef=0.0, ref_model=None):
    """(loss, gradient) of ``(1 / D) sum_i sum_t w_i l_{i,t}`` from the formulas."""
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for i, s in enumerate(samples):
        p = _token_logprobs(model, s)
        b = torch.tensor(s.behaviour_logprobs, dtype=torch.float64)
        # one update: pi_old is the current weights, detached; else the given logprobs
        old = torch.tensor(s.old_logprobs, dtype=torch.float64) if s.old_logprobs else p.detach()
        if token_adv is not None:
            adv = torch.tensor(token_adv[i], dtype=torch.float64)
            if name == "gspo":  # GSPO-token: the sequence ratio's value, each token's own gradient
                sv = torch.exp((p - old).mean()).detach() * torch.exp(p - p.detach())
                loss = -torch.minimum(sv * adv, _clip(sv) * adv)
            else:
                loss = _seq_loss(name, p, old, b, adv)
        else:
            loss = _seq_loss(name, p, old, b, torch.tensor(s.advantage, dtype=torch.float64))
        if kl_coef:
            with torch.no_grad():
                q = _token_logprobs(ref_model, s)
            loss = loss + kl_coef * (torch.exp(q - p) - (q - p) - 1)
        w = 1.0 / s.num_tokens if norm == "seq_mean" else 1.0
        total = total + w * loss.sum()
    d = {  # token_mean: the batch's tokens; seq_mean: its responses; constant (Dr. GRPO): L x responses
        "token_mean": sum(s.num_tokens for s in samples),
        "seq_mean": len(samples),
        "constant": BUDGET * len(samples),
    }[norm]
    (total / d).backward()
    return float((total / d).detach()), _grads(model)


def _reinforce_pp_reference(samples, ref_model, beta: float) -> list[list[float]]:
    """REINFORCE++ token advantages from the formula: k1 KL in the reward, global whitening."""
    returns = []
    for s in samples:
        with torch.no_grad():
            q = _token_logprobs(ref_model, s).tolist()
        kl = [b - qq for b, qq in zip(s.behaviour_logprobs, q, strict=True)]
        returns.append([s.reward - beta * sum(kl[t:]) for t in range(len(kl))])
    flat = torch.tensor([g for r in returns for g in r], dtype=torch.float64)
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [[float((g - mean) / (std + 1e-6)) for g in r] for r in returns]


def _trainer_loss_and_grad(tr: TorchTrainer, samples) -> tuple[float, torch.Tensor]:
    tr.accumulate(samples)
    d, _ = tr.reduce_grads()
    return tr._acc_loss / d, _grads(tr.model)


# -- objectives ------------------------------------------------------------------------------------
@pytest.mark.parametrize("old", ["same_forward", "given"])
@pytest.mark.parametrize("norm", ["token_mean", "seq_mean", "constant"])
@pytest.mark.parametrize("name", ["ppo", "decoupled_ppo", "gspo"])
def test_objective_loss_and_gradient_equal_the_formula(small_model_dir, name, norm, old):
    samples = [s for g in make_batch(num_groups=5, group_size=3, seed=11) for s in g]
    if old == "given":
        samples = _with_old(samples)
    tr = _trainer(small_model_dir, objective=name, loss_norm=norm, loss_budget_tokens=BUDGET)
    loss, grad = _trainer_loss_and_grad(tr, samples)
    ref_loss, ref_grad = _reference(_trainer(small_model_dir).model, samples, name, norm)
    assert float(ref_grad.norm()) > 0
    assert _loss_close(loss, ref_loss) and _rel(grad, ref_grad) <= 1e-6, (
        _rel(loss, ref_loss),
        _rel(grad, ref_grad),
    )


def test_objective_with_kl_loss_equals_the_formula(small_model_dir):
    samples = [s for g in make_batch(num_groups=4, group_size=3, seed=12) for s in g]
    tr = _trainer(small_model_dir, objective="ppo", kl_coef=0.3)
    torch.manual_seed(3)  # move the policy off the reference (the starting weights): KL > 0
    with torch.no_grad():
        for prm in tr.model.parameters():
            prm.add_(0.05 * torch.randn_like(prm))
    policy = copy.deepcopy(tr.model)
    loss, grad = _trainer_loss_and_grad(tr, samples)
    ref_loss, ref_grad = _reference(policy, samples, "ppo", "token_mean", kl_coef=0.3, ref_model=tr.ref_model)
    _, no_kl = _reference(copy.deepcopy(policy), samples, "ppo", "token_mean")
    assert _loss_close(loss, ref_loss) and _rel(grad, ref_grad) <= 1e-6
    assert _rel(no_kl, ref_grad) > 1e-3  # the KL term is really in it


def test_gspo_differs_from_token_level_ppo(small_model_dir):
    """The reference test can fail: GSPO's sequence ratio is not PPO's token ratio (away from
    pi_old; at ratio 1, one update's start, the two gradients are the same)."""
    samples = _with_old([s for g in make_batch(num_groups=5, group_size=3, seed=11) for s in g])
    _, grad = _trainer_loss_and_grad(
        _trainer(small_model_dir, objective="gspo", loss_norm="seq_mean"), samples
    )
    _, ppo_grad = _reference(_trainer(small_model_dir).model, samples, "ppo", "seq_mean")
    assert _rel(grad, ppo_grad) > 1e-2


# -- REINFORCE++ -------------------------------------------------------------------------------------
@pytest.mark.parametrize("objective", ["ppo", "gspo"])
def test_reinforce_pp_loss_and_gradient_equal_the_formula(small_model_dir, objective):
    samples = [s for g in make_batch(num_groups=5, group_size=3, seed=13) for s in g]
    tr = _trainer(small_model_dir, objective=objective, advantage="reinforce_pp", reward_kl_coef=0.05)
    returns = tr.returns(samples)
    got = tr.batch_advantages(samples, returns, ReturnStats.of(returns))
    adv = _reinforce_pp_reference(samples, tr.ref_model, 0.05)
    flat = [a for s in got for a in s.token_advantages]
    assert flat == pytest.approx([a for r in adv for a in r], rel=1e-9, abs=1e-12)
    assert abs(sum(flat) / len(flat)) < 1e-9  # whitened over the whole batch's tokens
    loss, grad = _trainer_loss_and_grad(tr, got)
    ref_loss, ref_grad = _reference(
        _trainer(small_model_dir).model, samples, objective, "token_mean", token_adv=adv
    )
    assert _loss_close(loss, ref_loss) and _rel(grad, ref_grad) <= 1e-6


def test_reinforce_pp_kl_is_in_the_reward(small_model_dir):
    """A larger beta lowers the returns of tokens whose behaviour logprob exceeds the reference's."""
    samples = [s for g in make_batch(num_groups=2, group_size=2, seed=14) for s in g]
    tr = _trainer(small_model_dir, advantage="reinforce_pp", reward_kl_coef=0.5)
    for s, g in zip(samples, tr.returns(samples), strict=True):
        q = tr.logprobs([s], model=tr.ref_model)[0]
        want = [
            s.reward - 0.5 * sum(b - qq for b, qq in zip(s.behaviour_logprobs[t:], q[t:], strict=True))
            for t in range(s.num_tokens)
        ]
        assert list(g) == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_reinforce_pp_refuses_ungathered_samples(small_model_dir):
    tr = _trainer(small_model_dir, advantage="reinforce_pp")
    with pytest.raises(TrainerError, match="needs the whole batch"):
        tr.accumulate(make_batch(1, 2, seed=1)[0])


def _stream_grads(tr: TorchTrainer, groups, seed: int) -> torch.Tensor:
    """Submit the groups in a random order and chunking; the gradient the one update would take."""
    captured = []

    def finish_step():
        assert tr.pending_samples == sum(len(g) for g in groups)  # each sample once
        tr.reduce_grads()
        captured.append(_grads(tr.model).clone())
        tr._reset_accum()
        return None

    tr.finish_step = finish_step  # type: ignore[method-assign]
    stream = StreamTrainer(tr, stream=True)
    for chunk in random_chunks(groups, seed):
        stream.submit(chunk)
    stream.finish()
    stream.close()
    return captured[0]


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_streamed_update_is_exact_for_each_estimator(small_model_dir, advantage):
    groups = make_batch(num_groups=6, group_size=3, seed=15)
    kw = {"advantage": advantage, "reward_kl_coef": 0.05 if advantage == "reinforce_pp" else 0.0}
    mono = _trainer(small_model_dir, **kw)
    samples = [s for g in groups for s in g]
    if advantage == "reinforce_pp":
        r = mono.returns(samples)
        samples = mono.batch_advantages(samples, r, ReturnStats.of(r))
    mono.accumulate(samples)
    mono.reduce_grads()
    ref = _grads(mono.model)
    for seed in range(2):
        got = _stream_grads(_trainer(small_model_dir, **kw), groups, seed)
        assert _rel(got, ref) <= 1e-6, (advantage, seed, _rel(got, ref))


def test_per_chunk_normalization_would_not_be_exact(small_model_dir):
    """Whitening each chunk with its own statistics (what a naive stream would do) is biased: the
    exactness test above can fail."""
    groups = make_batch(num_groups=6, group_size=3, seed=15)
    tr = _trainer(small_model_dir, advantage="reinforce_pp", reward_kl_coef=0.05)
    samples = [s for g in groups for s in g]
    r = tr.returns(samples)
    exact = tr.batch_advantages(samples, r, ReturnStats.of(r))
    naive = []
    for lo, hi in ((0, 3), (3, 9), (9, 18)):
        naive += [
            dataclasses.replace(s, token_advantages=normalized(g, ReturnStats.of(r[lo:hi])))
            for s, g in zip(samples[lo:hi], r[lo:hi], strict=True)
        ]
    _, g_exact = _trainer_loss_and_grad(_trainer(small_model_dir, advantage="reinforce_pp"), exact)
    _, g_naive = _trainer_loss_and_grad(_trainer(small_model_dir, advantage="reinforce_pp"), naive)
    assert _rel(g_naive, g_exact) > 1e-3
    assert not math.isclose(exact[0].token_advantages[0], naive[0].token_advantages[0], rel_tol=1e-6)


def test_reinforce_pp_monolithic_train_batch_equals_the_streamed_update(small_model_dir):
    """``train_batch`` (train.stream: false) computes the batch advantages itself: after the one
    optimizer step its weights equal the stream trainer's."""
    groups = make_batch(num_groups=4, group_size=3, seed=16)
    kw = {"advantage": "reinforce_pp", "reward_kl_coef": 0.05}
    mono = _trainer(small_model_dir, **kw)
    mono.train_batch([s for g in groups for s in g])
    streamed = _trainer(small_model_dir, **kw)
    stream = StreamTrainer(streamed, stream=True)
    for g in reversed(groups):
        stream.submit(g)
    stream.finish()
    stream.close()
    a = torch.cat([p.detach().reshape(-1) for p in mono.model.parameters()])
    b = torch.cat([p.detach().reshape(-1) for p in streamed.model.parameters()])
    start = torch.cat([p.detach().reshape(-1) for p in _trainer(small_model_dir).model.parameters()])
    assert float((a - start).norm()) > 0
    assert _rel(b - start, a - start) <= 1e-6
