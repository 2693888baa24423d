"""Compiled pipelines, once per module (compiling 3 chained steps takes about a second)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.pipeline_compile import compile_pipelines

STEPS = 3


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("compiled")
    paths = compile_pipelines(out, STEPS)
    return {p.stem: p for p in paths}
