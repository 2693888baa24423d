"""The planner benchmark's simulated part on a recorded CPU profile: every mode runs the real
policy, driver and switching engine on predictor-timed replicas."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from rollpacker.core.config import RolloutConfig
from rollpacker.core.latency import Layout, ProfileTable
from rollpacker.core.trace import PRESETS, generate
from rollpacker.lab.bench.planner import PlannerBenchConfig, kv_capacity, render, run_planner_bench

RECORDED = Path(__file__).parents[2] / "data" / "profile_cpu_tiny.json"


@pytest.fixture(scope="module")
def report():
    table = ProfileTable.from_json(RECORDED.read_text())
    records = generate(PRESETS["paper-cpu"], seed=0)
    cfg = PlannerBenchConfig(
        rollout=RolloutConfig(prompts_per_step=8, responses_per_prompt=4, max_tokens=512),
        steps=6,
        real_steps=0,
        constrained_kv_tokens=1500,
    )
    return run_planner_bench(table, records, cfg, "preset:paper-cpu")


def test_kv_capacity_grows_with_tp_when_weights_share_memory() -> None:
    assert kv_capacity(Layout(1, 2), 1000, 0.5) == 1000
    # TP 2: weights take a quarter of each device, so 1.5x the KV per device, over 2 devices
    assert kv_capacity(Layout(2, 1), 1000, 0.5) == 3000
    assert kv_capacity(Layout(2, 1), 1000, 0.0) == 2000


def test_every_mode_runs_every_step(report) -> None:
    for part in report["simulated"].values():
        modes = {m["mode"]: m for m in part["modes"]}
        assert set(modes) == {
            "fixed (tp1dp2)",
            "fixed (tp2dp1)",
            "per-step",
            "switching",
            "per-step+switching",
        }
        for m in modes.values():
            assert len(m["per_step_s"]) == 6 and all(t > 0 for t in m["per_step_s"])
            assert m["rollout_time_s"] == pytest.approx(sum(m["per_step_s"]))
        fixed = [m["rollout_time_s"] for name, m in modes.items() if name.startswith("fixed")]
        assert max(m["vs_best_fixed"] for name, m in modes.items() if name.startswith("fixed")) == 1.0
        assert min(fixed) > 0
        # fixed modes never leave their layout; the switching engine records what it did
        assert set(modes["fixed (tp1dp2)"]["layouts"]) == {"tp1dp2"}
        assert modes["fixed (tp1dp2)"]["switches"] == 0


def test_constrained_memory_preempts_on_tp1_and_the_planner_reacts(report) -> None:
    modes = {m["mode"]: m for m in report["simulated"]["constrained_kv"]["modes"]}
    tp1 = modes["fixed (tp1dp2)"]
    assert sum(tp1["preemptions"]) > 0
    assert sum(modes["fixed (tp2dp1)"]["preemptions"]) < sum(tp1["preemptions"])
    per_step = modes["per-step"]
    # the heuristic replayed on what the steps saw: TP doubles after a rise in preemptions of the
    # same round kind, halves after four calm steps
    from rollpacker.core import planner

    cfg = planner.PlannerConfig(initial_tp=int(per_step["layouts"][0][2]), max_tp=2)
    state = planner.initial(cfg)
    for kind, pre, lay in zip(
        per_step["round_kinds"], per_step["preemptions"], per_step["layouts"], strict=True
    ):
        k = kind if kind in planner.KINDS else "short"
        assert lay == f"tp{state.tp_for(k)}dp{2 // state.tp_for(k)}"
        state = planner.observe(cfg, state, k, pre)


def test_the_report_renders_the_predictor_view(report) -> None:
    text = render(report)
    assert "constrained_kv" in text and "PREDICTED by the latency predictor" in text
    rows = report["predictor_view"]
    assert [r["requests"] for r in rows] == [128, 32, 8, 2, 1]
    assert all(r["remaining_s_tp1dp2"] > 0 and r["remaining_s_tp2dp1"] > 0 for r in rows)


def test_the_printed_report_says_simulated_or_measured_and_fits_in_120_columns(report) -> None:
    # a real part shaped like the simulated ones, one mode switching every step (a long layouts cell)
    real = copy.deepcopy(report["simulated"]["measured_kv"])
    real["modes"][3]["layouts"] = ["tp1dp2", "tp2dp1"] * 12
    lines = render({**report, "real": real}).splitlines()
    assert max(len(line) for line in lines) <= 120
    titles = [line for line in lines if line.startswith(("SIMULATED", "MEASURED"))]
    assert len(titles) == 3
    assert all("latency predictor" in t for t in titles[:2]) and titles[2].startswith("MEASURED on")
    assert "constrained_kv" in titles[1] and "PREDICTED by the latency predictor" in "\n".join(lines)
    assert [line.strip() for line in lines].count("legend:") == 2
    legend = lines[lines.index("legend:") + 1 :]
    for term in ("mode", "rollout s", "vs best fixed", "preempted", "switches", "layouts"):
        assert any(line.split("  ")[1:2] == [term] for line in legend), term
    assert any(line.endswith("tp1dp2 x6") for line in lines)  # runs of one layout written once
