"""The short learning check of `make test` (the full one is `rollpacker lab bench learning`).

Tail batching RL-trains the warmed-up tiny model through the one step path on a small prompt set it
cycles through, and the pass rate on those prompts (mean of 4 sampled responses each,
``validation.split: train``) must rise clearly. Its run holds both kinds of round: short rounds
(speculation, aborts, the long-prompt queue) and long rounds, which launch the queued prompts with
no speculation and wait for every response, as a synchronous round does; the trainer, the
advantages and the weight sync are the ones every policy shares. So one run covers what a second,
synchronous run would (it cost 98 s of a 30-minute suite); `rollpacker lab bench learning` compares
the policies' learning, 3 seeds each (docs/training.md). A small,
revisited prompt set is what makes this robust in a few minutes: the held-out gain the benchmark
measures needs far more steps than a test can afford (docs/training.md has its figures). This
catches what breaks learning without breaking anything else: a flipped advantage, advantages given
to the wrong responses, a stale engine after the weight sync, a normalization that scales the
update away.
"""

from __future__ import annotations

import json

import pytest

CONFIG = """
experiment: learning-check
steps: 20
task: {num_examples: 48, val_size: 24}
model: {preset: tiny, warmup_steps: 200}
rollout: {prompts_per_step: 8, responses_per_prompt: 8, max_tokens: 512}
engine: {max_num_seqs: 128, max_model_len: 600, kv_cache_gib: 1}
train: {lr: 3.0e-5}
validation: {every: 100, temperature: 1.0, max_tokens: 512, split: train, samples: 4}
"""


@pytest.mark.slow
@pytest.mark.e2e  # a whole 20-step run
def test_rl_raises_the_pass_rate_on_the_prompts_it_trains(tmp_path):
    from rollpacker.experiment import train_arm, train_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    policy = "tail_batching"
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)
    over = {"out_dir": str(tmp_path / "runs"), "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    text, cfg = train_config(f, {**over, "rollout.policy": policy})
    s = train_arm(text, progress=False)
    assert s.trained_samples == cfg.steps * 8 * 8 and s.exactly_once.ok
    # the summary reads back what the benchmarks compare from the MLflow run: the off-policy degree
    # (0: tail batching trains only tokens of the weights it trains from) and the engine/trainer
    # mismatch (fp32 engine and trainer here: ~1e-8 measured)
    assert len(s.step_metrics) == cfg.steps
    for m in s.step_metrics:
        assert m["train/policy_lag"] == 0.0 and m["train/off_policy_frac"] == 0.0, m
        assert 0.0 <= m["mismatch/abs_logp_mean"] < 1e-3 and m["correction/masked_frac"] == 0.0, m
    states = StateStore(open_store(cfg.store), cfg.experiment, s.arm)
    kinds = [json.loads(states.get_blob(k, "groups.json"))["round_kind"] for k in range(cfg.steps)]
    assert set(kinds) == {"short", "long"}, kinds  # both kinds of round trained
    (step0, before), (stepn, after) = s.val_accuracy[0], s.val_accuracy[-1]
    assert (step0, stepn) == (0, cfg.steps)
    # measured here: +0.1x to +0.2x over 20 steps (sync and tail batching alike); a broken update
    # leaves it flat or lowers it.
    assert after - before >= 0.06, (policy, before, after)
