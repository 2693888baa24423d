"""Experiment-level MLflow tracking against a real MLflow store (SQLite in a temp dir).

One store per module (creating MLflow's tables takes seconds); every test uses its own experiment.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.tracking import (
    PLOT_FILES,
    TAG_ARM,
    TAG_POLICY,
    TAG_STATE,
    TAG_STEP,
    ExperimentTracker,
    compare,
    log_compare,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def uri(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{d}/mlflow.db"


def _exp(request) -> str:
    return request.node.name.replace("[", "-").replace("]", "")


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _fill_arm(tr: ExperimentTracker, arm: str, step_s: float, rollout_s: float, n: int = 4) -> str:
    """n steps of synthetic metrics: constant stage times, accuracy rising 0.2 -> 0.2 + 0.1 (n-1)."""
    rid = tr.arm_run(arm, {"rollout.policy": arm})
    for s in range(n):
        tr.log_step(
            rid,
            s,
            {
                "rollout/time_s": rollout_s,
                "reward/tail_s": 0.5,
                "train/time_s": 1.0,
                "weights/sync_s": 0.25,
                "pipeline/overhead_s": step_s - rollout_s - 1.75,
                "step/time_s": step_s,
                "rollout/bubble_ratio": 0.1 * (s + 1),
                "rollout/long_queue_size": float(s % 3),
                "val/accuracy": 0.2 + 0.1 * s,
                "reward/mean": 0.3 + 0.05 * s,
            },
        )
    return rid


# -- arm runs -------------------------------------------------------------------------------


def test_arm_run_is_get_or_create_across_tracker_instances(uri, request, monkeypatch) -> None:
    # MLflow would truncate long values itself (with a warning); make sure ours does it
    monkeypatch.setenv("MLFLOW_TRUNCATE_LONG_VALUES", "false")
    exp = _exp(request)
    params = {f"p{i:03d}": str(i) for i in range(250)} | {"rollout.policy": "sync", "long": "x" * 7000}
    a = ExperimentTracker(uri, exp).arm_run("sync", params)
    b = ExperimentTracker(uri, exp).arm_run("sync", {"rollout.policy": "other", "late": "1"})
    c = ExperimentTracker(uri, exp).arm_run("tail_batching", {"rollout.policy": "tail_batching"})
    assert a == b
    assert c != a
    run = ExperimentTracker(uri, exp).client.get_run(a)
    assert run.data.tags[TAG_ARM] == "sync"
    assert run.data.tags[TAG_POLICY] == "sync"
    # params only at creation: 252 of them (3 batches), the long value cut to MLflow's 6000
    assert len(run.data.params) == 252
    assert "late" not in run.data.params
    assert run.data.params["long"] == "x" * 6000
    assert run.data.params["p249"] == "249"
    # found, not created and thrown away: two runs ever, deleted ones included
    from mlflow.entities import ViewType

    client = ExperimentTracker(uri, exp).client
    ever = client.search_runs([run.info.experiment_id], run_view_type=ViewType.ALL)
    assert len(ever) == 2


def test_a_deleted_arm_run_is_replaced_by_a_new_one(uri, request) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    first = tr.arm_run("sync", {})
    tr.client.delete_run(first)
    second = tr.arm_run("sync", {})
    assert second != first
    assert tr.find_arm_run("sync") == second


def test_check_creates_the_experiment_with_artifacts_beside_the_db(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    assert tr.client.get_experiment_by_name(exp) is None
    exp_id = tr.check()
    got = tr.client.get_experiment(exp_id)
    assert got.name == exp
    db_dir = Path(uri[len("sqlite:///") :]).parent
    assert got.artifact_location == (db_dir.resolve() / "mlartifacts").as_uri()
    assert ExperimentTracker(uri, exp).check() == exp_id  # found, not created twice


def test_arm_names_that_would_break_the_filter_are_refused(uri, request) -> None:
    with pytest.raises(ConfigError, match="arm"):
        ExperimentTracker(uri, _exp(request)).arm_run("sync' OR 1=1", {})


# -- steps ----------------------------------------------------------------------------------


def test_log_step_values_and_steps_read_back(uri, request) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    rid = tr.arm_run("sync", {})
    for s in range(3):
        tr.log_step(rid, s, {"rollout/time_s": 10.0 + s, "reward/mean": 0.5 * s})
    time.sleep(0.01)
    tr.log_step(rid, 1, {"rollout/time_s": 99.0})  # step 1 re-run: the newest value counts
    other = ExperimentTracker(uri, _exp(request))  # a fresh process would do this
    assert other.metric_history(rid, "rollout/time_s") == [(0, 10.0), (1, 99.0), (2, 12.0)]
    assert other.metric_history(rid, "reward/mean") == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert other.metric_history(rid, "missing/key") == []


def test_state_pointer_tags(uri, request) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    rid = tr.arm_run("tail_batching", {})
    assert tr.state_pointer(rid) is None
    tr.set_state_pointer(rid, "s3://rp/exp/state/step-3.json", 3)
    tags = tr.client.get_run(rid).data.tags
    assert tags[TAG_STATE] == "s3://rp/exp/state/step-3.json"
    assert tags[TAG_STEP] == "3"
    tr.set_state_pointer(rid, "s3://rp/exp/state/step-4.json", 4)
    assert ExperimentTracker(uri, _exp(request)).state_pointer(rid) == ("s3://rp/exp/state/step-4.json", 4)


def test_step_lengths_are_json_artifacts_per_step(uri, request) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    rid = tr.arm_run("tail_batching", {})
    tr.log_step_lengths(rid, 12, "long", [900, 1000])
    tr.log_step_lengths(rid, 2, "short", [10, 20, 30])
    names = [f.path for f in tr.client.list_artifacts(rid, "lengths")]
    assert names == ["lengths/step-000002.json", "lengths/step-000012.json"]
    docs = tr.step_lengths(rid)
    assert docs == [
        {"step": 2, "round_kind": "short", "lengths": [10, 20, 30]},
        {"step": 12, "round_kind": "long", "lengths": [900, 1000]},
    ]


def test_finish_arm_logs_three_pngs_and_finishes_the_run(uri, request, tmp_path) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    rid = _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0, n=6)
    for s in range(6):
        kind = "long" if s == 5 else "short"
        tr.log_step_lengths(rid, s, kind, [20 + 7 * i + 50 * (kind == "long") for i in range(40)])
    assert tr.client.get_run(rid).info.status == "RUNNING"
    assert tr.finish_arm(rid) == list(PLOT_FILES)
    listed = sorted(f.path for f in tr.client.list_artifacts(rid, "plots"))
    assert listed == sorted(PLOT_FILES)
    local = Path(tr.client.download_artifacts(rid, "plots", str(tmp_path)))
    for name in PLOT_FILES:
        data = (local / Path(name).name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 10_000, (name, len(data))  # a real figure, not an empty canvas
    assert tr.client.get_run(rid).info.status == "FINISHED"


def test_finish_arm_without_data_still_writes_the_plots(uri, request) -> None:
    tr = ExperimentTracker(uri, _exp(request))
    rid = tr.arm_run("sync", {})
    tr.finish_arm(rid)
    assert sorted(f.path for f in tr.client.list_artifacts(rid, "plots")) == sorted(PLOT_FILES)


# -- compare --------------------------------------------------------------------------------


def test_compare_means_speedup_and_accuracies(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    tail = _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    time.sleep(0.01)
    tr.log_step(tail, 3, {"val/accuracy": 0.75})  # step 3 re-logged: newest value is final
    r = compare(uri, exp)
    assert [a.arm for a in r.arms] == ["sync", "tail_batching"]
    s, t = r.arm("sync"), r.arm("tail_batching")
    assert (s.steps, t.steps) == (4, 4)
    assert s.stage_mean_s["step/time_s"] == pytest.approx(10.0)
    assert t.stage_mean_s["step/time_s"] == pytest.approx(5.0)
    assert t.stage_mean_s["rollout/time_s"] == pytest.approx(2.0)
    assert t.stage_mean_s["pipeline/overhead_s"] == pytest.approx(1.25)
    assert t.speedup_step == pytest.approx(2.0)
    assert t.speedup_rollout == pytest.approx(4.0)
    assert s.speedup_step == pytest.approx(1.0)
    assert t.bubble_ratio_mean == pytest.approx(0.25)
    assert (s.val_accuracy_first, s.val_accuracy_final) == pytest.approx((0.2, 0.5))
    assert (t.val_accuracy_first, t.val_accuracy_final) == pytest.approx((0.2, 0.75))
    assert t.reward_mean_final == pytest.approx(0.45)
    assert r.notes == []
    shares = [ln for ln in r.render().splitlines() if "share of step" in ln]
    assert shares[0].split()[-1] == "40%"  # tail batching: 2.0 s of rollout in a 5.0 s step
    assert shares[1].split()[-1] == "25%"  # 1.25 s of overhead
    back = json.loads(r.to_json())
    assert back["arms"][1]["speedup_step"] == pytest.approx(2.0)


def test_compare_shows_the_off_policy_lag_of_each_arm(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    part = _fill_arm(tr, "partial", step_s=6.0, rollout_s=3.0)
    for step, lag in ((1, 0.5), (2, 1.0), (3, 1.5)):
        tr.log_step(part, step, {"train/policy_lag": lag, "train/off_policy_frac": lag / 2})
    r = compare(uri, exp)
    assert r.arm("partial").policy_lag_mean == pytest.approx(1.0)
    assert r.arm("partial").off_policy_frac_mean == pytest.approx(0.5)
    assert r.arm("sync").policy_lag_mean is None  # not logged: shown as "-", not as 0
    table = r.render()
    assert "train/policy_lag mean" in table and "1.000" in table


def test_compare_shows_both_throughputs_of_each_arm_side_by_side(uri, request) -> None:
    """Output tokens/s counts every generated token (SortedRL's), trained tokens/s the trained ones."""
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    srt = _fill_arm(tr, "sorted", step_s=6.0, rollout_s=4.0)
    for step in range(4):
        tr.log_step(
            srt,
            step,
            {
                "rollout/tokens_generated": 1000.0,
                "rollout/tokens_trained": 600.0,
                "rollout/tokens_wasted": 400.0,
            },
        )
    r = compare(uri, exp)
    s = r.arm("sorted")
    assert s.output_tokens_per_s == pytest.approx(250.0) and s.trained_tokens_per_s == pytest.approx(150.0)
    assert s.wasted_share == pytest.approx(0.4)
    assert r.arm("sync").output_tokens_per_s is None  # no token counts logged: "-", never 0
    table = r.render()
    assert "rollout output tokens/s (all)" in table and "rollout trained tokens/s" in table
    assert "250.0" in table and "150.0" in table and "40.0%" in table


def test_compare_shows_the_engine_trainer_mismatch_of_each_arm(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    tail = _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    for step, gap in ((1, 1e-3), (2, 3e-3)):
        tr.log_step(tail, step, {"mismatch/abs_logp_mean": gap, "correction/masked_frac": gap * 10})
    r = compare(uri, exp)
    t = r.arm("tail_batching")
    assert t.fidelity_mean["mismatch/abs_logp_mean"] == pytest.approx(2e-3)
    assert t.fidelity_mean["correction/masked_frac"] == pytest.approx(2e-2)
    assert r.arm("sync").fidelity_mean["mismatch/abs_logp_mean"] is None
    row = next(ln for ln in r.render().splitlines() if ln.startswith("mismatch/abs_logp_mean mean"))
    assert row.split()[-2:] == ["-", "2.00e-03"]


def test_compare_says_when_the_arms_ran_different_numbers_of_steps(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0, n=4)
    _fill_arm(tr, "partial", step_s=6.0, rollout_s=3.0, n=2)
    r = compare(uri, exp)
    assert (r.arm("sync").steps, r.arm("partial").steps) == (4, 2)
    note = (
        "the arms ran different numbers of steps (sync 4, partial 2): each mean is over the arm's own steps"
    )
    assert r.notes == [note]
    assert f"note: {note}" in r.render().splitlines()


def test_compare_without_the_baseline_arm_omits_speedups(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    r = compare(uri, exp, baseline="sync")
    (t,) = r.arms
    assert t.speedup_step is None and t.speedup_rollout is None
    assert t.stage_mean_s["step/time_s"] == pytest.approx(5.0)
    assert any("'sync'" in n and "baseline" in n for n in r.notes)
    assert "baseline" in r.render()


def test_train_arms_compare_against_the_one_arm_of_the_baseline_policy(uri, request) -> None:
    """`rollpacker train` names its arm <policy>-seed<seed>: the default baseline `sync` is the one
    arm that runs that policy."""
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    for arm, policy in (("sync-seed0", "sync"), ("tail_batching-seed0", "tail_batching")):
        tr.arm_run(arm, {"rollout.policy": policy})
    _fill_arm(tr, "sync-seed0", step_s=10.0, rollout_s=8.0)
    _fill_arm(tr, "tail_batching-seed0", step_s=5.0, rollout_s=2.0)
    r = compare(uri, exp)
    assert r.baseline == "sync-seed0" and r.notes == []
    assert r.arm("tail_batching-seed0").speedup_step == pytest.approx(2.0)
    tr.arm_run("sync-seed1", {"rollout.policy": "sync"})  # two sync arms: name one with --baseline
    assert compare(uri, exp).arm("tail_batching-seed0").speedup_step is None
    assert compare(uri, exp, baseline="sync-seed1").baseline == "sync-seed1"


def test_compare_without_arm_runs_says_what_to_run_and_logs_nothing(uri, request, tmp_path) -> None:
    from mlflow.entities import ViewType
    from typer.testing import CliRunner

    from rollpacker.cli import app
    from rollpacker.tracking import CompareReport

    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    exp_id = tr.check()
    tr.client.delete_run(tr.arm_run("sync", {}))  # an arm run started over with --fresh, say
    with pytest.raises(ConfigError, match=r"no arm runs.*rollpacker run --config.*rollpacker train"):
        compare(uri, exp)
    with pytest.raises(ConfigError, match="no arm runs"):
        log_compare(CompareReport(exp, uri, "sync", []), uri, exp)
    res = CliRunner().invoke(app, ["compare", exp, "--tracking-uri", uri])
    assert res.exit_code == 2 and "no arm runs" in res.output
    assert len(tr.client.search_runs([exp_id], run_view_type=ViewType.ALL)) == 1  # the deleted arm run


def test_render_is_an_aligned_table_with_both_arms(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    text = compare(uri, exp).render()
    lines = text.splitlines()
    table = lines[lines.index("") + 1 : lines.index("legend:") - 1]  # the title may wrap
    assert "sync" in table[0] and "tail_batching" in table[0]
    assert len({len(line) for line in table}) == 1  # every row as wide as the header
    row = next(line for line in table if line.startswith("speedup step/time_s"))
    assert row.split()[-2:] == ["1.00x", "2.00x"]
    assert "10.00" in next(line for line in table if line.startswith("step/time_s mean"))


def test_log_compare_writes_the_artifacts_to_one_compare_run(uri, request, tmp_path) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    report = compare(uri, exp)
    rid = log_compare(report, uri, exp)
    assert log_compare(report, uri, exp) == rid  # reused, not a second run
    run = tr.client.get_run(rid)
    assert run.data.tags["rollpacker.kind"] == "compare"
    assert run.info.run_name == "compare"
    assert sorted(f.path for f in tr.client.list_artifacts(rid)) == [
        "compare.json",
        "compare.md",
        "compare.png",
    ]
    local = Path(tr.client.download_artifacts(rid, "", str(tmp_path)))
    assert json.loads((local / "compare.json").read_text())["arms"][1]["arm"] == "tail_batching"
    md = (local / "compare.md").read_text()
    assert "| metric | sync | tail_batching |" in md and "| 1.00x | 2.00x |" in md
    png = (local / "compare.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 10_000
    # the compare run is not an arm: a second compare still sees two arms
    assert [a.arm for a in compare(uri, exp).arms] == ["sync", "tail_batching"]


# -- failures -------------------------------------------------------------------------------


def test_unreachable_tracking_uri_fails_fast_naming_it(request) -> None:
    bad = f"http://127.0.0.1:{_closed_port()}"
    keys = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
    before = {k: os.environ.get(k) for k in keys}
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"tracking_uri = 'http://127\.0\.0\.1:\d+'.*make up"):
        ExperimentTracker(bad, _exp(request)).check()
    with pytest.raises(ConfigError, match="no MLflow server answers"):
        compare(bad, _exp(request))
    assert time.monotonic() - t0 < 10.0  # MLflow's own defaults retry for minutes
    # the fail-fast settings apply to the check only: later calls keep MLflow's retries
    assert {k: os.environ.get(k) for k in keys} == before


def test_compare_on_an_unknown_experiment_names_it_and_lists_the_others(uri, request) -> None:
    ExperimentTracker(uri, "an-existing-one").check()
    with pytest.raises(ConfigError, match=r"'no-such-experiment' does not exist.*an-existing-one"):
        compare(uri, "no-such-experiment")


def test_a_deleted_experiment_is_a_config_error(uri, request) -> None:
    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    tr.client.delete_experiment(tr.check())
    with pytest.raises(ConfigError, match="deleted"):
        ExperimentTracker(uri, exp).check()
    with pytest.raises(ConfigError, match="deleted"):
        compare(uri, exp)


# -- CLI, imports -----------------------------------------------------------------------------


def test_cli_compare_prints_the_table_and_writes_json(uri, request, tmp_path) -> None:
    from typer.testing import CliRunner

    from rollpacker.cli import app

    exp = _exp(request)
    tr = ExperimentTracker(uri, exp)
    _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
    _fill_arm(tr, "tail_batching", step_s=5.0, rollout_s=2.0)
    out = tmp_path / "c.json"
    res = CliRunner().invoke(app, ["compare", exp, "--tracking-uri", uri, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "tail_batching" in res.output and "2.00x" in res.output
    assert json.loads(out.read_text())["baseline"] == "sync"
    res = CliRunner().invoke(app, ["compare", "nope", "--tracking-uri", uri])
    assert res.exit_code == 2
    assert "'nope' does not exist" in res.output


def test_importing_the_module_loads_neither_mlflow_nor_matplotlib() -> None:
    code = "import sys, rollpacker.tracking; print([m for m in ('mlflow', 'matplotlib') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- optional: a real MLflow server over HTTP -------------------------------------------------


@pytest.mark.slow
def test_over_a_real_mlflow_server(tmp_path) -> None:
    exe = Path(sys.executable).parent / "mlflow"
    if not exe.exists() and shutil.which("mlflow") is None:
        pytest.skip("no mlflow executable")
    port = _closed_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [str(exe) if exe.exists() else "mlflow", "server", "-w", "1", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--backend-store-uri", f"sqlite:///{tmp_path}/m.db"]
    cmd += ["--artifacts-destination", str(tmp_path / "art")]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    http = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ExperimentTracker(http, "probe").check()
                break
            except ConfigError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.5)
        tr = ExperimentTracker(http, "http-exp")
        rid = _fill_arm(tr, "sync", step_s=10.0, rollout_s=8.0)
        assert ExperimentTracker(http, "http-exp").arm_run("sync", {}) == rid
        tr.log_step_lengths(rid, 0, "standard", [5, 6, 7])
        tr.finish_arm(rid)
        assert sorted(f.path for f in tr.client.list_artifacts(rid, "plots")) == sorted(PLOT_FILES)
        # the server chose the artifact location (proxied artifacts under --artifacts-destination)
        assert list((tmp_path / "art").rglob("step_time.png"))
        assert compare(http, "http-exp").arm("sync").steps == 4
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
        log.close()
