"""Compile the KFP pipelines: ``rollpacker compile --out build/ [--steps N] [--config FILE]``.

The components (``components/<stage>/component.py``) and pipelines (``pipelines/``) are packages at
the repository root, not part of the installed ``rollpacker`` package. ``load_pipeline_modules``
puts the repository root on ``sys.path`` and imports them afresh, so the container images they bake
in (``components/images.py``: defaults, or ``ROLLPACKER_IMAGE_<NAME>``) are read at compile time.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rollpacker.core.config import load_config
from rollpacker.core.errors import RollpackerError

PACKAGES = ("components", "pipelines")
OUTPUTS = ("rl_step.yaml", "rl_experiment.yaml")


def repo_root() -> Path:
    """The source checkout holding ``components/`` and ``pipelines/``.

    ``ROLLPACKER_REPO_ROOT`` if set, else the checkout this (editable) install lives in, else the
    current directory.
    """
    candidates = []
    if os.environ.get("ROLLPACKER_REPO_ROOT"):
        candidates.append(Path(os.environ["ROLLPACKER_REPO_ROOT"]))
    candidates += [Path(__file__).resolve().parents[2], Path.cwd()]
    for root in candidates:
        if (root / "pipelines" / "rl_step.py").is_file() and (root / "components" / "images.py").is_file():
            return root.resolve()
    raise RollpackerError(
        "cannot find the pipeline sources (pipelines/rl_step.py, components/images.py) in "
        f"{', '.join(str(c) for c in candidates)}; run from a rollpacker source checkout "
        "or set ROLLPACKER_REPO_ROOT to one"
    )


def load_pipeline_modules() -> tuple[ModuleType, ModuleType]:
    """Import ``pipelines.rl_step`` and ``pipelines.rl_experiment`` afresh (and the components with
    them), so that image overrides set in the environment since the last import apply."""
    root = str(repo_root())
    if root not in sys.path:
        sys.path.insert(0, root)
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    importlib.invalidate_caches()
    return importlib.import_module("pipelines.rl_step"), importlib.import_module("pipelines.rl_experiment")


def build_pipelines(steps: int) -> dict[str, Any]:
    """``{"rl_step": <pipeline>, "rl_experiment": <pipeline of `steps` steps>}``, freshly imported."""
    rl_step_mod, rl_experiment_mod = load_pipeline_modules()
    return {
        "rl_step": rl_step_mod.rl_step,
        "rl_experiment": rl_experiment_mod.build_rl_experiment(steps),
    }


def images_in_use() -> dict[str, str]:
    """Each container image the compiled pipelines run (name -> reference), as ``compile_pipelines``
    bakes them in now: the defaults of ``components/images.py`` or ``ROLLPACKER_IMAGE_<NAME>``."""
    images = sys.modules.get("components.images")
    if images is None:
        load_pipeline_modules()
        images = sys.modules["components.images"]
    return {name: images.image(name) for name in images.IMAGE_NAMES}


def compile_pipelines(out_dir: Path, steps: int) -> list[Path]:
    """Write ``rl_step.yaml`` and ``rl_experiment.yaml`` (``steps`` chained steps) into ``out_dir``."""
    from kfp import compiler

    pipelines = build_pipelines(steps)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, out in zip(("rl_step", "rl_experiment"), OUTPUTS, strict=True):
        path = out_dir / out
        compiler.Compiler().compile(pipelines[name], str(path))
        written.append(path)
    return written


def steps_from_config(path: Path) -> int:
    """``steps`` of an experiment YAML (validated like ``rollpacker train`` does)."""

    return load_config(path).steps
