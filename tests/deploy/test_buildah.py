"""The CPU-only images (controller, sandbox) built for real with buildah, through the same code as
`make images` (rollpacker.deploy.build_images), from a local base: Debian bookworm with Python 3.11
made by mmdebstrap from the machine's apt sources, as no registry can be reached here. Then each
component's entry points run inside with --help (`buildah run`, chroot isolation), or, where
`buildah run` cannot run, the image's filesystem is checked instead.

Skips with the reason when buildah, its storage, mmdebstrap or a package index is missing here.
Storage and layer cache: $ROLLPACKER_BUILDAH_ROOT, default ~/.cache/rollpacker/buildah (a warm
cache rebuilds only the layers whose inputs changed; the first build takes a few minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpacker import deploy

pytestmark = pytest.mark.slow

BASE_TAG = "localhost/rollpacker-test-base:bookworm-py311"
STORE = Path(
    os.environ.get("ROLLPACKER_BUILDAH_ROOT", str(Path.home() / ".cache" / "rollpacker" / "buildah"))
)
INDEX = "https://pypi.org/simple/pip/"


def _run(cmd: list[str], timeout: float = 900, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _tail(res: subprocess.CompletedProcess[str]) -> str:
    return (res.stderr or res.stdout).strip()[-400:]


@pytest.fixture(scope="module")
def buildah(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``buildah`` with global flags for a storage driver that works here (overlay, else vfs)."""
    exe = shutil.which("buildah")
    if exe is None:
        pytest.skip("buildah is not installed (Debian: apt-get install buildah mmdebstrap)")
    runroot = tmp_path_factory.mktemp("buildah-run")
    why = ""
    for driver in ("overlay", "vfs"):
        cmd = [
            exe,
            "--root",
            str(STORE / driver),
            "--runroot",
            str(runroot / driver),
            "--storage-driver",
            driver,
        ]
        res = _run([*cmd, "images"], timeout=60)
        if res.returncode == 0:
            return cmd
        why += f"{driver}: {_tail(res)}; "
    pytest.skip(f"buildah cannot use its storage here ({why})")


@pytest.fixture(scope="module")
def local_base(buildah: list[str], tmp_path_factory: pytest.TempPathFactory) -> str:
    """Debian bookworm minbase + python3 (3.11) + python3-venv as a local image (cached)."""
    if _run([*buildah, "inspect", "--type", "image", BASE_TAG], timeout=60).returncode == 0:
        return BASE_TAG
    if shutil.which("mmdebstrap") is None:
        pytest.skip("no local base image and no mmdebstrap to make one (apt-get install mmdebstrap)")
    d = tmp_path_factory.mktemp("base")
    res = _run(
        [
            "mmdebstrap",
            "--variant=minbase",
            "--include=python3,python3-venv,ca-certificates",
            "--mode=root",
            "bookworm",
            str(d / "base.tar"),
        ],
        timeout=600,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot make the local Debian base here (mmdebstrap: {_tail(res)})")
    (d / "Containerfile").write_text('FROM scratch\nADD base.tar /\nCMD ["/bin/sh"]\n')
    res = _run(
        [*buildah, "bud", "--isolation", "chroot", "-t", BASE_TAG, "-f", str(d / "Containerfile"), str(d)]
    )
    assert res.returncode == 0, f"buildah could not import the local base: {_tail(res)}"
    return BASE_TAG


def _ca_bundle() -> Path | None:
    for cand in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if cand and Path(cand).is_file():
            return Path(cand)
    return None


@pytest.fixture(scope="module")
def pip_secrets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The build secrets: a pip.conf that trusts this machine's CA bundle (its TLS proxy), if any."""
    ca = _ca_bundle()
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    try:
        with urllib.request.urlopen(INDEX, timeout=20, context=ctx) as resp:
            resp.read(1)
    except OSError as e:
        pytest.skip(f"no package index reachable for the image build ({INDEX}: {e})")
    d = tmp_path_factory.mktemp("secrets")
    if ca is None:
        (d / "pip.conf").write_text("[global]\n")
        (d / "ca.pem").write_text("")
    else:
        (d / "pip.conf").write_text("[global]\ncert = /run/secrets/pip_ca\n")
        shutil.copy(ca, d / "ca.pem")
    return {"pipconf": d / "pip.conf", "pip_ca": d / "ca.pem"}


@pytest.fixture(scope="module")
def built(buildah: list[str], local_base: str, pip_secrets: dict[str, Path], root: Path) -> dict[str, str]:
    """controller and sandbox built by `make images`' code from the local base: name -> tag."""
    log: list[str] = []
    try:
        tags = deploy.build_images(
            root,
            builder="buildah",
            only=["controller", "sandbox"],
            bases={"PYTHON_BASE": local_base},
            secrets=pip_secrets,
            extra=[*buildah[1:], "--isolation", "chroot", "--quiet"],
            log=log.append,
        )
    except deploy.DeployError as e:
        pytest.fail(f"{e}\n" + "\n".join(log))
    return {t.split("/")[-1].split(":")[0]: t for t in tags}


@pytest.fixture(scope="module")
def inside(buildah: list[str], built: dict[str, str]) -> Iterator[Any]:
    """run(image, *cmd) -> (exit code, output) inside a working container of the image, through
    `buildah run`; None when `buildah run` does not work here (then the filesystem is checked)."""
    containers: dict[str, str] = {}
    for name, tag in built.items():
        res = _run([*buildah, "from", "--pull-never", tag], timeout=120)
        assert res.returncode == 0, _tail(res)
        containers[name] = res.stdout.strip().splitlines()[-1]
    probe = _run(
        [*buildah, "run", "--isolation", "chroot", containers["controller"], "--", "true"], timeout=60
    )

    def run(name: str, *cmd: str) -> tuple[int, str]:
        res = _run([*buildah, "run", "--isolation", "chroot", containers[name], "--", *cmd], timeout=300)
        return res.returncode, res.stdout + res.stderr

    try:
        yield run if probe.returncode == 0 else None
    finally:
        for c in containers.values():
            _run([*buildah, "rm", c], timeout=60)


def _config(buildah: list[str], tag: str) -> dict[str, Any]:
    res = _run([*buildah, "inspect", "--type", "image", tag], timeout=60)
    assert res.returncode == 0, _tail(res)
    return json.loads(res.stdout)["Docker"]["config"]


@pytest.mark.parametrize("name", ["controller", "sandbox"])
def test_image_is_non_root_with_a_health_check_and_no_secrets(
    buildah: list[str], built: dict[str, str], name: str
) -> None:
    cfg = _config(buildah, built[name])
    assert cfg["User"] == "10001:10001"
    assert cfg["Healthcheck"]["Test"] == ["CMD", "rollpacker-healthcheck"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["PATH"].startswith("/opt/venv/bin:")
    assert not [k for k in env if any(s in k for s in ("PASSWORD", "SECRET", "TOKEN", "ACCESS_KEY"))]


@pytest.mark.parametrize(
    ("name", "cmd", "expect"),
    [
        ("controller", ["rollpacker", "--help"], "rollpacker: tail batching"),
        ("controller", ["python3", "-m", "kfp.dsl.executor_main", "--help"], "--function_to_execute"),
        ("controller", ["mlflow", "server", "--help"], "--allowed-hosts"),
        ("sandbox", ["rollpacker", "sandbox", "run", "--help"], "--tests"),
        ("sandbox", ["python3", "-m", "kfp.dsl.executor_main", "--help"], "--function_to_execute"),
    ],
)
def test_entry_points_run_inside(
    inside: Any, buildah: list[str], built: dict[str, str], name: str, cmd: list[str], expect: str
) -> None:
    if inside is None:
        _check_filesystem(buildah, built[name], cmd[0])
        return
    code, out = inside(name, *cmd)
    assert code == 0 and expect in out, out[-2000:]


def test_runs_as_its_user_without_build_secrets_left(inside: Any) -> None:
    if inside is None:
        pytest.skip("buildah run does not work here; the filesystem checks cover the entry points")
    for name in ("controller", "sandbox"):
        code, out = inside(
            name, "sh", "-c", "id -u; test ! -e /etc/pip.conf && test ! -e /run/secrets/pip_ca"
        )
        assert code == 0 and out.split() == ["10001"], out
        code, out = inside(name, "rollpacker-healthcheck")  # nothing serves: unhealthy, and says so
        assert code == 1 and "unhealthy" in out, out


def test_sandbox_image_has_a_working_nsjail(inside: Any) -> None:
    if inside is None:
        pytest.skip("buildah run does not work here (the image build already ran nsjail --help)")
    find = "from rollpacker.rewards.sandbox import find_nsjail; print(find_nsjail())"
    code, out = inside("sandbox", "python3", "-c", find)
    assert code == 0, out
    code, out = inside("sandbox", out.strip().splitlines()[-1], "--help")
    assert code == 0 and "--time_limit" in out, out[-1000:]


def _check_filesystem(buildah: list[str], tag: str, exe: str) -> None:
    """Without `buildah run`: the entry point exists in the image and points at its venv."""
    res = _run([*buildah, "from", "--pull-never", tag], timeout=120)
    assert res.returncode == 0, _tail(res)
    ctr = res.stdout.strip().splitlines()[-1]
    try:
        res = _run([*buildah, "mount", ctr], timeout=60)
        assert res.returncode == 0, _tail(res)
        mnt = Path(res.stdout.strip())
        path = mnt / "opt" / "venv" / "bin" / ("python3" if exe == "python3" else exe)
        assert path.exists() or path.is_symlink(), path
        if exe != "python3":
            assert path.read_text().startswith("#!/opt/venv/bin/python"), path
        assert list((mnt / "opt" / "venv" / "lib").glob("python3.*/site-packages/rollpacker/cli/__init__.py"))
    finally:
        _run([*buildah, "umount", ctr], timeout=60)
        _run([*buildah, "rm", ctr], timeout=60)
