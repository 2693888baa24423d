"""``rollpacker lab bench gpu``: the runner's deadlines and statuses, the predictor split, the calibration,
the judge's figures, and the tiny dry run end to end with the packages the GPU machine lacks blocked
(and, where a Python 3.12 is installed, the import closure and the runner under 3.12)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.costmodel import RooflineCost
from rollpacker.core.errors import RollpackerError
from rollpacker.core.latency import Layout, LayoutProfile, Predictor, ProfilePoint, ProfileTable
from rollpacker.lab.bench.gpu import runner
from rollpacker.lab.bench.gpu.analysis import split_points
from rollpacker.lab.bench.gpu.calibrate import calibrate, errors_by_batch, fit
from rollpacker.lab.bench.gpu.checks import judge_figures
from rollpacker.lab.bench.gpu.context import Context, Skip
from rollpacker.lab.bench.gpu.probe import matched_spec
from rollpacker.lab.bench.whatif.specfiles import deployments, load_hardware, load_model

SRC = Path(__file__).resolve().parents[3] / "src"
PHASES = ("probe", "profile", "policies", "predictor", "trainer", "megatron", "judge")
# what the bare GPU machine does not have (and this package's other pins): blocked in the dry runs
BLOCKED = ("vllm", "ray", "kfp", "mlflow", "boto3", "botocore", "minio", "typer", "click", "ray_client")
BLOCKER = f"import sys\nfor _n in {BLOCKED!r}:\n    sys.modules[_n] = None  # importing it fails\n"


def _fake_phases(monkeypatch: pytest.MonkeyPatch, fns: list[tuple[str, Any]]) -> None:
    monkeypatch.setattr(runner, "phases", lambda tiny=False: [(n, f, 1.0 / len(fns)) for n, f in fns])


def test_a_failed_skipped_or_overdue_phase_does_not_stop_the_next_and_the_json_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def boom(ctx: Context) -> dict[str, Any]:
        raise ValueError("kaput")

    def hang(ctx: Context) -> dict[str, Any]:
        time.sleep(30)
        return {}

    def no_megatron(ctx: Context) -> dict[str, Any]:
        import megatron_not_here  # type: ignore[import-not-found]  # noqa: F401

        return {}

    def last(ctx: Context) -> dict[str, Any]:
        seen.update(json.loads((tmp_path / "bench-gpu.json").read_text())["phases"])
        return {"x": 1, "why_skipped": ctx.results["b"]["why"]}

    def skip(ctx: Context) -> dict[str, Any]:
        raise Skip("no GPU here")

    fns = [("a", boom), ("b", skip), ("c", hang), ("d", last)]
    _fake_phases(monkeypatch, fns)
    doc = runner.run_bench(tmp_path, tiny=True, deadline_s=4.0)
    ph = doc["phases"]
    assert ph["a"]["status"] == "failed" and "ValueError: kaput" in ph["a"]["error"]
    assert ph["b"] == {**ph["b"], "status": "skipped", "why": "no GPU here"}
    assert ph["c"]["status"] == "failed" and "deadline" in ph["c"]["error"] and ph["c"]["seconds"] < 5
    assert ph["d"]["status"] == "ok" and ph["d"]["x"] == 1
    # the JSON on disk had every earlier phase when the last one ran (rewritten after each)
    assert [seen[n]["status"] for n in "abc"] == ["failed", "skipped", "failed"]
    assert seen["d"]["why"].startswith("not reached")
    assert json.loads((tmp_path / "bench-gpu.json").read_text())["phases"]["d"]["status"] == "ok"
    _fake_phases(monkeypatch, [("m", no_megatron)])
    got = runner.run_bench(tmp_path, tiny=True, deadline_s=4.0)["phases"]["m"]
    assert got["status"] == "failed"  # a package that is not optional is a bug, not a skip
    # the full run needs a GPU: no quiet fallback to the CPU (this machine has none)
    with pytest.raises(RollpackerError, match=r"no GPU visible to torch.*--tiny"):
        runner.run_bench(tmp_path, tiny=False, deadline_s=4.0)


def test_the_phase_budgets_fill_the_deadline_in_the_order_of_value() -> None:
    for tiny in (False, True):
        plan = runner.phases(tiny)
        assert [n for n, _, _ in plan] == list(PHASES)
        assert sum(share for *_, share in plan) == pytest.approx(1.0)


class _FakeTimer:
    """The measurement engine's edge: a step costs 1 us per request plus 1 ns per cached token."""

    window = 4

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def decode_s(self, batch: int, context: int) -> float:
        self.calls.append((batch, context))
        return 1e-6 * batch + 1e-9 * batch * context

    def prefill_s(self, rows: int, context: int) -> float:
        return 1e-5 * rows * context


def test_the_sweep_goes_context_by_context_skips_what_does_not_fit_and_stops_at_its_deadline(
    tmp_path: Path,
) -> None:
    from rollpacker.lab.bench.gpu.decode import sweep, tiny_model_spec

    spec = tiny_model_spec()  # 512 KV bytes per token: batch 8192 at 1024 tokens needs > 4 GiB
    ctx = Context(out=tmp_path, tiny=True, device="cpu", deadline_at=time.perf_counter() + 60)
    timer = _FakeTimer()
    points, notes = sweep(ctx, timer, spec, (1, 4, 8192), (16, 1024))  # type: ignore[arg-type]
    assert timer.calls == [(1, 16), (4, 16), (8192, 16), (1, 1024), (4, 1024)]
    assert [(p.batch, p.context) for p in points] == timer.calls
    assert notes == ["B=8192 L=1024: its KV (4.0 GiB) does not fit; not measured"]
    assert points[1].prefill_s == pytest.approx(4 * 1e-5 * 16)  # n rows measured, linear in between
    ctx.deadline_at = time.perf_counter() + 4  # less than the next point's guard (5 s + 3 steps)
    points, notes = sweep(ctx, _FakeTimer(), spec, (1, 4), (16, 64))  # type: ignore[arg-type]
    assert points == [] and notes == ["B=1 L=16 and after: not measured (the phase's deadline)"]


def _linear_points(batches: tuple[int, ...], contexts: tuple[int, ...]) -> tuple[ProfilePoint, ...]:
    return tuple(
        ProfilePoint(b, c, b * c, 1e-3 * b, 0.01 + 1e-4 * b + 2e-8 * b * c) for c in contexts for b in batches
    )


def test_the_predictor_phase_holds_out_interior_points_and_is_exact_on_linear_steps() -> None:
    pts = _linear_points((1, 2, 4, 8), (128, 256, 512, 1024, 2048))
    fit_pts, held, how = split_points(pts)
    assert {p.context for p in held} == {256, 1024} and "contexts" in how
    assert not set(fit_pts) & set(held) and len(fit_pts) + len(held) == len(pts)
    table = ProfileTable("m", "hw", 1, 1.0, (LayoutProfile(Layout(1, 1), tuple(fit_pts), 10**6),))
    pred = Predictor(table)
    assert max(abs(pred.decode_step_s(Layout(1, 1), p.batch, p.tokens) / p.decode_s - 1) for p in held) < 1e-9
    _, held2, how2 = split_points(_linear_points((1, 4, 16), (16, 64)))
    assert {p.batch for p in held2} == {4} and "batch" in how2


def test_calibration_recovers_the_efficiencies_of_a_known_roofline_and_whatif_reads_the_spec(
    tmp_path: Path,
) -> None:
    model = load_model("qwen2.5-7b")
    h100 = load_hardware("h100")
    truth = dataclasses.replace(
        h100, bandwidth_efficiency=0.6, compute_efficiency=0.35, step_overhead_s=0.012
    )
    cost = RooflineCost(truth, model, 1)
    pts = tuple(
        ProfilePoint(b, c, b * c, 0.0, cost.decode_s(b, b * c))
        for b in (1, 8, 64, 256)
        for c in (128, 1024, 4096)
    )
    got = fit(h100, model, pts)
    assert abs(got.bandwidth_efficiency / 0.6 - 1) < 0.08 and abs(got.step_overhead_s - 0.012) < 2e-3
    after = errors_by_batch(RooflineCost(got, model, 1), pts)
    before = errors_by_batch(RooflineCost(h100, model, 1), pts)
    assert max(after.values()) < 0.03 < max(before.values())
    # through the command: a bench JSON with that profile -> a spec file whatif accepts
    table = ProfileTable("qwen2.5-7b", "NVIDIA H100 80GB HBM3", model.kv_bytes_per_token, 1e11,
                         (LayoutProfile(Layout(1, 1), pts, 10**6),))  # fmt: skip
    ceil = {"copy_gb_s": 3000.0, "gemm_tflops": 700.0}
    doc = {
        "tiny": False,
        "phases": {
            "probe": {"status": "ok", "spec": "h100", "ceilings": ceil},
            "profile": {"status": "ok", "table": dataclasses.asdict(table)},
        },
    }
    (tmp_path / "bench-gpu.json").write_text(json.dumps(doc))
    report = calibrate(tmp_path / "bench-gpu.json", tmp_path / "spec")
    assert [r["batch"] for r in report["error_by_batch"]] == [1, 8, 64, 256]
    assert all(r["after"] <= r["before"] for r in report["error_by_batch"])
    dep = deployments(report["hardware_spec"], "qwen2.5-7b", (1,), 1)[0]
    assert dep.cost.label == "roofline qwen2.5-7b on 1 x h100-measured"
    assert "fitted to 12 decode points" in load_hardware(report["hardware_spec"]).sources["step_overhead_s"]


def test_the_judge_figures_and_the_spec_match() -> None:
    rep = {
        "config": {"num_layers": 8, "resident_layers": 2},
        "resident": {"time_s": 1.0, "max_abs_diff": 0.0, "peak_resident_weight_bytes": 800},
        "naive": {
            "time_s": 1.6,
            "max_abs_diff": 0.0,
            "layer_bytes": 10**8,
            "peak_resident_weight_bytes": 300,
        },
        "pipelined": {"time_s": 1.15, "max_abs_diff": 0.0, "peak_resident_weight_bytes": 400},
    }
    got = judge_figures(rep, 25.0)
    assert got["h2d_achieved_gb_s"] == pytest.approx(6e8 / 0.6 / 1e9)
    assert got["hidden_share"] == pytest.approx(0.75)
    rep["naive"]["time_s"] = 1.01  # the copies hide in the noise: nothing to divide by
    assert judge_figures(rep, 25.0)["h2d_achieved_gb_s"] is None
    rep["pipelined"]["max_abs_diff"] = 1e-3
    with pytest.raises(AssertionError, match="differ from the resident"):
        judge_figures(rep, 25.0)
    assert matched_spec("NVIDIA H100 80GB HBM3") == "h100"
    assert matched_spec("NVIDIA H200") == "h200" and matched_spec("Tesla T4") is None


def _blocked_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    return {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{SRC}", "OMP_NUM_THREADS": "1"}


@pytest.mark.slow
@pytest.mark.alone  # its phases time a probe against the machine's speed
def test_the_tiny_dry_run_passes_every_phase_without_the_packages_the_gpu_machine_lacks(
    tmp_path: Path,
) -> None:
    """``python -m rollpacker.lab.bench.gpu --tiny`` with vLLM, Ray, kfp, MLflow, boto3, minio and typer
    unimportable: every phase ok, the profile read by the predictor and whatif, the calibrated spec
    read by whatif."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rollpacker.lab.bench.gpu", "--tiny", "--out", str(out)]
    proc = subprocess.run(cmd, env=_blocked_env(tmp_path), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((out / "bench-gpu.json").read_text())
    assert list(doc["phases"]) == list(PHASES)
    bad = {n: s.get("error") or s.get("why") for n, s in doc["phases"].items() if s["status"] != "ok"}
    assert not bad, bad
    table = ProfileTable.from_dict(json.loads((out / "profile.json").read_text())["table"], "profile.json")
    assert len(table.layouts[0].points) == doc["phases"]["profile"]["points"] >= 6
    assert deployments(f"cpu-profile:{out / 'profile.json'}", None, (1,), None)[0].cost.tp == 1
    assert set(doc["phases"]["policies"]["policies"]) == {"sync", "tail_batching", "sorted", "sorted_partial",
                                                          "partial"}  # fmt: skip
    assert doc["phases"]["trainer"]["bf16"]["grad_rel_error"] <= doc["phases"]["trainer"]["bf16_tolerance"]
    assert doc["phases"]["judge"]["max_abs_diff"] <= 1e-5
    report = calibrate(out / "bench-gpu.json", tmp_path / "spec")
    dep = deployments(report["hardware_spec"], report["model"], (1,), 1)[0]
    assert dep.cost.decode_s(4, 256) > 0


def _python312() -> str | None:
    return (shutil.which("python3.12") and _works("python3.12")) or next(
        (str(p) for p in Path("/root/.pyenv/versions").glob("3.12*/bin/python3.12") if _works(str(p))),
        None,
    )


def _works(exe: str) -> str | None:
    try:
        ok = subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"], timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return exe if ok.returncode == 0 else None


def test_the_bench_imports_and_runs_under_python_3_12(tmp_path: Path) -> None:
    """A bare Python 3.12 (no torch here: the phases say so and are skipped) imports every module of
    the bench and runs the runner to its JSON; the tiny dry run above runs the phases themselves."""
    exe = _python312()
    if exe is None:
        pytest.skip("no Python 3.12 interpreter on this machine")
    mods = sorted(
        p.stem for p in (SRC / "rollpacker" / "lab" / "bench" / "gpu").glob("*.py") if p.stem != "__main__"
    )
    code = f"import importlib\nfor m in {mods!r}: importlib.import_module('rollpacker.lab.bench.gpu.' + m)"
    env = _blocked_env(tmp_path)
    subprocess.run([exe, "-c", code], env=env, check=True, timeout=60)
    out = tmp_path / "out"
    proc = subprocess.run([exe, "-m", "rollpacker.lab.bench.gpu", "--tiny", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((out / "bench-gpu.json").read_text())
    assert list(doc["phases"]) == list(PHASES)
    for name, s in doc["phases"].items():
        assert s["status"] in ("ok", "skipped"), (name, s)
        if s["status"] == "skipped":
            assert "not installed" in s["why"] or "needs the" in s["why"], (name, s)
