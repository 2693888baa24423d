"""Shared fixtures: the manifests copied with generated secrets, each overlay rendered once, the
pipelines compiled once (3 chained steps, like tests/pipelines)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from rollpacker import deploy
from rollpacker.pipeline_compile import compile_pipelines, repo_root
from tests.pipelines.spec import load_docs
from tests.store.conftest import seaweed  # noqa: F401 - the store tests' SeaweedFS server, as a fixture

OVERLAYS = ("dev", "gpu")


@pytest.fixture(scope="session")
def root() -> Path:
    return repo_root()


@pytest.fixture(scope="session")
def manifests(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of manifests/ whose secrets/*.env are freshly generated (a clean clone has none)."""
    out = tmp_path_factory.mktemp("deploy") / "manifests"
    shutil.copytree(root / "manifests", out, ignore=shutil.ignore_patterns("*.env"))
    deploy.generate_secrets(out / "secrets")
    return out


@pytest.fixture(scope="session")
def rendered(manifests: Path) -> dict[str, list[dict[str, Any]]]:
    return {name: deploy.render(manifests / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="session")
def pipeline_docs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """rl_step and rl_experiment compiled with the default images and node pool."""
    mp = pytest.MonkeyPatch()
    for name in ("controller", "rollout", "sandbox", "judge", "training"):
        mp.delenv(f"ROLLPACKER_IMAGE_{name.upper()}", raising=False)
    mp.delenv("ROLLPACKER_NODE_POOL", raising=False)
    try:
        paths = compile_pipelines(tmp_path_factory.mktemp("compiled"), 3)
    finally:
        mp.undo()
    return {p.stem: load_docs(p) for p in paths}
