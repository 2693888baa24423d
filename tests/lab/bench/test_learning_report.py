"""The learning benchmark's report without training: every arm is a valid config, the learning
criteria, the seed bands of the plot, and the MLflow run it logs."""

from __future__ import annotations

import pytest

from rollpacker.core.accounting import PromptAccount
from rollpacker.core.config import load_config, resolve_config
from rollpacker.experiment import SUMMARY_KEYS, TrainSummary
from rollpacker.lab.bench.learning import (
    ARMS,
    _aggregate,
    _arm_record,
    _band,
    _curve,
    criteria,
    log_to_mlflow,
    plot,
    render,
)


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_every_arm_is_a_valid_config_of_the_shipped_ones(arm) -> None:
    for name in ("default", "learning"):
        # as the one arm a learning run trains (a shipped file's own arms include sync)
        cfg = load_config(resolve_config(name), {**ARMS[arm], "arms": [ARMS[arm]["rollout.policy"]]})
        assert cfg.rollout.policy.value == ARMS[arm]["rollout.policy"]
    assert load_config(resolve_config("default"), ARMS["control"]).shaping().estimator == "zero"


def _run(arm: str, seed: int, start: float, end: float) -> dict:
    n = 4
    return {
        "arm": arm,
        "seed": seed,
        "val_accuracy_start": start,
        "val_accuracy_end": end,
        "val_curve": [[0, start], [n, end]],
        "reward_curve": [start + (end - start) * k / n for k in range(1, n + 1)],
        "wall_s": 10.0,
        "rollout_s": 5.0,
        "trained_samples": 64,
        "exactly_once": {"ok": True, "prompts_trained": 16, "waiting": 0},
    }


def _report() -> dict:
    runs = [
        *(_run("sync", s, 0.30, 0.50 + 0.01 * s) for s in range(3)),
        *(_run("tail_batching", s, 0.30, 0.49 + 0.01 * s) for s in range(3)),
        *(_run("control", s, 0.30, 0.31) for s in range(3)),
    ]
    per_arm = {
        a: _aggregate([r for r in runs if r["arm"] == a]) for a in ("sync", "tail_batching", "control")
    }
    return {"runs": runs, "per_arm": per_arm, "seeds": [0, 1, 2], "criteria": criteria(per_arm)}


def test_criteria_are_issue_22s_bar() -> None:
    rep = _report()
    assert rep["per_arm"]["sync"]["gain_points_mean"] == pytest.approx(21.0)
    assert rep["criteria"] == {
        "sync_gains_15_points": True,
        "tail_batching_gains_15_points": True,
        "control_gains_under_3_points": True,
        "tail_batching_within_2_points_of_sync": True,
    }
    flat = {**rep["per_arm"], "control": {**rep["per_arm"]["control"], "gain_points_mean": 4.0}}
    flat["sync"] = {**flat["sync"], "gain_points_mean": 10.0}
    assert criteria(flat)["control_gains_under_3_points"] is False
    assert criteria(flat)["sync_gains_15_points"] is False
    assert "pass  sync_gains_15_points" in render(rep)


def test_each_run_reports_the_off_policy_lag_of_its_trained_tokens() -> None:
    """SortedRL's partial mode trains older tokens: the report says how many and how old."""
    steps = ({"train/policy_lag": 0.5, "train/off_policy_frac": 0.2}, {"train/policy_lag": 1.5})
    once = PromptAccount(prompts_trained=16, trained_twice=(), deferred_total=0, deferred_lost=(), waiting=0)
    s = TrainSummary(
        "sorted_partial", "r1", 2, 2, 64, ((0, 0.3), (2, 0.4)), 9.0, "file://x", "sqlite://", once, steps
    )
    rec = _arm_record("sorted_partial", 0, s)
    assert rec["policy_lag_mean"] == pytest.approx(1.0) and rec["off_policy_frac_mean"] == pytest.approx(0.1)
    agg = _aggregate([rec, {**rec, "policy_lag_mean": 0.0, "off_policy_frac_mean": 0.0}])
    assert agg["policy_lag_mean"] == pytest.approx(0.5) and agg["off_policy_frac_mean"] == pytest.approx(0.05)
    rep = {"runs": [rec], "per_arm": {"sorted_partial": agg}}
    assert "lag 0.50, off-policy 5%" in render(rep)


def test_a_metric_the_summary_does_not_read_back_is_refused_not_reported_as_missing() -> None:
    once = PromptAccount(prompts_trained=16, trained_twice=(), deferred_total=0, deferred_lost=(), waiting=0)
    steps = ({"mismatch/abs_logp_mean": 2e-4, "correction/truncated_frac": 0.1},)
    s = TrainSummary("tis", "r1", 1, 1, 8, ((0, 0.3),), 9.0, "file://x", "sqlite://", once, steps)
    rec = _arm_record("tis", 0, s)
    assert rec["mismatch_curve"] == [2e-4] and rec["corrected_frac_curve"] == [pytest.approx(0.1)]
    with pytest.raises(KeyError, match="SUMMARY_KEYS"):
        _curve(s, "train/not_read_back", 0.0)
    assert {"train/policy_lag", "mismatch/abs_logp_mean", "correction/masked_frac"} <= set(SUMMARY_KEYS)


def test_band_is_mean_min_max_over_seeds_at_common_steps() -> None:
    xs, mean, lo, hi = _band([[(0, 0.1), (5, 0.5)], [(0, 0.3), (5, 0.7), (9, 1.0)]])
    assert xs == [0, 5] and mean == pytest.approx([0.2, 0.6]) and lo == [0.1, 0.5] and hi == [0.3, 0.7]


def test_plot_and_mlflow_run(tmp_path) -> None:
    rep = _report()
    (png,) = plot(rep, tmp_path / "learning.png")
    assert png.stat().st_size > 10_000
    # the engine/trainer mismatch gets a third panel once a run measured it
    from PIL import Image

    measured = {**rep, "runs": [{**r, "mismatch_curve": [2e-4, 3e-4]} for r in rep["runs"]]}
    (wide,) = plot(measured, tmp_path / "learning-mismatch.png")
    assert Image.open(wide).size[0] > 1.4 * Image.open(png).size[0]
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_id = log_to_mlflow(rep, [png], uri, "bench-test")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/learning.png"]
    hist = client.get_metric_history(run_id, "learning/sync/val_accuracy")
    assert [(m.step, round(m.value, 6)) for m in hist] == [(0, 0.3), (4, 0.51)]
