"""The objective registry: lookup errors name the known objectives, and each objective is its formula."""

from __future__ import annotations

import math

import pytest
import torch

from rollpacker.core.config import OBJECTIVE_NAMES, TrainerConfig
from rollpacker.core.errors import ConfigError
from rollpacker.trainers.objectives import OBJECTIVES, PgInputs, get_objective

EPS_LOW, EPS_HIGH = 0.2, 0.28
# two samples x three tokens; ratios inside and outside [0.8, 1.28], positive and negative advantages
LOGP = [[-1.0, -2.0, -0.5], [-3.0, -0.1, -1.2]]
OLD = [[-1.1, -1.5, -0.9], [-2.5, -0.6, -1.2]]
ADV = [1.5, -0.7]


def _clip(x: float) -> float:
    return min(max(x, 1 - EPS_LOW), 1 + EPS_HIGH)


def _ppo(p: float, old: float, a: float) -> tuple[float, float]:
    r = math.exp(p - old)
    return -min(r * a, _clip(r) * a), r


# decoupled PPO's per-token term is ppo's around pi_old; its behaviour weight exp(old - b) is the
# trainer's (tests/trainers/test_decoupled_ppo.py checks the product)
FORMULAS = {"ppo": _ppo, "decoupled_ppo": _ppo}


def test_unknown_objective_lists_the_known_names() -> None:
    with pytest.raises(ConfigError) as err:
        get_objective("grpo_v9")
    assert "'grpo_v9'" in str(err.value)
    for name in OBJECTIVES:
        assert name in str(err.value)


def test_registry_keys_are_names_the_config_accepts() -> None:
    assert set(OBJECTIVES) == set(OBJECTIVE_NAMES) == {*FORMULAS, "gspo"}
    for name, obj in OBJECTIVES.items():
        assert obj.name == name and get_objective(name) is obj
        assert TrainerConfig(objective=name).objective == name


@pytest.mark.parametrize("name", sorted(FORMULAS))
def test_objective_is_its_formula(name: str) -> None:
    obj = get_objective(name)

    def t(rows: list) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.float64)

    logp = t(LOGP).requires_grad_(True)
    ones = torch.ones(2, 3, dtype=torch.float64)
    terms = obj.per_token(PgInputs(logp, t(OLD), t(ADV)[:, None], ones, EPS_LOW, EPS_HIGH))
    for i, j in ((i, j) for i in range(2) for j in range(3)):
        loss, ratio = FORMULAS[name](LOGP[i][j], OLD[i][j], ADV[i])
        assert float(terms.loss[i, j]) == pytest.approx(loss, rel=1e-12)
        assert float(terms.ratio[i, j]) == pytest.approx(ratio, rel=1e-12)
        assert float(terms.clipped_ratio[i, j]) == pytest.approx(_clip(ratio), rel=1e-12)
    assert obj.behaviour_weighted is (name == "decoupled_ppo")
    clipped = (terms.ratio != terms.clipped_ratio).sum()
    assert 0 < int(clipped) < 6  # the example exercises both branches of the clip
    terms.loss.sum().backward()  # the loss carries the gradient to logp
    assert logp.grad is not None and bool(logp.grad.abs().sum() > 0)


def test_gspo_ratio_is_the_sequence_geometric_mean_and_clips_whole_sequences() -> None:
    # row 0: three tokens, log-ratio mean 0.3 (clipped above 1.28 with A > 0); row 1: two tokens and
    # one pad, log-ratio mean -0.05 (inside the range)
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.3, -2.4, -0.7], [-2.8, -0.2, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.5], [-0.7]], dtype=torch.float64)
    terms = get_objective("gspo").per_token(PgInputs(logp, old, adv, mask, EPS_LOW, EPS_HIGH))
    s = [math.exp((0.3 + 0.4 + 0.2) / 3), math.exp((-0.2 + 0.1) / 2)]
    for i in range(2):
        for j in range(3 if i == 0 else 2):
            assert float(terms.ratio[i, j]) == pytest.approx(s[i], rel=1e-12)
            want = -min(s[i] * float(adv[i]), _clip(s[i]) * float(adv[i]))
            assert float(terms.loss[i, j]) == pytest.approx(want, rel=1e-12)
    # seq-mean gradient: row 0 is clipped (no gradient); row 1's is -A * s / |y| on each token
    ((terms.loss * mask).sum(1) / mask.sum(1)).sum().backward()
    assert logp.grad is not None
    assert logp.grad[0].abs().max() == 0
    assert logp.grad[1, :2].tolist() == pytest.approx([0.7 * s[1] / 2] * 2, rel=1e-12)
    assert float(logp.grad[1, 2]) == 0
