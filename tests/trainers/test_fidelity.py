"""Rollout-trainer fidelity (core/fidelity.py, trainers/correction.py): the PPO ratio is against the
trainer's own pi_old, the engine's logprobs enter only through the rollout correction, the
correction is exact under the stream trainer and equals its formula, and the mismatch metrics equal
theirs.

The references run the model on one unpadded sequence at a time (tests/trainers/test_algorithms.py)
and write each formula out in plain Python per token.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import TrainerConfig, from_mapping
from rollpacker.core.errors import ConfigError
from rollpacker.core.fidelity import (
    BUCKET_EDGES,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    RolloutCorrectionConfig,
    bucket_name,
    bucket_of,
    fidelity_metrics,
    merge_sums,
)
from rollpacker.trainers.correction import LEVELS, MODES, get_level
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch, random_chunks
from .test_algorithms import _token_logprobs

TEMP = 0.8  # _token_logprobs' temperature


def _trainer(model_dir, correction=None, **kw) -> TorchTrainer:
    cfg = TrainerConfig(
        grad_clip=0.0,
        tokens_per_micro_batch=kw.pop("budget", 64),
        correction=correction or RolloutCorrectionConfig(),
        **kw,
    )
    return TorchTrainer(model_dir, cfg, temperature=TEMP, dtype=torch.float64)


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _perturbed(model_dir, batch, scale: float, seed: int) -> list[list[TrainSample]]:
    """The batch with engine logprobs = the trainer's own (identical weights) + noise: pure
    engine/trainer disagreement, ``|d| <= scale`` per token."""
    tr = _trainer(model_dir)
    rng = random.Random(seed)
    out = []
    for g in batch:
        old = tr.logprobs(g)
        out.append(
            [
                dataclasses.replace(s, behaviour_logprobs=tuple(q + rng.uniform(-scale, scale) for q in qs))
                for s, qs in zip(g, old, strict=True)
            ]
        )
    return out


def _ref_weights(cfg: RolloutCorrectionConfig, old: list[float], b: list[float]) -> list[float]:
    """The correction weight of each token of one response, written out (core/fidelity.py)."""
    d = [o - x for o, x in zip(old, b, strict=True)]
    n = len(d)
    if cfg.level == "none":
        return [1.0] * n
    lw = {"token": d, "sequence": [sum(d)] * n, "geometric": [sum(d) / n] * n}[cfg.level]
    w = [math.exp(x) for x in lw]
    if cfg.mode == "truncate":
        w = [min(x, cfg.upper) for x in w]
    else:
        w = [x if cfg.lower <= x <= cfg.upper else 0.0 for x in w]
    g = math.exp(sum(d) / n)
    if (cfg.reject_lower and g < cfg.reject_lower) or (cfg.reject_upper and g > cfg.reject_upper):
        w = [0.0] * n
    return w


def _reference_grad(model_dir, samples, cfg: RolloutCorrectionConfig) -> torch.Tensor:
    """One update on identical weights: the unclipped policy gradient times the correction,
    ``-(1 / D) sum_i sum_t w_{i,t} A_i grad p_{i,t}`` (token-mean)."""
    model = _trainer(model_dir).model
    model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    for s in samples:
        p = _token_logprobs(model, s)
        w = torch.tensor(_ref_weights(cfg, p.detach().tolist(), list(s.behaviour_logprobs)))
        total = total - (w.to(p.dtype) * s.advantage * p).sum()
    (total / sum(s.num_tokens for s in samples)).backward()
    return _grads(model)


CORRECTIONS = {
    "none": RolloutCorrectionConfig(),
    "token-tis": RolloutCorrectionConfig(level="token", mode="truncate", upper=1.2),
    "token-mis": RolloutCorrectionConfig(level="token", mode="mask", lower=0.8, upper=1.2),
    "sequence-tis": RolloutCorrectionConfig(level="sequence", mode="truncate", upper=2.0),
    "sequence-mis": RolloutCorrectionConfig(level="sequence", mode="mask", lower=0.2, upper=5.0),
    "geometric-mis": RolloutCorrectionConfig(level="geometric", mode="mask", lower=0.9, upper=1.1),
    "token-tis-reject": RolloutCorrectionConfig(
        level="token", mode="truncate", upper=1.2, reject_lower=0.95, reject_upper=1.05
    ),
}


@pytest.mark.parametrize("name", ["none", "token-tis", "token-mis"])
def test_clip_never_fires_on_pure_engine_trainer_disagreement(small_model_dir, name):
    """Identical weights, perturbed engine logprobs, one update: the gradient is the unclipped
    policy gradient times the chosen correction, and no token is clipped (today's ratio
    ``exp(p - b)`` clips the tokens the engine disagrees on)."""
    cfg = CORRECTIONS[name]
    samples = [s for g in _perturbed(small_model_dir, make_batch(5, 3, seed=21), 0.8, seed=1) for s in g]
    tr = _trainer(small_model_dir, cfg, objective="ppo")
    tr.accumulate(samples)
    tr.reduce_grads()
    ref = _reference_grad(small_model_dir, samples, cfg)
    assert float(ref.norm()) > 0
    assert _rel(_grads(tr.model), ref) <= 1e-6
    st = tr.finish_step()
    assert st.clip_frac == 0.0 and st.ratio_mean == pytest.approx(1.0, abs=1e-12)
    assert st.fidelity["mm_out"] > 0  # the disagreement was there: exp(0.8) > 2 for some tokens


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
def test_correction_streamed_equals_monolithic_and_the_formula(small_model_dir, name):
    cfg = CORRECTIONS[name]
    batch = _perturbed(small_model_dir, make_batch(6, 3, seed=22), 0.4, seed=2)
    samples = [s for g in batch for s in g]
    mono = _trainer(small_model_dir, cfg, budget=10_000)
    mono.accumulate(samples)
    mono.reduce_grads()
    g_mono = _grads(mono.model)
    assert _rel(g_mono, _reference_grad(small_model_dir, samples, cfg)) <= 1e-6
    m_st = mono.finish_step()
    for seed in range(2):
        streamed = _trainer(small_model_dir, cfg)
        for chunk in random_chunks(batch, seed):
            streamed.accumulate(chunk)
        streamed.reduce_grads()
        assert _rel(_grads(streamed.model), g_mono) <= 1e-6, seed
        st = streamed.finish_step()
        for k in ("cor_truncated", "cor_masked", "cor_rejected", "mm_tokens", "mm_abs_max"):
            assert st.fidelity[k] == pytest.approx(m_st.fidelity[k], abs=1e-9), k


def test_each_correction_changes_something(small_model_dir):
    """The examples exercise each mode: weights truncated, tokens masked, responses rejected."""
    batch = _perturbed(small_model_dir, make_batch(6, 3, seed=22), 0.4, seed=2)
    seen = {}
    for name, cfg in CORRECTIONS.items():
        tr = _trainer(small_model_dir, cfg)
        tr.accumulate([s for g in batch for s in g])
        seen[name] = tr.finish_step().fidelity
    assert seen["token-tis"]["cor_truncated"] > 0 and seen["token-tis"]["cor_masked"] == 0
    assert seen["token-mis"]["cor_masked"] > 0 and seen["token-mis"]["cor_truncated"] == 0
    assert seen["geometric-mis"]["cor_masked"] > 0
    assert seen["token-tis-reject"]["cor_rejected"] > 0
    assert seen["none"]["cor_masked"] == seen["none"]["cor_truncated"] == 0


def test_mismatch_metrics_equal_their_formula_and_merge_over_chunks(small_model_dir):
    batch = _perturbed(small_model_dir, make_batch(6, 3, seed=23), 0.9, seed=3)
    samples = [s for g in batch for s in g]
    tr = _trainer(small_model_dir)
    old = tr.logprobs(samples)
    chunk_sums = []
    for chunk in random_chunks(batch, 4):
        tr.accumulate(chunk)
        chunk_sums.append(dict(tr._acc_fid))
        tr._acc_fid = {}
    merged: dict[str, float] = {}
    for c in chunk_sums:
        merged = merge_sums(merged, c)
    got = fidelity_metrics(merged)
    d = [
        [o - b for o, b in zip(q, s.behaviour_logprobs, strict=True)]
        for q, s in zip(old, samples, strict=True)
    ]
    flat = [x for row in d for x in row]
    n = len(flat)
    geo = [math.exp(sum(row) / len(row)) for row in d]
    gm = sum(geo) / len(geo)
    want = {
        "mismatch/abs_logp_mean": sum(abs(x) for x in flat) / n,
        "mismatch/abs_logp_max": max(abs(x) for x in flat),
        "mismatch/kl_k3": sum(math.exp(x) - 1 - x for x in flat) / n,
        "mismatch/ratio_out_frac": sum(not 0.5 <= math.exp(x) <= 2.0 for x in flat) / n,
        "mismatch/seq_ratio_std": math.sqrt(sum((g - gm) ** 2 for g in geo) / len(geo)),
    }
    for kind in ("pos", "len"):
        for k in range(len(BUCKET_EDGES)):
            sel = [
                abs(x)
                for row in d
                for t, x in enumerate(row)
                if bucket_of(t if kind == "pos" else len(row)) == k
            ]
            if sel:
                want[f"mismatch/abs_logp_{kind}_{bucket_name(k)}"] = sum(sel) / len(sel)
    assert want["mismatch/ratio_out_frac"] > 0 and len([k for k in want if "_pos_" in k]) >= 2
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_mini_batches_take_pi_old_before_the_first_step(small_model_dir):
    """Several mini-batches: every ratio is against the weights before the first step, so the
    second mini-batch's ratio moves off 1 (and the mismatch is measured against pi_old)."""
    samples = [s for g in make_batch(4, 4, seed=24) for s in g]
    tr = _trainer(small_model_dir, mini_batches=2, stream=False, lr=1e-2)
    st = tr.train_batch(samples)
    assert st.optimizer_steps == 2
    assert abs(st.ratio_mean - 1.0) > 1e-4
    one = _trainer(small_model_dir, stream=False, lr=1e-2).train_batch(samples)
    assert one.ratio_mean == pytest.approx(1.0, abs=1e-12)
    assert st.fidelity["mm_abs"] == pytest.approx(one.fidelity["mm_abs"], rel=1e-9)


def test_registries_and_config_errors_name_the_known_choices():
    assert set(LEVELS) == set(CORRECTION_LEVELS) - {"none"} and set(MODES) == set(CORRECTION_MODES)
    with pytest.raises(ConfigError, match="known: none, token, sequence, geometric"):
        RolloutCorrectionConfig(level="tokens")
    with pytest.raises(ConfigError, match="known: none, token"):
        get_level("tokens")
    with pytest.raises(ConfigError, match="known: truncate, mask"):
        RolloutCorrectionConfig(level="token", mode="clip")
    with pytest.raises(ConfigError, match="upper"):
        RolloutCorrectionConfig(level="token", upper=0.9)
    with pytest.raises(ConfigError, match="reject_upper"):
        RolloutCorrectionConfig(reject_upper=0.99)
    with pytest.raises(ConfigError, match="correction"):
        from_mapping(TrainerConfig, {"correction": {"levle": "token"}})


def test_auto_gives_every_arm_with_stale_tokens_decoupled_ppos_behaviour_weight():
    """Partial rollout, SortedRL's partial mode and the one-off pipeline train tokens an older
    policy sampled: ``objective: auto`` weights them by pi_old / pi_behav; on-policy arms get ppo."""
    from rollpacker.core.config import config_from_text

    cfg = config_from_text(
        "experiment: t\narms: [sync, tail_batching, partial, {name: sp, policy: sorted, mode: partial},\n"
        "  {name: so, policy: sorted}, {name: oo, policy: tail_batching, one_off: true}]\n"
    )
    got = {a: cfg.for_arm(a).train.objective for a in cfg.arm_names}
    assert got == {
        "sync": "ppo",
        "tail_batching": "ppo",
        "partial": "decoupled_ppo",
        "sp": "decoupled_ppo",
        "so": "ppo",
        "oo": "decoupled_ppo",
    }
