"""Convention 1: ``rollpacker.core`` imports no heavy framework."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import rollpacker.core

HEAVY = ("torch", "vllm", "ray", "kfp", "mlflow", "transformers", "numpy")


def test_core_imports_no_heavy_framework() -> None:
    mods = [m.name for m in pkgutil.walk_packages(rollpacker.core.__path__, "rollpacker.core.")]
    assert len(mods) >= 8, mods
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(json.dumps([h for h in {HEAVY!r} if h in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
