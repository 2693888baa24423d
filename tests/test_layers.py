"""The import graph of the project's own modules: layers only import downwards, and no cycles.

List every finding on the real tree with ``.venv/bin/python -m tests.test_layers`` (exit 1 if any).
The checker (``tests/layers.py``) reads the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from .layers import (
    Graph,
    module_cycles,
    package_cycles,
    report,
    resolve_relative,
    scan,
    unplaced,
    upward_imports,
    wing_imports,
)

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "src" / "rollpacker", REPO / "components", REPO / "pipelines")

# Lowest first. A key places that module and everything under it; "=rollpacker" places only the
# package's own __init__, so a new top-level module (rollpacker.X) must be added here.
LAYERS: dict[str, int] = {
    "=rollpacker": 0,
    "rollpacker.core": 0,
    "rollpacker.engines": 1,
    "rollpacker.rewards": 1,
    "rollpacker.trainers": 1,
    "rollpacker.tasks": 1,
    "rollpacker.store": 1,
    "rollpacker.tracking": 1,
    "rollpacker.rollout": 1,  # the round driver
    # devservices starts the local S3 / Ray / MLflow processes (dev tooling); it imports only core and
    # store. The runners and the CLI use it; the services never do (FORBIDDEN): the runner hands the
    # Ray address to the registry.
    "rollpacker.devservices": 1,
    # test support shipped with the package (fault injection), loaded by name through stages.hooks
    "rollpacker.testing": 1,
    "rollpacker.logs": 1,  # library output to a log file, progress to the terminal
    "rollpacker.services": 2,
    "rollpacker.stages": 3,
    # The KFP components call the stages (through stages.edge); the pipelines wire the components.
    # They sit above the stages and below what compiles, runs or submits them.
    "components": 4,
    "pipelines": 4,
    "rollpacker.pipeline_compile": 5,
    "rollpacker.pipeline_local": 5,
    "rollpacker.submit": 5,
    "rollpacker.deploy": 5,
    "rollpacker.experiment": 6,
    "rollpacker.cli": 7,
    "rollpacker.__main__": 7,  # `python -m rollpacker`: the command
    # the lab (benchmarks, what-if, profiling, soak, chaos): above everything, imported by nothing
    # of the product; the command root mounts its group by name (rollpacker.cli.LAB)
    "rollpacker.lab": 8,
}
# Imports the order alone would allow but that are not: the components use only the stages' edge
# and below, never each other's pipelines; the stages never build or train a model (the model
# preparation runs before an arm's first step, tasks/prepare.py); the services never use dev tooling.
MODEL_PREPARATION = (
    "rollpacker.tasks.prepare",
    "rollpacker.tasks.warmup",
    "rollpacker.tasks.tiny_model",
    "rollpacker.tasks.shipped",
    "rollpacker.tasks.ship",
)
FORBIDDEN: tuple[tuple[str, str], ...] = (
    ("components", "pipelines"),
    *(("rollpacker.stages", m) for m in MODEL_PREPARATION),
    ("rollpacker.services", "rollpacker.devservices"),
)
# Wings: packages kept apart from the product. Nothing outside a wing imports it, whatever its layer
# (the command root mounts the lab's group by name only: rollpacker.cli.LAB).
WINGS: tuple[str, ...] = ("rollpacker.lab",)


def _real_tree() -> Graph:
    return scan(ROOTS, base=REPO)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


# -- the real tree ----------------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    assert unplaced(_real_tree(), LAYERS) == []


def test_no_upward_imports() -> None:
    found = [str(v) for v in upward_imports(_real_tree(), LAYERS, FORBIDDEN)]
    assert not found, "imports against the layer order:\n" + "\n".join(found)


def test_the_product_imports_nothing_of_the_lab() -> None:
    found = [str(v) for v in wing_imports(_real_tree(), LAYERS, WINGS)]
    assert not found, "product modules importing a wing:\n" + "\n".join(found)


def test_the_command_root_mounts_the_lab_by_name() -> None:
    from rollpacker import cli

    assert cli.LAB_MODULE.startswith(WINGS[0] + ".")
    lab = importlib.import_module(cli.LAB_MODULE)
    assert {"bench", "whatif", "profile", "soak", "chaos"} <= {
        c.name or c.callback.__name__ for c in lab.lab_app.registered_commands
    } | {g.name for g in lab.lab_app.registered_groups}


def test_no_cycles() -> None:
    graph = _real_tree()
    found = [str(c) for c in module_cycles(graph) + package_cycles(graph)]
    assert not found, "import cycles:\n" + "\n".join(found)


# -- the checker catches what it should (planted trees) ------------------------------------------------
PLANTED_LAYERS = {"=pkg": 0, "pkg.core": 0, "pkg.services": 2, "pkg.x": 1, "pkg.y": 1}


def test_planted_upward_import_is_caught(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "import os\n\n\ndef f():\n    from pkg.services import b\n    return b\n",
            "services/__init__.py": "",
            "services/b.py": "from pkg.core import a\n",  # downward: fine
        },
    )
    graph = scan([tmp_path / "pkg"], base=tmp_path)
    found = upward_imports(graph, PLANTED_LAYERS)
    assert [(v.imp.importer, v.imp.imported, v.imp.path, v.imp.line) for v in found] == [
        ("pkg.core.a", "pkg.services.b", "pkg/core/a.py", 5)
    ]
    msg = str(found[0])
    for part in ("pkg/core/a.py:5", "pkg.core.a (layer 0)", "pkg.services.b (layer 2)", "move the code down"):
        assert part in msg
    # and the same tree without the planted import is clean
    (tmp_path / "pkg/core/a.py").write_text("import os\n")
    assert upward_imports(scan([tmp_path / "pkg"]), PLANTED_LAYERS) == []


def test_type_checking_and_dynamic_imports_count(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "core/__init__.py": (
                "from typing import TYPE_CHECKING\nimport importlib\n"
                "if TYPE_CHECKING:\n    from pkg.services import b\n"
                "importlib.import_module('pkg.services')\n"
            ),
            "services/__init__.py": "",
            "services/b.py": "",
        },
    )
    found = upward_imports(scan([tmp_path / "pkg"]), PLANTED_LAYERS)
    assert [(v.imp.imported, v.imp.line) for v in found] == [("pkg.services.b", 4), ("pkg.services", 5)]


def test_planted_cycle_is_caught(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "x/__init__.py": "",
            "x/a.py": "from pkg.x import b\n",
            "x/b.py": "def g():\n    from . import a\n",
            "x/c.py": "from pkg.y import d\n",
            "y/__init__.py": "",
            "y/d.py": "import pkg.x.e\n",
        },
    )
    (tmp_path / "pkg/x/e.py").write_text("")
    graph = scan([tmp_path / "pkg"], base=tmp_path)
    mods = module_cycles(graph)
    assert [(c.members, c.path) for c in mods] == [(("pkg.x.a", "pkg.x.b"), ("pkg.x.a", "pkg.x.b"))]
    assert [(e.path, e.line) for e in mods[0].evidence] == [("pkg/x/a.py", 1), ("pkg/x/b.py", 2)]
    assert "pkg.x.a -> pkg.x.b -> pkg.x.a" in str(mods[0])
    pkgs = package_cycles(graph)
    assert [(c.members, c.path) for c in pkgs] == [(("pkg.x", "pkg.y"), ("pkg.x", "pkg.y"))]
    text = str(pkgs[0])
    assert "pkg.x -> pkg.y -> pkg.x" in text
    assert "pkg/x/c.py:1: pkg.x.c imports pkg.y.d" in text and "pkg/y/d.py:1: pkg.y.d imports pkg.x.e" in text
    # the module graph has no x <-> y cycle (c -> d -> e is a chain): only the package graph does
    assert all("pkg.y" not in c.members for c in mods)


def test_relative_imports_resolve(tmp_path: Path) -> None:
    assert resolve_relative("rollpacker.stages", 2, "services") == "rollpacker.services"
    assert resolve_relative("rollpacker.stages", 1, None) == "rollpacker.stages"
    with pytest.raises(ValueError, match="above the top package"):
        resolve_relative("rollpacker", 2, "x")
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/a.py": "from ..services import x\nfrom ..services.x import name\nfrom . import b\n",
            "core/b.py": "",
            "services/__init__.py": "from .x import name\n",
            "services/x.py": "name = 1\n",
        },
    )
    graph = scan([tmp_path / "pkg"])
    got = sorted((i.importer, i.imported, i.line) for i in graph.imports)
    assert got == [
        ("pkg.core.a", "pkg.core.b", 3),
        ("pkg.core.a", "pkg.services.x", 1),
        ("pkg.core.a", "pkg.services.x", 2),
        ("pkg.services", "pkg.services.x", 1),
    ]
    assert [(v.imp.importer, v.imp.imported) for v in upward_imports(graph, PLANTED_LAYERS)] == [
        ("pkg.core.a", "pkg.services.x"),
        ("pkg.core.a", "pkg.services.x"),
    ]


def test_planted_wing_import_is_caught(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "services/__init__.py": "",
            "services/s.py": "from pkg.core import a\n",
            "core/a.py": "",
            "lab/__init__.py": "",
            "lab/tool.py": "from pkg.services import s\n",  # the wing imports the product: fine
            "lab/more.py": "from . import tool\n",  # inside the wing: fine
        },
    )
    layers = {**PLANTED_LAYERS, "pkg.lab": 3}
    assert wing_imports(scan([tmp_path / "pkg"]), layers, ["pkg.lab"]) == []
    # a product module at any layer that imports the wing, even lazily
    (tmp_path / "pkg/services/s.py").write_text("def f():\n    from pkg.lab import tool\n    return tool\n")
    found = wing_imports(scan([tmp_path / "pkg"], base=tmp_path), layers, ["pkg.lab"])
    assert [(v.kind, v.imp.importer, v.imp.imported, v.imp.line) for v in found] == [
        ("wing", "pkg.services.s", "pkg.lab.tool", 2)
    ]
    assert "pkg.lab.tool is in a wing; the product never depends on a wing" in str(found[0])
    assert "pkg/services/s.py:2" in str(found[0])
    # the layers alone would not catch it where the wing shares the importer's layer
    assert upward_imports(scan([tmp_path / "pkg"]), {**PLANTED_LAYERS, "pkg.lab": 2}) == []
    assert wing_imports(scan([tmp_path / "pkg"]), {**PLANTED_LAYERS, "pkg.lab": 2}, ["pkg.lab"]) != []


def test_forbidden_pairs_and_unplaced_modules(tmp_path: Path) -> None:
    _write(
        tmp_path / "pkg",
        {"__init__.py": "", "x/__init__.py": "from pkg.y import z\n", "y/z.py": "", "new.py": ""},
    )
    graph = scan([tmp_path / "pkg"], base=tmp_path)
    assert upward_imports(graph, PLANTED_LAYERS) == []
    found = upward_imports(graph, PLANTED_LAYERS, forbidden=[("pkg.x", "pkg.y")])
    assert [v.kind for v in found] == ["forbidden"]
    assert "pkg/x/__init__.py:1: pkg.x (layer 1) imports pkg.y.z (layer 1)" in str(found[0])
    assert [m.split(": ")[1] for m in unplaced(graph, PLANTED_LAYERS)] == [
        "pkg.new has no layer; add it to the layer table at the rank its imports allow"
    ]


def test_the_real_forbidden_pairs_catch_planted_imports(tmp_path: Path) -> None:
    """A stage that prepares a model (module-level or function-local) and a service that asks the
    dev tooling for anything are reported as forbidden, with the real layer table and pairs."""
    _write(
        tmp_path / "rollpacker",
        {
            "__init__.py": "",
            "devservices.py": "",
            "tasks/__init__.py": "",
            "tasks/models.py": "",
            "tasks/prepare.py": "from rollpacker.tasks import models\n",
            "tasks/warmup.py": "",
            "stages/__init__.py": "",
            "stages/plan.py": (
                "from rollpacker.tasks.models import base_key\n"
                "from rollpacker.tasks.prepare import prepare_arm\n\n\n"
                "def f():\n    from rollpacker.tasks import warmup\n"
            ),
            "services/__init__.py": "",
            "services/registry.py": "from rollpacker.devservices import local_ray_address\n",
        },
    )
    graph = scan([tmp_path / "rollpacker"], base=tmp_path)
    found = upward_imports(graph, LAYERS, FORBIDDEN)
    assert [(v.kind, v.imp.importer, v.imp.imported, v.imp.line) for v in found] == [
        ("forbidden", "rollpacker.services.registry", "rollpacker.devservices", 1),
        ("forbidden", "rollpacker.stages.plan", "rollpacker.tasks.prepare", 2),
        ("forbidden", "rollpacker.stages.plan", "rollpacker.tasks.warmup", 6),
    ]
    assert "rollpacker/stages/plan.py:2: rollpacker.stages.plan (layer 3)" in str(found[1])
    assert "this pair is listed as forbidden" in str(found[1])
    # without the planted imports the same tree is clean (reading the model's key is allowed)
    (tmp_path / "rollpacker/stages/plan.py").write_text("from rollpacker.tasks.models import base_key\n")
    (tmp_path / "rollpacker/services/registry.py").write_text("")
    assert upward_imports(scan([tmp_path / "rollpacker"]), LAYERS, FORBIDDEN) == []


if __name__ == "__main__":
    findings = report(_real_tree(), LAYERS, FORBIDDEN, WINGS)
    print("\n".join(findings) or "no layer violations, no cycles")
    sys.exit(1 if findings else 0)
