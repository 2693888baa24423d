"""rollpacker lab whatif: the grid, the recommendation, traces from MLflow lengths, the command."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rollpacker.cli import app
from rollpacker.core.errors import ConfigError, TraceError
from rollpacker.core.trace import TraceRecord
from rollpacker.lab.bench.whatif.report import render
from rollpacker.lab.bench.whatif.run import WhatIfConfig, cell_periods, recommend, whatif
from rollpacker.lab.bench.whatif.specfiles import HARDWARE_DIR, deployments
from rollpacker.lab.bench.whatif.traces import load, records_from_step_lengths, widen

PROFILE = Path(__file__).resolve().parents[3] / "data" / "profile_cpu_tiny.json"
SMALL = WhatIfConfig(p0=8, r0=4, max_tokens=128, periods=1, eta_ps=(1.0, 1.25), eta_rs=(1.0, 1.5))


def _report(
    hardware: str = f"cpu-profile:{PROFILE}", model: str | None = None, tp: int | None = None
) -> dict:
    return whatif(hardware, model, tp, None, SMALL, (None, "smoke", None, ""))


def test_the_grid_has_one_cell_per_setting_and_no_speculation_is_sync() -> None:
    rep = _report()
    deps = {d["name"] for d in rep["deployments"]}
    assert deps == {"tp1dp2", "tp2dp1"}
    cells = rep["grid"]
    assert len(cells) == len(deps) * 1 * 2 * 2
    assert {(c["deployment"], c["eta_p"], c["eta_r"]) for c in cells} == {
        (d, p, r) for d in deps for p in (1.0, 1.25) for r in (1.0, 1.5)
    }
    for c in cells:
        if c["eta_p"] == c["eta_r"] == 1.0:  # tail batching without speculation is the sync schedule
            assert c["speedup"] == pytest.approx(1.0, rel=1e-9)
            assert c["wasted_share"] == 0.0
    assert json.loads(json.dumps(rep))["whatif_version"] == 1


def test_every_policy_is_compared_on_every_deployment() -> None:
    rep = _report()
    for rows in rep["policies"].values():
        assert set(rows) == {"sync", "tail_batching", "sorted", "sorted_partial", "partial"}
        assert rows["sync"]["speedup"] == pytest.approx(1.0)
        assert rows["tail_batching"]["tokens_wasted"] > 0
        for r in rows.values():
            assert r["rollout_s_per_step"] > 0 and 0.0 <= r["bubble_ratio"] <= 1.0
            # both throughputs: every generated token (SortedRL's) and the trained ones (ours)
            assert r["output_tokens_per_s"] >= r["trained_tokens_per_s"] > 0
            assert r["s_per_trained_step"] == r["rollout_s_per_step"]
        on = rows["sorted"]  # it regenerates what it terminates: the two differ by what it wasted
        assert on["wasted_share"] > 0 and on["output_tokens_per_s"] > on["trained_tokens_per_s"]
    text = render(rep)
    assert text.count("out tok/s (all)") >= len(rep["policies"]) and "trained tok/s" in text
    assert max(len(line) for line in text.splitlines()) <= 120


def test_the_recommendation_is_the_best_cell_at_its_tp_and_p0() -> None:
    rep = _report()
    rec = rep["recommended"]
    same = [c for c in rep["grid"] if (c["tp"], c["p0"]) == (rec["tp"], rec["p0"])]
    assert any(all(c[k] == rec[k] for k in ("tp", "p0", "eta_p", "eta_r")) for c in same)
    assert rec["speedup"] == max(c["speedup"] for c in same)
    assert rec["tp"] == rep["tp_ranking"][0]["tp"]  # no --tp: the fastest TP
    mine = _report(tp=2)
    assert mine["recommended"]["tp"] == 2 and set(mine["policies"]) == {"tp2dp1"}


def test_recommend_ranks_tps_by_mean_seconds_and_picks_eta_by_speedup() -> None:
    def cell(tp: int, ep: float, s: float, speedup: float) -> dict:
        return {"tp": tp, "p0": 8, "eta_p": ep, "eta_r": 1.0, "rollout_s_per_step": s, "speedup": speedup}

    cells = [cell(1, 1.0, 4.0, 1.0), cell(1, 1.25, 3.0, 1.4), cell(2, 1.0, 2.0, 1.0), cell(2, 1.25, 1.9, 1.1)]
    rec = recommend(cells, SMALL, None)
    assert [r["tp"] for r in rec["tp_ranking"]] == [2, 1]
    assert (rec["recommended"]["tp"], rec["recommended"]["eta_p"]) == (2, 1.25)
    assert recommend(cells, SMALL, 1)["recommended"]["speedup"] == 1.4
    with pytest.raises(ConfigError, match="empty"):
        recommend([], SMALL, None)


def test_cells_without_prompt_speculation_cover_a_period_of_steps() -> None:
    assert cell_periods(SMALL, 8, 1.25) == SMALL.grid_periods
    # P0 = 8 at eta_p = 1.25 launches 10: 2 deferred a round, 4 short rounds + 1 long
    assert cell_periods(SMALL, 8, 1.0) == SMALL.grid_periods * 5


def test_a_roofline_deployment_set_respects_heads_memory_and_devices() -> None:
    names = [d.name for d in deployments("h800", "qwen2.5-7b", (), None)]
    assert names == ["tp1dp8", "tp2dp4", "tp4dp2"]  # 28 heads: no TP 8
    assert [d.name for d in deployments("a100", "qwen2.5-32b", (), 4)] == ["tp1dp4", "tp2dp2", "tp4dp1"]
    with pytest.raises(ConfigError, match="name the model too"):
        deployments("h800", None, (), None)
    with pytest.raises(ConfigError, match=r"no profiled layout has TP in \[4\]"):
        deployments(f"cpu-profile:{PROFILE}", None, (4,), None)
    with pytest.raises(ConfigError, match="no such profile file"):
        deployments("cpu-profile:/nope.json", None, (), None)


def test_a_trace_from_mlflow_step_lengths() -> None:
    docs = [{"step": 0, "lengths": [5, 6, 7, 8, 50, 60, 70, 80]}, {"step": 1, "lengths": [1, 2, 3, 4]}]
    recs = records_from_step_lengths(docs, 4)
    assert [r.response_lens for r in recs] == [(5, 6, 7, 8), (50, 60, 70, 80), (1, 2, 3, 4)]
    assert len({r.prompt_id for r in recs}) == 3
    wide = widen(recs, 5)
    assert wide[0].response_lens == (5, 6, 7, 8, 5)
    with pytest.raises(TraceError, match="step 0 logged 8 lengths, not a multiple of R0 = 3"):
        records_from_step_lengths(docs, 3)
    with pytest.raises(TraceError, match="no response lengths"):
        records_from_step_lengths([], 4)


def test_traces_from_presets_and_files(tmp_path: Path) -> None:
    recs, src = load(None, "paper-16k", 0)
    assert src == "preset:paper-16k" and max(max(r.response_lens) for r in recs) == 16384
    f = tmp_path / "t.jsonl"
    f.write_text("\n".join(TraceRecord(f"p{i}", 8, (3, 4, 5, 6, 7)).to_json() for i in range(40)))
    assert len(load(f, "ignored", 0)[0]) == 40
    with pytest.raises(TraceError, match=r"unknown preset 'nope'.*paper-8k"):
        load(None, "nope", 0)


def test_whatif_config_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError, match=r"whatif.concurrency = -1"):
        WhatIfConfig(concurrency=-1)
    with pytest.raises(ConfigError, match="speculation factor"):
        WhatIfConfig(eta_ps=(0.5,))
    assert WhatIfConfig(p0=16, r0=4, eta_r=1.25, eta_rs=(1.5,)).responses_needed == 6


def _invoke(*args: str) -> tuple[int, str, float]:
    t0 = time.perf_counter()
    res = CliRunner().invoke(app, ["lab", "whatif", *args])
    return res.exit_code, res.output, time.perf_counter() - t0


def test_the_command_writes_json_with_speedups_and_a_recommendation(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    code, text, _ = _invoke(
        "--preset", "smoke", "--hardware", f"cpu-profile:{PROFILE}", "--p0", "8", "--max-tokens", "128",
        "--grid-eta-p", "1.0,1.25", "--grid-eta-r", "1.25", "--out", str(out),
    )  # fmt: skip
    assert code == 0, text
    rep = json.loads(out.read_text())
    assert rep["simulated"] is True and {"eta_p", "eta_r"} <= set(rep["recommended"])
    assert all(
        r["speedup"] is not None for r in rep["policies"]["tp1dp2"].values() if r["speedup_note"] is None
    )
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "SIMULATED" in text and "recommended:" in text


@pytest.mark.parametrize(
    "args",
    [
        ("--preset", "paper-cpu", "--hardware", f"cpu-profile:{PROFILE}"),
        ("--hardware", "h800", "--model", "qwen2.5-7b", "--tp", "4"),
    ],
    ids=["cpu-profile", "h800-7b-tp4"],
)
def test_the_headline_commands_run_in_under_a_minute(args: tuple[str, ...], tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    code, text, seconds = _invoke(*args, "--out", str(out))
    assert code == 0, text
    assert seconds < 60
    rep = json.loads(out.read_text())
    assert rep["recommended"]["eta_p"] in (1.0, 1.25, 1.5)
    for rows in rep["policies"].values():
        assert rows["tail_batching"]["speedup"] > 1.0


def test_bad_specs_are_refused_by_name_on_the_command_line(tmp_path: Path) -> None:
    spec = yaml.safe_load((HARDWARE_DIR / "h800.yaml").read_text())
    spec["memory_bandwidth_gb_s"] = 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    code, text, _ = _invoke(
        "--hardware", str(bad), "--model", "qwen2.5-7b", "--out", str(tmp_path / "w.json")
    )
    assert code == 2 and "memory_bandwidth_gb_s" in text and str(bad) in text
    code, text, _ = _invoke("--hardware", "h800", "--model", "llama-9t", "--out", str(tmp_path / "w.json"))
    assert code == 2 and "unknown model 'llama-9t'" in text
