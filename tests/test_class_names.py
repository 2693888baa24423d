"""One name per class: no two public classes in ``src/rollpacker`` share a name, so a name in a
traceback, a doc or a review means one thing (a ``_private`` helper class may repeat)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "rollpacker"


def public_classes(root: Path) -> dict[str, list[str]]:
    """Each public class name under ``root`` -> the modules (relative paths) that define one."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found[node.name].append(str(path.relative_to(root)))
    return found


def test_no_two_public_classes_share_a_name() -> None:
    twice = {name: where for name, where in public_classes(SRC).items() if len(where) > 1}
    assert not twice, f"rename one of each: {twice}"


def test_the_check_sees_a_planted_duplicate(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("class StepPlan:\n    pass\n")
    (tmp_path / "b.py").write_text("class StepPlan:\n    pass\nclass _Helper:\n    pass\n")
    (tmp_path / "c.py").write_text("class _Helper:\n    pass\n")
    assert public_classes(tmp_path)["StepPlan"] == ["a.py", "b.py"]
    assert "_Helper" not in public_classes(tmp_path)
