"""`rollpacker run --runner inline`: the same stages and services in one process (no Ray, no KFP),
against a real S3 server and a real MLflow store; a second run continues from the committed state."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollpacker import devservices

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[devservices.Services]:
    root = tmp_path_factory.mktemp("inline")
    svc = devservices.up(
        root, bucket="inline", mlflow=False, ray=False, seaweed_ports=devservices.SeaweedPorts.free()
    )
    try:
        yield svc
    finally:
        devservices.down(root, grace_s=3.0)


def test_inline_runner_runs_both_arms_and_resumes(
    s3: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.core.config import load_config
    from rollpacker.experiment import run_experiment
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    cfg_path = tmp_path / "inline.yaml"
    body = f"""
experiment: inline
steps: {{steps}}
tracking_uri: sqlite:///{tmp_path / "mlflow.db"}
store: {{{{endpoint: "{s3.s3_endpoint}", bucket: {s3.bucket}}}}}
task: {{{{name: synthetic_math, num_examples: 200, val_size: 8}}}}
model: {{{{preset: tiny, warmup_steps: 200}}}}
rollout: {{{{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64}}}}
engine: {{{{max_num_seqs: 32, max_model_len: 200, kv_cache_gib: 1}}}}
planner: {{{{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}}}
validation: {{{{every: 100, max_tokens: 32}}}}
"""
    cfg_path.write_text(body.format(steps=2))
    out = run_experiment(cfg_path, runner="inline", start_services=False, echo=lambda s: None)
    assert [a.arm for a in out.arms] == ["sync", "tail_batching"]
    assert all(a.committed_step == 1 and a.failures == 0 for a in out.arms)
    assert "tail_batching" in out.compare_table and "speedup" in out.compare_table
    # every arm logs the engine/trainer mismatch and the weight-sync probe at every step
    # (docs/training.md, "Rollout-trainer fidelity"): float32 engine and trainer agree closely
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("inline").experiment_id  # type: ignore[union-attr]
    for arm in ("sync", "tail_batching"):
        run = client.search_runs([exp], f"tags.`rollpacker.arm` = '{arm}'")[0]
        gaps = client.get_metric_history(run.info.run_id, "mismatch/abs_logp_mean")
        probes = client.get_metric_history(run.info.run_id, "sync/probe_logprob_gap")
        assert len(gaps) == 2 and all(m.value < 1e-3 for m in gaps), (arm, gaps)
        assert len(probes) == 2 and all(m.value < 2e-3 for m in probes), (arm, probes)
    assert "mismatch/abs_logp_mean mean" in out.compare_table

    cfg_path.write_text(body.format(steps=3))
    again = run_experiment(
        cfg_path, runner="inline", arms=["sync"], start_services=False, echo=lambda s: None
    )
    assert again.arms[0].steps_run == 1
    cfg = load_config(cfg_path)
    states = StateStore(open_store(cfg.store), cfg.experiment, "sync")
    assert states.history() == [-1, 0, 1, 2]
    assert states.latest().policy_version == 3  # type: ignore[union-attr]


def test_layouts_follow_the_plan_and_the_profile_is_registered(
    s3: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines in layouts (TP 1 x DP 2 and TP 2 x DP 1 on two cores) with PAT switching on: the
    first plan profiles both layouts, the profile lands in the store, the state and MLflow, the
    plan starts from the profiled best TP, and each round reports its layout and the drift."""
    import os

    from mlflow.tracking import MlflowClient

    from rollpacker.core.latency import ProfileTable
    from rollpacker.experiment import run_experiment
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores for the layouts")
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    db = tmp_path / "mlflow.db"
    cfg_path = tmp_path / "layouts.yaml"
    cfg_path.write_text(
        f"""
experiment: layouts
steps: 2
arms: [tail_batching]
tracking_uri: sqlite:///{db}
store: {{endpoint: "{s3.s3_endpoint}", bucket: {s3.bucket}}}
task: {{name: synthetic_math, num_examples: 200, val_size: 8}}
model: {{preset: tiny, warmup_steps: 200}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64}}
engine: {{max_num_seqs: 32, max_model_len: 200, kv_cache_gib: 1}}
planner: {{devices: 2, max_tp: 2, switching: true, check_every: 4, reprofile_margin: 100.0,
          profile_batches: [1, 4, 16], profile_contexts: [16, 64], profile_window: 4}}
validation: {{every: 100, max_tokens: 32}}
"""
    )
    out = run_experiment(cfg_path, runner="inline", start_services=False, echo=lambda s: None)
    assert out.arms[0].committed_step == 1 and out.arms[0].failures == 0

    from rollpacker.core.config import load_config

    cfg = load_config(cfg_path)
    store = open_store(cfg.store)
    state = StateStore(store, "layouts", "tail_batching").latest()
    assert state is not None and state.profile_uri
    doc = store.get_json(store.key_of(state.profile_uri))
    table = ProfileTable.from_dict(doc["table"])
    assert {lp.layout.name for lp in table.layouts} == {"tp1dp2", "tp2dp1"}
    assert set(doc["validation"]) == {"tp1dp2", "tp2dp1"}
    assert state.tp_plan.initial_tp in (1, 2)

    client = MlflowClient(f"sqlite:///{db}")
    run = client.search_runs(
        [client.get_experiment_by_name("layouts").experiment_id], "tags.`rollpacker.arm` = 'tail_batching'"
    )[0]
    assert run.data.tags["rollpacker.profile_uri"] == state.profile_uri
    names = {a.path for a in client.list_artifacts(run.info.run_id, "profiles")}
    assert any(n.endswith(".json") for n in names) and any(n.endswith(".png") for n in names)
    tp = [
        m.value
        for m in sorted(client.get_metric_history(run.info.run_id, "rollout/tp"), key=lambda m: m.step)
    ]
    assert len(tp) == 2 and all(v in (1.0, 2.0) for v in tp)
    # the first round runs on the profiled best layout's TP (recorded by the first commit)
    first = StateStore(store, "layouts", "tail_batching").load(0)
    assert first.tp_plan.initial_tp in (1, 2) and tp[0] == float(first.tp_plan.initial_tp)
    drift = client.get_metric_history(run.info.run_id, "planner/drift")
    assert len(drift) == 2 and all(m.value >= 0 for m in drift)
    assert client.get_metric_history(run.info.run_id, "rollout/switches")


def test_buffered_policies_and_the_one_off_mode_keep_their_caches_in_the_state(
    s3: devservices.Services, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SortedRL (partial mode), partial rollout and tail batching in the one-off pipeline, through
    the stages: the rollout buffer and the pending batch live in the committed state, a second run
    with fresh services (a restart) resumes from them, and the off-policy lag is logged."""
    import json

    from mlflow.tracking import MlflowClient

    from rollpacker.core.config import load_config
    from rollpacker.experiment import run_experiment
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    db = tmp_path / "mlflow.db"
    cfg_path = tmp_path / "policies.yaml"
    body = f"""
experiment: policies
steps: {{steps}}
arms:
  - {{{{name: sorted_partial, policy: sorted, mode: partial}}}}
  - partial
  - {{{{name: tb_one_off, policy: tail_batching, one_off: true}}}}
tracking_uri: sqlite:///{db}
store: {{{{endpoint: "{s3.s3_endpoint}", bucket: {s3.bucket}}}}}
task: {{{{name: synthetic_math, num_examples: 200, val_size: 8}}}}
model: {{{{preset: tiny, warmup_steps: 200}}}}
rollout: {{{{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 64,
           sorted: {{{{group_size: 2}}}}, partial: {{{{in_flight: 16}}}}}}}}
engine: {{{{max_num_seqs: 32, max_model_len: 200, kv_cache_gib: 1}}}}
planner: {{{{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}}}
validation: {{{{every: 100, max_tokens: 32}}}}
"""
    cfg_path.write_text(body.format(steps=2))
    out = run_experiment(cfg_path, runner="inline", start_services=False, echo=lambda s: None)
    assert [(a.arm, a.committed_step, a.failures) for a in out.arms] == [
        ("sorted_partial", 1, 0),
        ("partial", 1, 0),
        ("tb_one_off", 1, 0),
    ]
    cfg_path.write_text(body.format(steps=3))  # a new run: fresh services, state from the store
    again = run_experiment(cfg_path, runner="inline", start_services=False, echo=lambda s: None)
    assert all(a.steps_run == 1 and a.failures == 0 for a in again.arms)

    cfg = load_config(cfg_path)
    store = open_store(cfg.store)

    def states(arm: str) -> StateStore:
        return StateStore(store, "policies", arm)

    # SortedRL: a group of n * P0 = 8 prompts; step 0 trains 4 and buffers 4, step 1 trains those
    s0 = states("sorted_partial").load(0)
    assert len(s0.partial_cache) == 4
    g1 = json.loads(states("sorted_partial").get_blob(1, "groups.json"))
    assert sorted(g1["trained"]) == sorted(e.prompt_id for e in s0.partial_cache)
    assert states("sorted_partial").load(1).partial_cache == ()  # the group is consumed: reload

    # partial rollout: the step after the restart resumes exactly the committed cache
    p1 = states("partial").load(1)
    g2 = json.loads(states("partial").get_blob(2, "groups.json"))
    assert set(g2["from_queue"]) == {e.prompt_id for e in p1.partial_cache}

    # one-off: step 0 only rolls out; each later step trains the previous step's batch
    one = states("tb_one_off")
    assert [one.load(s).policy_version for s in (0, 1, 2)] == [0, 1, 2]
    assert all(one.load(s).pending_batch_uri for s in (0, 1, 2))
    assert len({k.split("/")[3] for k in store.list("policies/tb_one_off/batches/")}) <= 2

    client = MlflowClient(f"sqlite:///{db}")
    exp = client.get_experiment_by_name("policies").experiment_id

    def metric(arm: str, key: str) -> list[float]:
        run = client.search_runs([exp], f"tags.`rollpacker.arm` = '{arm}'")[0]
        return [
            m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        ]

    # step 1 trains step 0's rollout from the same weights (no update at step 0): lag 0; from
    # step 2 on, one update lies between sampling and training
    assert metric("tb_one_off", "train/policy_lag") == [0.0, 1.0]
    assert metric("partial", "train/behav_weight")  # the decoupled objective's importance weight
    assert all(v == 0.0 for v in metric("sorted_partial", "rollout/tokens_wasted"))
    assert len(metric("partial", "train/policy_lag")) == 3
