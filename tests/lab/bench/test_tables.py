"""Every benchmark's printed table fits in 120 columns and has a legend, on representative reports
(the shapes the benchmarks write, with long lists and names where a table could overflow)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rollpacker.lab.bench import learning, overhead, reward, reward_tail, scaledown
from rollpacker.lab.bench.tables import MAX_COLUMNS, clip, legend, wrap
from rollpacker.lab.profiling import render_profile
from rollpacker.tracking import ArmSummary, CompareReport

PROFILE = Path(__file__).parents[2] / "data" / "profile_cpu_tiny.json"
ARMS = ("sync", "tail_batching", "sorted", "sorted_partial", "partial", "tail_batching_one_off")


def _reward() -> dict:
    mode = {"per_epoch_s": [128.04, 127.95] * 6, "misjudged_correct": [], "reward_stage_s": 3072.0}
    return {
        "workload": {
            "problems": 128,
            "responses_per_problem": 16,
            "epochs": 12,
            "kinds": {"correct": 1433, "wrong": 410, "doomed": 205},
            "workers": 16,
        },
        "modes": {"fixed": {**mode, "timeouts": 2460}, "adaptive": {**mode, "timeouts": 2460}},
        "verdicts_differ": [],
        "speedup": 7.35,
        "no_correct_misjudged": True,
    }


def _reward_tail() -> dict:
    arm = {
        "tail_s": [0.123] * 20,
        "tail_s_total": 2.46,
        "sync_stage_s": [12.3] * 20,
        "sync_stage_s_total": 246.0,
        "cut": 80,
        "correct_cut": None,
        "reference_runs": 160.0,
    }
    return {
        "config": {"steps": 20},
        "workload": {
            "task": "synthetic_code",
            "prompts_per_step": 16,
            "responses_per_prompt": 8,
            "kinds": {"correct": 1600, "slow": 130, "wrong": 470, "doomed": 360},
            "sandbox": {"workers": 2, "lam": 1.5, "t_min_s": 2.0, "t_max_s": 30.0},
        },
        "arms": {"no_reference": arm, "reference": {**arm, "correct_cut": 3}},
    }


def _scaledown() -> dict:
    def step(arm: str, i: int) -> dict:
        on = arm == "on"
        return {
            "repeat": 1,
            "step": i,
            "step/time_s": 123.45,
            "rollout/time_s": 98.76,
            "stage/train_s": 54.32,
            "train/time_s": 12.34,
            "train/overlap_s": 43.21,
            "train/devices": 0.74 if on else 0.0,
            "train/repurposed_s": 33.3 if on else 0.0,
            **({"rollout/scaled_down_at": 0.25} if on else {}),
        }

    effect = {"off": 15.5, "on": 14.9, "on_minus_off": -0.6, "off_over_on": 1.04}
    paired = {"mean_on_minus_off": -0.41, "sd": 0.59, "on_faster_steps": 19, "steps": 24}
    return {
        "arms": {arm: {"per_step": [step(arm, i) for i in range(12)]} for arm in ("off", "on")},
        "paired": {"step/time_s": paired, "train/time_s": paired},
        "effect": {"step/time_s": effect, "rollout/time_s": effect},
    }


def _learning() -> dict:
    runs = [
        {
            "arm": arm,
            "seed": seed,
            "val_accuracy_start": 0.217,
            "val_accuracy_end": 0.233 + 0.01 * seed,
            "wall_s": 1234.5,
            "rollout_s": 456.7,
            "trained_samples": 51200,
            "exactly_once": {"ok": True, "prompts_trained": 12800, "waiting": 16},
        }
        for arm in learning.ARMS
        for seed in (0, 1, 2)
    ]
    per_arm = {arm: learning._aggregate([r for r in runs if r["arm"] == arm]) for arm in learning.ARMS}
    return {
        "runs": runs,
        "per_arm": per_arm,
        "seeds": [0, 1, 2],
        "minus_sync_points": {arm: -1.6 for arm in learning.ARMS},
        "criteria": learning.criteria(per_arm),
    }


def _overhead() -> dict:
    keys = ("python", "kfp_task", "import_edge", "import_mlflow", "ray_connect", "ray_exit_implicit")
    keys += ("ray_exit_explicit", "ray_shutdown_call", "per_task_floor", "step_floor_sequential")
    return {"repeats": 5, "tasks": 6, **dict.fromkeys(keys, 1.234)}


def _profile() -> str:
    table = json.loads(PROFILE.read_text())
    error = {"window_mape": 0.123, "steps": 1234, "total_error": 0.045}
    validation = {lay: error for lay in ("tp1dp2", "tp2dp1")}
    return render_profile(
        {"table": table, "validation": validation, "seconds": 39, "total_seconds": 101}, "p"
    )


def _compare() -> str:
    arms = [
        ArmSummary(
            arm=arm,
            run_id="0123456789abcdef",
            policy=arm,
            steps=8,
            stage_mean_s={"rollout/time_s": 2.48, "step/time_s": 15.48},
            bubble_ratio_mean=0.799,
            speedup_step=1.0,
            speedup_rollout=1.0,
            val_accuracy_first=0.217,
            val_accuracy_final=0.233,
            reward_mean_final=0.45,
            policy_lag_mean=0.956,
            off_policy_frac_mean=0.607,
        )
        for arm in ARMS
    ]
    uri = "http://mlflow.rollpacker.svc.cluster.local:5000/some/long/path/to/the/tracking/server"
    note = "arm 'sync' has 2 live runs; using the oldest, 0123456789abcdef0123456789abcdef"
    return CompareReport("policies-" + "x" * 40, uri, "sync", arms, [note]).render()


RENDERED: dict[str, Callable[[], str]] = {
    "reward": lambda: reward.render(_reward()),
    "reward_tail": lambda: reward_tail.render(_reward_tail()),
    "scaledown": lambda: scaledown.render(_scaledown()),
    "learning": lambda: learning.render(_learning()),
    "overhead": lambda: overhead.render(_overhead()),
    "profile": _profile,
    "compare": _compare,
}


@pytest.mark.parametrize("name", sorted(RENDERED))
def test_every_renderer_fits_in_120_columns_with_a_legend(name: str) -> None:
    lines = RENDERED[name]().splitlines()
    too_long = [line for line in lines if len(line) > MAX_COLUMNS]
    assert too_long == [], name
    assert "legend:" in [line.strip() for line in lines], name
    entries = lines[[line.strip() for line in lines].index("legend:") + 1 :]
    assert entries and entries[0].startswith("  ") and len(entries[0].split()) > 2, name


def test_the_compare_table_splits_its_arms_into_blocks_that_fit() -> None:
    lines = _compare().splitlines()
    headers = [line for line in lines if line.startswith(" ") and line.split()[0] in ARMS]
    assert len(headers) == 2  # six arms do not fit beside the row names in one block
    assert [arm for h in headers for arm in h.split()] == list(ARMS)


def test_wrap_and_legend_keep_every_line_within_the_width() -> None:
    long = "word " * 100 + "x" * 300
    assert all(len(line) <= MAX_COLUMNS for line in wrap(long, indent="    "))
    lines = legend((("term", long), ("a longer term", "short")), indent="  ")
    assert lines[0] == "  legend:" and all(len(line) <= MAX_COLUMNS for line in lines)
    assert lines[1].startswith("    term           word") and lines[-1] == "    a longer term  short"
    assert clip("tp1dp2 x1, tp2dp1 x1", 12) == "tp1dp2 x1..." and clip("short", 12) == "short"
