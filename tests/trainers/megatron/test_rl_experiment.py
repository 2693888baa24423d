"""An RL experiment with ``train.backend: megatron`` at TP=2 (the inline runner: stages and services
in this process, the gang in a local Ray head, the vLLM CPU engine): 3 steps, the weights pushed
into the engine after every update; and the same experiment with ``checkpoint.every: 2`` and every
rank of the gang SIGKILLed in the middle of step 2's rollout (the stream trainer holds accumulated
gradients then), between checkpoints: step 1 stored none, its weights were only in the gang and
the engine. The run's own retry rolls the arm back to the base model's state, rebuilds the gang
from it, re-runs steps 1 and 2 (step 1's prompts trained again, once) and ends with checkpoints
bit-identical to the uninterrupted run's: the kill lost nothing and left nothing behind."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 3


def _config(tmp: Path, experiment: str, extra: str = "") -> Path:
    cfg = tmp / f"{experiment}.yaml"
    cfg.write_text(
        f"""
experiment: {experiment}
steps: {STEPS}
arms: [tail_batching]
tracking_uri: sqlite:///{tmp / "mlflow.db"}
store: {{endpoint: "file://{tmp / "store"}"}}
task: {{name: synthetic_math, num_examples: 200, val_size: 8}}
model: {{preset: tiny, warmup_steps: 200}}
rollout: {{prompts_per_step: 4, responses_per_prompt: 2, max_tokens: 48}}
engine: {{max_num_seqs: 16, max_model_len: 200, kv_cache_gib: 1}}
planner: {{profile_batches: [1, 8], profile_contexts: [16, 64], profile_window: 4}}
validation: {{every: 100, max_tokens: 32}}
train: {{backend: megatron, megatron: {{tp: 2}}}}
{extra}
"""
    )
    return cfg


def _chain(cfg_path: Path) -> tuple[list, object, object]:  # type: ignore[type-arg]
    from rollpacker.core.config import load_config
    from rollpacker.store import open_store
    from rollpacker.store.state_store import StateStore

    cfg = load_config(cfg_path)
    store = open_store(cfg.store)
    states = StateStore(store, cfg.experiment, "tail_batching")
    assert states.history() == list(range(-1, STEPS))
    return [states.load(s) for s in range(STEPS)], store, states


def _weights(store: object, uri: str, tmp: Path) -> dict[str, object]:
    """The Hugging Face weights of the checkpoint at ``uri``."""
    from safetensors.torch import load_file

    from rollpacker.store.base import cached_download

    ck = cached_download(store, uri, tmp)  # type: ignore[arg-type]
    out: dict[str, object] = {}
    for f in sorted((ck / "model" if (ck / "model").is_dir() else ck).glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"no weights in {ck}"
    return out


def test_megatron_tp2_experiment_syncs_every_step_and_resumes_exactly_after_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from rollpacker.experiment import run_experiment
    from rollpacker.stages.hooks import HOOK_ENV
    from rollpacker.testing.chain import chain_problems
    from rollpacker.testing.faults import HOOK, mark_name, service_pids
    from rollpacker.tracking import ExperimentTracker

    # the uninterrupted run
    clean_cfg = _config(tmp_path, "mg-clean")
    clean = run_experiment(clean_cfg, runner="inline", retries=0, start_services=False, echo=print)
    assert clean.arms[0].committed_step == STEPS - 1 and clean.arms[0].failures == 0
    assert not service_pids("RankWorker"), "the arm's end left gang processes behind"

    # the same experiment, every rank killed while step 2's rollout streams gradients into it
    marks = tmp_path / "marks"
    marks.mkdir()
    fault = "rollout:RankWorker@1"
    monkeypatch.setenv(HOOK_ENV, HOOK)
    monkeypatch.setenv("ROLLPACKER_FAULT", fault)
    monkeypatch.setenv("ROLLPACKER_FAULT_MARK", str(marks))
    lines: list[str] = []

    def echo(s: str) -> None:
        lines.append(s)
        print(s)

    killed_cfg = _config(tmp_path, "mg-killed", "checkpoint: {every: 2, export_every: 3}")
    killed = run_experiment(killed_cfg, runner="inline", retries=1, start_services=False, echo=echo)
    assert [p.name for p in marks.iterdir()] == [mark_name(fault)]
    (arm,) = killed.arms
    assert arm.failures == 1 and arm.committed_step == STEPS - 1, lines
    failure = next(s for s in lines if "a step failed" in s)
    assert re.search(r"rank \d on node [\d.]+(, rank \d on node [\d.]+)* died", failure), failure
    assert "re-running from step 1" in failure, failure  # 0-based
    assert "the weights step 0 trained are in no store" in capfd.readouterr().err  # the rollback, said

    clean_chain, clean_store, clean_states = _chain(clean_cfg)
    killed_chain, killed_store, killed_states = _chain(killed_cfg)
    # step 0 stored no checkpoint (every 2nd step and the last do): it names step -1's to roll back to
    assert [s.rollback_step for s in killed_chain] == [-1, None, None]
    assert not chain_problems(killed_cfg, STEPS), chain_problems(killed_cfg, STEPS)  # exactly once
    for step, (a, b) in enumerate(zip(clean_chain, killed_chain, strict=True)):
        assert a.policy_version == b.policy_version == step + 1  # one update per committed step
        # the same prompts and responses trained (the engine sampled with the same synced weights)
        ga = json.loads(clean_states.get_blob(step, "groups.json"))  # type: ignore[attr-defined]
        gb = json.loads(killed_states.get_blob(step, "groups.json"))  # type: ignore[attr-defined]
        assert ga["trained"] == gb["trained"]
    # the last checkpoint (older ones are collected) is bit-identical: weights and the losses on the way
    wa = _weights(clean_store, clean_chain[-1].checkpoint_uri, tmp_path / "ck-clean")
    wb = _weights(killed_store, killed_chain[-1].checkpoint_uri, tmp_path / "ck-killed")
    assert wa.keys() == wb.keys()
    differ = [n for n in wa if not torch.equal(wa[n], wb[n])]  # type: ignore[arg-type]
    assert not differ, f"the resumed run's weights differ from the clean run's: {differ[:5]}"
    # step 2's Hugging Face export (export_every: 3), outside the collected checkpoints, holds them too
    (export,) = {
        k.split("/export/")[1].split("/")[0] for k in killed_store.list("mg-killed/tail_batching/export/")
    }  # type: ignore[attr-defined]
    assert export.startswith("step-000002-")
    we = _weights(
        killed_store, killed_store.uri(f"mg-killed/tail_batching/export/{export}/"), tmp_path / "ex"
    )  # type: ignore[attr-defined]
    assert all(torch.equal(we[n], wb[n]) for n in wb)  # type: ignore[arg-type]
    tracker_clean = ExperimentTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "mg-clean")
    tracker = ExperimentTracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "mg-killed")
    run_id = killed_chain[-1].mlflow_run_id
    for key in ("train/loss", "train/grad_norm", "reward/mean"):
        la = tracker_clean.metric_history(clean_chain[-1].mlflow_run_id, key)
        lb = tracker.metric_history(run_id, key)
        assert len(lb) == STEPS and la == lb, (key, la, lb)

    stored = tracker.metric_history(run_id, "train/checkpoint_stored")
    assert stored == [(1, 0.0), (2, 1.0), (3, 1.0)], stored
    # the weights reached the engine after every update, and the engine sampled with them
    synced = tracker.metric_history(run_id, "sync/weights_s")
    assert [s for s, _ in synced] == list(range(1, STEPS + 1))
    ratios = tracker.metric_history(run_id, "train/ratio_mean")
    assert all(abs(r - 1.0) < 1e-3 for _, r in ratios), ratios  # behaviour logprobs = trainer's
    assert not service_pids("RankWorker")
