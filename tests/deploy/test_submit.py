"""`rollpacker submit` against a fake KFP API server on a real loopback socket: the requests kfp.Client
sends (the compiled pipeline uploaded, the experiment, one run per arm with its parameters and
service account), a second submit uploading a new version, and clear errors for bad input."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from rollpacker.cli import app
from rollpacker.core.errors import ConfigError
from rollpacker.submit import SubmitError, check_host, submit
from tests.deploy.fake_kfp import API, FakeKFP
from tests.pipelines.spec import parse_strict

CONFIG = """experiment: deploy-test
steps: 2
arms: [sync, tail_batching]
store:
  endpoint: minio:9000
"""


@pytest.fixture
def kfp_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[FakeKFP, str]]:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # kfp.Client reads ~/.config/kfp/context.json
    for var in ("KF_PIPELINES_ENDPOINT", "KF_PIPELINES_UI_ENDPOINT", "KFP_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    fake = FakeKFP()
    server, url = fake.serve()
    try:
        yield fake, url
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(CONFIG)
    return path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_submit_uploads_the_compiled_pipeline_and_starts_one_run_per_arm(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path
) -> None:
    fake, url = kfp_server
    sub = submit(url + "/", config, steps=2, out_dir=tmp_path / "build", log=lambda s: None, poll_s=0.01)
    calls = [(r.method, r.path) for r in fake.requests]
    first = sub.runs[0].run_id
    assert calls == [
        ("GET", f"{API}/healthz"),  # our probe
        ("GET", f"{API}/healthz"),  # kfp.Client's
        ("GET", f"{API}/pipelines"),
        ("POST", f"{API}/pipelines/upload"),
        ("GET", f"{API}/pipelines/{sub.pipeline_id}/versions"),
        ("GET", f"{API}/experiments"),
        ("POST", f"{API}/experiments"),
        ("POST", f"{API}/runs"),
        # services.arms: sequential (the default): the second arm starts when the first succeeded
        ("GET", f"{API}/runs/{first}"),  # RUNNING
        ("GET", f"{API}/runs/{first}"),  # SUCCEEDED
        ("POST", f"{API}/runs"),
    ]
    # the upload is the compiled rl_experiment of 2 steps, strictly valid, with its platform config
    upload = fake.requests[3]
    assert upload.query["name"] == ["rollpacker-rl-experiment"]
    filename, content = upload.upload()
    assert filename == "rl_experiment.yaml"
    assert content == (tmp_path / "build" / "rl_experiment.yaml").read_bytes() == sub.package.read_bytes()
    spec, platform = parse_strict(list(yaml.safe_load_all(content)))
    assert spec.pipeline_info.name == "rl-experiment" and len(spec.root.dag.tasks) == 1 + 2
    assert platform is not None
    # the experiment is the config's
    assert fake.requests[6].json()["display_name"] == "deploy-test"
    # one run per arm: the uploaded version, the config text and the arm, the service account
    runs = [r.json() for r in fake.requests[7:] if r.method == "POST"]
    assert [r["runtime_config"]["parameters"]["arm"] for r in runs] == ["sync", "tail_batching"]
    for r in runs:
        assert r["runtime_config"]["parameters"]["config"] == CONFIG
        assert r["experiment_id"] == sub.experiment_id
        assert r["pipeline_version_reference"] == {
            "pipeline_id": sub.pipeline_id,
            "pipeline_version_id": sub.version_id,
        }
        assert r["service_account"] == "rollpacker-pipeline"
        assert r["display_name"].startswith(f"deploy-test-{r['runtime_config']['parameters']['arm']}-")
    assert [(r.arm, r.url) for r in sub.runs] == [
        (arm, f"{url}/#/runs/details/{rid}")
        for arm, rid in zip(["sync", "tail_batching"], fake.runs, strict=True)
    ]


def test_a_second_submit_adds_a_version_and_reuses_the_experiment(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path
) -> None:
    fake, url = kfp_server
    first = submit(url, config, steps=1, out_dir=tmp_path, arms=["sync"], log=lambda s: None)
    n = len(fake.requests)
    second = submit(
        url,
        config,
        steps=1,
        out_dir=tmp_path,
        arms=["tail_batching"],
        overrides={"rollout.max_tokens": 512},
        experiment="other-exp",
        service_account="",
        namespace="team-a",
        token="t0ken",
        log=lambda s: None,
    )
    calls = [(r.method, r.path) for r in fake.requests[n:]]
    assert ("POST", f"{API}/pipelines/upload_version") in calls
    assert ("POST", f"{API}/pipelines/upload") not in calls
    assert second.pipeline_id == first.pipeline_id and second.version_id != first.version_id
    assert second.experiment_id != first.experiment_id  # "other-exp" is new
    exp = next(r for r in fake.requests[n:] if r.path == f"{API}/experiments" and r.method == "POST").json()
    assert exp == {"display_name": "other-exp", "namespace": "team-a"}
    run = fake.requests[-1].json()
    assert yaml.safe_load(run["runtime_config"]["parameters"]["config"])["rollout"] == {"max_tokens": 512}
    assert "service_account" not in run or not run["service_account"]
    auth = [{k.lower(): v for k, v in r.headers.items()}.get("authorization") for r in fake.requests[n:]]
    assert auth == ["Bearer t0ken"] * len(auth), auth
    third = submit(
        url, config, steps=1, out_dir=tmp_path, arms=["sync"], experiment="other-exp", log=lambda s: None
    )
    assert third.experiment_id == second.experiment_id


@pytest.mark.parametrize(
    ("host", "match"),
    [
        ("localhost:8888", "use the KFP API's URL with its scheme"),
        ("ftp://localhost:21", "use the KFP API's URL with its scheme"),
        ("http://", "use the KFP API's URL with its scheme"),
        ("http://localhost:99999", "(?i)port"),
    ],
)
def test_bad_urls_are_refused_before_anything_else(host: str, match: str) -> None:
    with pytest.raises(SubmitError, match=match):
        check_host(host)


def test_unreachable_host_fails_fast_with_a_clear_error(config: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(SubmitError, match=r"nothing answers at 127\.0\.0\.1:\d+ .*port-forward"):
        submit(f"http://127.0.0.1:{_closed_port()}", config, out_dir=tmp_path, log=lambda s: None)
    assert time.monotonic() - t0 < 5
    assert not (tmp_path / "rl_experiment.yaml").exists()  # nothing compiled for nothing


def test_server_errors_are_reported_with_the_servers_answer(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path
) -> None:
    fake, url = kfp_server
    fake.fail["/pipelines/upload"] = (500, "disk full")
    with pytest.raises(SubmitError, match=r"failed \(500\).*disk full"):
        submit(url, config, steps=1, arms=["sync"], out_dir=tmp_path, log=lambda s: None)
    assert not fake.runs
    fake.fail = {"/healthz": (404, "not found")}
    t0 = time.monotonic()
    with pytest.raises(SubmitError, match="is not the KFP API"):
        submit(url, config, steps=1, arms=["sync"], out_dir=tmp_path, log=lambda s: None)
    fake.fail = {"/healthz": (401, "login first")}
    with pytest.raises(SubmitError, match=r"\(401\).*login first.*KFP_TOKEN"):
        submit(url, config, steps=1, arms=["sync"], out_dir=tmp_path, log=lambda s: None)
    assert time.monotonic() - t0 < 5  # no retry loop


def test_bad_config_and_arms_are_refused(
    kfp_server: tuple[FakeKFP, str], tmp_path: Path, config: Path
) -> None:
    fake, url = kfp_server
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ConfigError, match="stepz"):
        submit(url, bad, out_dir=tmp_path, log=lambda s: None)
    with pytest.raises(SubmitError, match=r"--arm \['sorted'\]"):
        submit(url, config, arms=["sorted"], out_dir=tmp_path, log=lambda s: None)
    with pytest.raises(ConfigError, match=r"rollout\.max_tokens"):
        submit(url, config, overrides={"rollout.max_tokens": -1}, out_dir=tmp_path, log=lambda s: None)
    assert fake.requests == []


def test_a_training_plan_that_cannot_fit_is_refused_before_anything_is_sent(
    kfp_server: tuple[FakeKFP, str], tmp_path: Path
) -> None:
    import json

    from rollpacker.core.config import load_config
    from rollpacker.submit import memory_preflight

    fake, url = kfp_server
    model = tmp_path / "Qwen2.5-7B"
    model.mkdir()
    shape = dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4)
    shape.update(intermediate_size=18944, vocab_size=152064)
    (model / "config.json").write_text(json.dumps(shape))
    train = {"backend": "megatron", "tokens_per_micro_batch": 9216}
    train["megatron"] = {"tp": 2, "world_size": 8, "gpus_per_rank": 1}
    extra = {"model": {"model_dir": str(model)}, "engine": {"max_model_len": 9216}, "train": train}
    cfg = tmp_path / "gpu.yaml"
    cfg.write_text(CONFIG + yaml.safe_dump(extra))
    with pytest.raises(ConfigError, match=r"needs 260\.4 GiB .*more than gpu_memory_gib = 80"):
        submit(url, cfg, out_dir=tmp_path, log=lambda s: None)
    assert fake.requests == []
    lines: list[str] = []
    fits = {
        "train.megatron.recompute": "full",
        "train.megatron.dtype": "bfloat16",
        "engine.dtype": "bfloat16",
    }
    memory_preflight(load_config(cfg, fits), lines.append)
    assert lines == [
        "memory preflight: 66.9 GiB on pipeline stage 0 (weights 7.1, grads 14.2, optimizer 10.6, "
        "activations 7.3, transient 23.7, reserve 4.0 GiB) per training GPU, within gpu_memory_gib = 80"
    ]


def test_cli_submit(kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path) -> None:
    fake, url = kfp_server
    runner = CliRunner()
    args = ["submit", "--host", url, "--config", str(config), "--steps", "1", "--out", str(tmp_path)]
    res = runner.invoke(app, [*args, "--experiment", "cli-exp", "--arm", "sync", "--set", "seed=3"])
    assert res.exit_code == 0, res.output
    assert "compiled" in res.output and f"{url}/#/runs/details/" in res.output
    (run,) = fake.runs.values()
    assert yaml.safe_load(run["runtime_config"]["parameters"]["config"])["seed"] == 3
    res = runner.invoke(app, ["submit", "--host", "localhost:8888", "--config", str(config)])
    assert res.exit_code == 2 and "use the KFP API's URL" in res.output
    res = runner.invoke(app, ["submit", "--config", str(config)])
    assert res.exit_code != 0 and "--host" in res.output


def test_a_refused_submit_leaves_no_output_directory(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, url = kfp_server
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # the default --out is build/ here
    runner = CliRunner()
    closed = f"http://127.0.0.1:{_closed_port()}"
    refused = [
        (["--host", closed, "--config", str(config)], "nothing answers"),  # the KFP API's check
        (["--host", url, "--config", str(config), "--set", "rollout.max_tokens=-1"], "rollout.max_tokens"),
        (["--host", url, "--config", str(config), "--arm", "sorted"], "--arm"),
        (["--host", url, "--config", str(config), "--arm", "sorted", "--out", "out/deep"], "--arm"),
    ]
    for args, said in refused:
        res = runner.invoke(app, ["submit", *args])
        assert res.exit_code == 2 and said in res.output, (args, res.output)
        assert list(work.iterdir()) == [], (args, list(work.rglob("*")))
    (work / "afile").write_text("x")
    res = runner.invoke(app, ["submit", "--host", url, "--config", str(config), "--out", "afile/sub"])
    assert res.exit_code == 2 and "--out" in res.output and "is a file" in res.output, res.output
    assert fake.requests == [] and [p.name for p in work.iterdir()] == ["afile"]
    res = runner.invoke(
        app, ["submit", "--host", url, "--config", str(config), "--steps", "1", "--arm", "sync"]
    )
    assert res.exit_code == 0, res.output
    assert (work / "build" / "rl_experiment.yaml").is_file()  # made once every check passed


def test_disjoint_arms_start_at_once(kfp_server: tuple[FakeKFP, str], tmp_path: Path) -> None:
    fake, url = kfp_server
    path = tmp_path / "disjoint.yaml"
    path.write_text(CONFIG + "services:\n  arms: disjoint\n")
    sub = submit(url, path, steps=1, out_dir=tmp_path, log=lambda s: None, poll_s=0.01)
    calls = [(r.method, r.path) for r in fake.requests]
    assert calls[-2:] == [("POST", f"{API}/runs"), ("POST", f"{API}/runs")]
    assert not [c for c in calls if c[1].startswith(f"{API}/runs/")]  # nobody waits
    assert [r.arm for r in sub.runs] == ["sync", "tail_batching"]


def test_a_failed_run_stops_the_sequence_naming_what_to_submit_next(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path
) -> None:
    fake, url = kfp_server
    fake.run_states = ("PENDING", "RUNNING", "FAILED")
    with pytest.raises(SubmitError) as e:
        submit(url, config, out_dir=tmp_path, log=lambda s: None, poll_s=0.01)
    (rid,) = fake.runs
    assert f"arm sync's run {rid} ended FAILED" in str(e.value)
    assert "tail_batching were not started" in str(e.value) and "--arm tail_batching" in str(e.value)
    assert len(fake.runs) == 1


def test_sequential_arms_shorter_than_the_experiment_are_refused(
    kfp_server: tuple[FakeKFP, str], config: Path, tmp_path: Path
) -> None:
    """The next arm's first stage releases the previous arm's services only once it has committed
    ``steps``: a run of fewer chained steps would leave the next arm refused on the cluster."""
    fake, url = kfp_server
    with pytest.raises(SubmitError, match=r"--steps 1 .*committed all steps = 2.* pass --set steps=1"):
        submit(url, config, steps=1, out_dir=tmp_path, log=lambda s: None, poll_s=0.01)
    assert fake.requests == []
    sub = submit(url, config, steps=1, arms=["sync"], out_dir=tmp_path, log=lambda s: None, poll_s=0.01)
    assert [r.arm for r in sub.runs] == ["sync"]


def test_arms_the_declared_gpus_cannot_hold_are_refused_before_anything_is_sent(
    kfp_server: tuple[FakeKFP, str], tmp_path: Path
) -> None:
    from rollpacker.core.placement import PlacementError

    fake, url = kfp_server
    said: list[str] = []
    with pytest.raises(PlacementError, match="needs 16 GPUs together in the rollout worker group"):
        submit(
            url, Path("cluster"), overrides={"services.arms": "disjoint"}, out_dir=tmp_path, log=said.append
        )
    assert fake.requests == [] and not (tmp_path / "rl_experiment.yaml").exists()
    submit(url, Path("cluster"), steps=1, arms=["sync"], out_dir=tmp_path, log=said.append)
    assert any(
        "services.arms: sequential; GPUs per arm (sync: rollout 8, training 8, judge 1)" in s for s in said
    ), said


def test_the_cluster_configs_gpus_are_the_gpu_overlays(
    rendered: dict[str, list[dict[str, Any]]], root: Path
) -> None:
    """services.gpus in manifests/experiment.yaml (what submit checks the arms against) is what the
    gpu overlay's RayCluster gives Ray: replicas x the GPUs KubeRay derives for each group's pods."""
    from rollpacker.core.config import load_config

    gpus = load_config(root / "manifests" / "experiment.yaml").services.gpus
    (rc,) = [d for d in rendered["gpu"] if d["kind"] == "RayCluster"]
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}

    def ray_gpus(group: dict[str, Any]) -> int:
        # KubeRay: rayStartParams num-gpus, else the first container limit whose name ends in "gpu"
        limits = group["template"]["spec"]["containers"][0]["resources"].get("limits", {})
        derived = next((int(v) for k, v in limits.items() if k.endswith("gpu")), 0)
        return group["replicas"] * int(group["rayStartParams"].get("num-gpus", derived))

    assert {"rollout": gpus.rollout, "training": gpus.training, "judge": gpus.judge} == {
        name: ray_gpus(groups[name]) for name in ("rollout", "training", "judge")
    }
    assert ray_gpus(groups["sandbox"]) == 0
