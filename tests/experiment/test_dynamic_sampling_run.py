"""DAPO's dynamic sampling end to end under tail batching: `rollpacker train` (the stages, services
in this process) on real vLLM and torch, the warmed-up tiny model on synthetic math.

The rollout service asks each complete group's rewards of the reward service (``group_rewards``)
and the round keeps a group with reward variance or drops it and draws a replacement. Checked from
the committed groups logs, the state chain, MLflow and what the trainer service received:

- every update holds ``P0`` groups, and each group the trainer got has reward variance;
- the trainer got exactly the kept groups: no dropped group is trained (nor queued);
- every prompt a step launched (the plan's, plus the extra draws) is exactly one of trained,
  deferred and dropped in that step, and across the steps exactly one of trained, still queued and
  dropped (a deferred prompt may be dropped when the long round runs it: core.accounting);
- ``rollout/extra_prompts`` and ``rollout/dropped_groups`` are logged per step and match the logs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict

import pytest

from rollpacker.core.accounting import StepPrompts, account_prompts
from rollpacker.core.advantages import TrainSample

CONFIG = """
experiment: dynamic-sampling
steps: 3
task: {num_examples: 200, val_size: 4}
model: {preset: tiny, warmup_steps: 200}
rollout:
  policy: tail_batching
  prompts_per_step: 4
  responses_per_prompt: 4
  eta_p: 2.0
  max_tokens: 80
  dynamic_sampling: {enabled: true, max_extra_prompts: 48}
engine: {max_num_seqs: 64, max_model_len: 200, kv_cache_gib: 1}
train: {tokens_per_micro_batch: 4096}
validation: {every: 100, max_tokens: 16, samples: 1}
"""


MIXED = """
experiment: dynamic-sampling-mixed
steps: 1
task: {name: mixed, num_examples: 60, val_size: 3}
model: {preset: micro, warmup_steps: 0}
rollout:
  policy: tail_batching
  prompts_per_step: 4
  responses_per_prompt: 2
  max_tokens: 48
  dynamic_sampling: {enabled: true, max_extra_prompts: 40}
engine: {max_num_seqs: 32, max_model_len: 256, kv_cache_gib: 1}
train: {tokens_per_micro_batch: 2048}
validation: {every: 100, max_tokens: 16, samples: 1}
reward: {sandbox: {t_min_s: 0.5, t_max_s: 2.0}, judge: {warmup_steps: 3}}
"""

Received = dict[str, dict[str, tuple[TrainSample, ...]]]  # attempt -> prompt id -> samples


def _train(tmp_path, monkeypatch, config: str):  # type: ignore[no-untyped-def]
    """Train the config's one arm; what the trainer service received, by attempt and prompt."""
    from rollpacker.experiment import train_arm, train_config
    from rollpacker.services.trainer import TrainerService

    received: Received = defaultdict(dict)
    submit = TrainerService.submit

    def recording_submit(self, attempt, prompt_id, samples):  # type: ignore[no-untyped-def]
        received[attempt][prompt_id] = samples
        return submit(self, attempt, prompt_id, samples)

    monkeypatch.setattr(TrainerService, "submit", recording_submit)
    f = tmp_path / "c.yaml"
    f.write_text(config)
    over = {"out_dir": str(tmp_path / "runs"), "tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"}
    text, cfg = train_config(f, over)
    return cfg, train_arm(text, progress=False), received


def test_a_dynamic_sampling_config_trains_as_its_one_arm(tmp_path) -> None:
    """`rollpacker train` and `bench learning`'s dapo arm: a config with dynamic sampling and no
    arms (so the default sync and tail_batching arms) is valid as the one arm it trains; under a
    policy other than tail batching it is refused by name."""
    from rollpacker.core.errors import ConfigError
    from rollpacker.experiment import train_config

    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)
    _, cfg = train_config(f, {"out_dir": str(tmp_path / "runs")})
    assert cfg.arm_names == ["tail_batching-seed0"] and cfg.rollout.dynamic_sampling.enabled
    with pytest.raises(ConfigError, match=r"dynamic_sampling\.enabled with rollout\.policy = 'sync'"):
        train_config(f, {"out_dir": str(tmp_path / "runs"), "rollout.policy": "sync"})


@pytest.mark.slow
def test_dynamic_sampling_trains_only_groups_with_signal_and_accounts_every_prompt(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    cfg, s, received = _train(tmp_path, monkeypatch, CONFIG)
    p0, r0 = cfg.rollout.prompts_per_step, cfg.rollout.responses_per_prompt
    assert s.steps == cfg.steps and s.exactly_once.ok

    states = StateStore(open_store(cfg.store), cfg.experiment, s.arm)
    chain = [states.load(k) for k in range(-1, cfg.steps)]
    logs = [json.loads(states.get_blob(k, "groups.json")) for k in range(cfg.steps)]
    launched_short = math.ceil(cfg.rollout.eta_p * p0)
    client = MlflowClient(tracking_uri=cfg.tracking_uri)  # MLflow step = RL step + 1
    logged = {
        key: {m.step: m.value for m in client.get_metric_history(s.run_id, key)}
        for key in ("rollout/extra_prompts", "rollout/dropped_groups")
    }
    for k, g in enumerate(logs):
        prev, cur = chain[k], chain[k + 1]
        trained, deferred, dropped, extra = (set(g[n]) for n in ("trained", "deferred", "dropped", "extra"))
        # every update holds P0 groups, and the trainer got exactly them: no dropped group
        assert len(g["trained"]) == len(trained) == p0
        got = received[g["attempt"]]
        assert set(got) == trained, (k, sorted(got), sorted(trained))
        for pid, samples in got.items():
            assert len(samples) == r0
            assert statistics.pvariance([x.reward for x in samples]) > 0, f"{pid} has no reward variance"
        # each launched prompt is exactly one of trained, deferred, dropped
        assert not trained & deferred and not trained & dropped and not deferred & dropped
        outcome = trained | deferred | dropped
        assert extra <= outcome and len(g["extra"]) == len(extra)
        if g["round_kind"] == "long":
            assert outcome == set(g["from_queue"]) | extra and not set(g["from_queue"]) & extra
            assert cur.long_queue == prev.long_queue[len(g["from_queue"]) :] + tuple(g["deferred"])
        else:
            assert len(outcome) == launched_short + len(extra)
            assert cur.long_queue == prev.long_queue + tuple(g["deferred"])
        # one replacement per dropped group (the budget is never reached here)
        assert len(extra) == len(dropped)
        # a drop is never queued, and a queued prompt is never drawn again
        assert not dropped & set(cur.long_queue) and not extra & set(prev.long_queue)
        if g["round_kind"] == "short":
            assert not outcome & set(prev.long_queue)
        assert (logged["rollout/extra_prompts"][k + 1], logged["rollout/dropped_groups"][k + 1]) == (
            len(extra),
            len(dropped),
        )

    # across the steps, every prompt is exactly one of trained, waiting and dropped (a deferred
    # prompt whose group has no variance when the long round runs it is dropped there): the
    # chain's one account, core.accounting, as `rollpacker train` reports it
    account = account_prompts(
        (StepPrompts(tuple(g["trained"]), tuple(g["deferred"]), tuple(g["dropped"])) for g in logs),
        queued=chain[-1].long_queue,
    )
    assert account.problems() == [] and account == s.exactly_once
    # the run did exercise dynamic sampling: groups were dropped and replacements drawn
    assert account.dropped >= 1, logs
    assert {k for k in received} >= {g["attempt"] for g in logs}


@pytest.mark.slow
def test_dynamic_sampling_asks_the_sandbox_and_the_judge(tmp_path, monkeypatch):
    """Math, code and judge prompts: each group's rewards come from its kind's service (rule and
    sandbox, or the LLM judge). The untrained model fails every math and code prompt (rewards all
    0: dropped, replacements drawn); the judge's P(yes) differs between responses (kept)."""
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    cfg, s, received = _train(tmp_path, monkeypatch, MIXED)
    assert s.exactly_once.ok
    states = StateStore(open_store(cfg.store), cfg.experiment, s.arm)
    g = json.loads(states.get_blob(0, "groups.json"))
    assert len(g["trained"]) == cfg.rollout.prompts_per_step
    got = received[g["attempt"]]
    assert set(got) == set(g["trained"])
    for pid, samples in got.items():
        assert statistics.pvariance([x.reward for x in samples]) > 0, pid
    kinds = {p.split("-")[0] for p in (*g["trained"], *g["dropped"])}
    assert kinds >= {"judge", "code"} and g["dropped"] and len(g["extra"]) == len(g["dropped"])
    assert not set(g["dropped"]) & (set(g["trained"]) | set(g["deferred"]))
