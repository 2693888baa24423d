"""A checkpoint restores weights, optimizer moments, RNG and policy version: resuming equals not
stopping."""

from __future__ import annotations

import pytest
import torch

from rollpacker.core.config import TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.trainers.torch_trainer import TorchTrainer

from .conftest import make_batch


def _flat(tr: TorchTrainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in tr.model.parameters()])


def test_resume_from_checkpoint_equals_uninterrupted(small_model_dir, tmp_path):
    cfg = TrainerConfig(lr=1e-2, tokens_per_micro_batch=256)
    b1, b2 = ([s for g in make_batch(4, 2, seed=s) for s in g] for s in (11, 12))
    straight = TorchTrainer(small_model_dir, cfg)
    straight.train_batch(b1)
    straight.train_batch(b2)

    first = TorchTrainer(small_model_dir, cfg)
    first.train_batch(b1)
    ck = first.save_checkpoint(tmp_path / "step-1")
    assert (ck / "model" / "config.json").is_file()
    resumed = TorchTrainer(small_model_dir, cfg)
    resumed.load_checkpoint(ck)
    assert resumed.policy_version == 1
    resumed.train_batch(b2)
    assert torch.equal(_flat(resumed), _flat(straight))
    assert resumed.policy_version == straight.policy_version == 2

    # without the optimizer state (fresh Adam moments) the second step differs: the test can fail
    fresh = TorchTrainer(ck / "model", cfg)
    fresh.train_batch(b2)
    assert not torch.equal(_flat(fresh), _flat(straight))


def test_checkpoint_refuses_pending_gradients_and_bad_dirs(small_model_dir, tmp_path):
    tr = TorchTrainer(small_model_dir, TrainerConfig())
    tr.accumulate([s for g in make_batch(2, 2, seed=1) for s in g])
    with pytest.raises(TrainerError, match="pending"):
        tr.save_checkpoint(tmp_path / "x")
    with pytest.raises(TrainerError, match="not a trainer checkpoint"):
        tr.load_checkpoint(tmp_path)
    with pytest.raises(TrainerError, match=r"no config\.json"):
        TorchTrainer(tmp_path, TrainerConfig())


def test_mini_batches_take_several_optimizer_steps(small_model_dir):
    tr = TorchTrainer(small_model_dir, TrainerConfig(stream=False, mini_batches=3))
    st = tr.train_batch([s for g in make_batch(6, 2, seed=4) for s in g])
    assert st.optimizer_steps == 3 and tr.policy_version == 3
    # later mini-batches see moved weights: the ratio leaves 1 and clipping can engage
    assert st.samples == 12


def test_the_weights_without_a_tied_head_leave_out_only_its_second_name(small_model_dir):
    tr = TorchTrainer(small_model_dir, TrainerConfig())
    every = dict(tr.weights())
    pushed = dict(tr.weights(tied_head=False))
    assert set(every) - set(pushed) == {"lm_head.weight"}  # the small model ties its head
    assert every["lm_head.weight"].data_ptr() == pushed["model.embed_tokens.weight"].data_ptr()
    assert all(torch.equal(every[n], t) for n, t in pushed.items())
    # an untied model keeps its head: it is a parameter of its own
    tr.model.lm_head.weight = torch.nn.Parameter(tr.model.lm_head.weight.detach().clone())
    assert "lm_head.weight" in dict(tr.weights(tied_head=False))
