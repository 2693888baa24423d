"""The docs cannot drift: what README.md and docs/*.md name exists, and docs/architecture.md's
Layout tree, layer table and per-step call table agree with the code.

The parsing is in ``tests/docs_refs.py``. A name that is not meant to exist in this tree (a file
the user writes, a file inside a sandbox) goes into ``ALLOWED`` with its reason; an entry nothing
uses any more fails too, so the list stays small.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rollpacker.core.config import ExperimentConfig
from rollpacker.services import api

from . import docs_refs as d
from .test_layers import LAYERS

REPO = d.REPO
SRC = REPO / "src" / "rollpacker"

# (kind, text) -> why it is named but not in the tree
ALLOWED: dict[tuple[str, str], str] = {
    ("path", "answer.py"): "docs/sandbox.md: the file the sandbox writes the response into, inside the jail",
    ("path", "tests.py"): "docs/sandbox.md: the test file the sandbox runs, inside the jail",
    ("path", "data/my_task.jsonl"): "docs/tasks.md: the user's own task file in an example",
    ("path", "compare.md"): "an output `rollpacker compare` writes into the run's folder",
}

# the services' Protocols by the name the docs call them (``rollout.run_round``)
ROLES: dict[str, tuple[type, ...]] = {
    "rollout": (api.RolloutAPI, api.ServiceAPI),
    "reward": (api.RewardAPI, api.ServiceAPI),
    "judge": (api.RewardAPI, api.ServiceAPI),
    "trainer": (api.TrainerAPI, api.ServiceAPI),
    "tracking": (api.TrackingAPI, api.ServiceAPI),
}


def _methods(role: str) -> set[str]:
    return {n for cls in ROLES[role] for n in vars(cls) if not n.startswith("_")}


def problems(refs: list[d.Ref]) -> list[tuple[d.Ref, str]]:
    """Each reference that names nothing in this tree, with why."""
    files, targets, tree = d.repo_files(), d.make_targets(), d.cli_tree()
    secs = d.sections(ExperimentConfig)
    out: list[tuple[d.Ref, str]] = []
    for r in refs:
        why = None
        if (r.kind, r.text) in ALLOWED:
            continue
        if r.kind == "path" and d.claims_tree(r.text, files) and not d.path_exists(r.text, files):
            why = "no such file or folder in the repository"
        elif r.kind == "command":
            why = d.check_command(r.text, tree)
        elif r.kind == "make" and r.text not in targets:
            why = f"the Makefile has no target {r.text!r}"
        elif r.kind == "key":
            head, _, rest = r.text.partition(".")
            if head in secs and not (head in ROLES and rest in _methods(head)):  # a service method
                why = d.check_key(r.text, ExperimentConfig)
        if why:
            out.append((r, why))
    return out


def test_docs_name_only_what_exists() -> None:
    found = problems(d.all_refs())
    assert not found, "stale names in the docs:\n" + "\n".join(f"{r}: {why}" for r, why in found)


def test_the_docs_are_read_for_each_kind() -> None:
    """The parser finds the references it is meant to (a parser that finds nothing passes anything)."""
    kinds = {r.kind: 0 for r in d.all_refs()}
    for r in d.all_refs():
        kinds[r.kind] += 1
    assert kinds["path"] > 300 and kinds["command"] > 100 and kinds["make"] > 30 and kinds["key"] > 100


def test_every_allowance_is_still_used() -> None:
    used = {(r.kind, r.text) for r in d.all_refs()}
    assert not set(ALLOWED) - used, f"unused entries in ALLOWED: {sorted(set(ALLOWED) - used)}"


PLANTED = """# planted

Run `rollpacker frobnicate` or `rollpacker bench nosuch`, then `rollpacker train --no-such-flag`.
See `src/rollpacker/core/gone.py`, `stages/vanished.py` and tests/core/test_gone.py, or
[the gone page](gone.md). Set `train.loss_normal: token_mean` and `rollout.sorted.nope`.

```bash
make no-such-target RUN_ARGS="--runner inline"
rollpacker train --config c.yaml --set train.lr_rate=1e-4
.venv/bin/rollpacker model nope
```

Fine: `rollpacker train --config c.yaml`, `make test`, `train.loss_norm`, `rollout.run_round`,
`core/stream_math.py`, `build/whatever.json`, [training](training.md).
"""


def test_a_planted_stale_name_fails(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "planted.md"
    doc.write_text(PLANTED, encoding="utf-8")
    found = {(r.kind, r.text): why for r, why in problems(list(d.refs(doc, tmp_path)))}
    assert set(found) == {
        ("command", "rollpacker frobnicate"),
        ("command", "rollpacker bench nosuch"),
        ("command", "rollpacker train --no-such-flag"),
        ("command", "rollpacker model nope"),
        ("path", "src/rollpacker/core/gone.py"),
        ("path", "stages/vanished.py"),
        ("path", "tests/core/test_gone.py"),
        ("path", "docs/gone.md"),
        ("key", "train.loss_normal"),
        ("key", "rollout.sorted.nope"),
        ("make", "no-such-target"),
        ("key", "train.lr_rate"),
    }, found
    assert "has no option --no-such-flag" in found[("command", "rollpacker train --no-such-flag")]
    assert "rollpacker bench has no command 'nosuch'" in found[("command", "rollpacker bench nosuch")]
    assert "train has no key 'loss_normal'" in found[("key", "train.loss_normal")]


# -- docs/architecture.md against the code ----------------------------------------------------------
ARCH = REPO / "docs" / "architecture.md"


def _block_after(heading: str, path: Path = ARCH) -> list[str]:
    """The first fenced block after the line ``heading``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = lines.index(heading)
    start = next(j for j in range(i, len(lines)) if lines[j].startswith("```"))
    end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
    return lines[start + 1 : end]


def _entries(lines: list[str], indent: int) -> dict[str, str]:
    """Tree entries at ``indent``: each name (``core/``, ``tracking.py``) -> its text, its own line
    and every deeper line up to the next entry at that indent."""
    out: dict[str, str] = {}
    names: list[str] = []
    for line in lines:
        m = re.match(r"^( *)([^\s,]+(?:,\s[^\s,]+)*)", line)
        if m and len(m.group(1)) == indent:
            names = [n.strip() for n in m.group(2).split(",")]
            for n in names:
                out[n] = ""
        elif m and len(m.group(1)) < indent:
            names = []
        for n in names:
            out[n] += line + "\n"
    return out


def _layout() -> dict[str, str]:
    root = _entries(_block_after("## Layout"), 0)
    assert "src/rollpacker/" in root
    return root


def _package_entries() -> dict[str, str]:
    return _entries(_layout()["src/rollpacker/"].splitlines()[1:], 2)


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def test_layout_tree_places_every_module() -> None:
    """Every top-level module and package has an entry, and a package's entry names each of its
    own modules and subpackages (``types.py``, ``types`` or ``policies/``)."""
    entries = _package_entries()
    missing = []
    for f in sorted(SRC.iterdir()):
        if f.name.startswith(("_", ".")) or not (f.suffix == ".py" or (f / "__init__.py").is_file()):
            continue
        name = f.name + ("/" if f.is_dir() else "")
        if name not in entries:
            missing.append(name)
            continue
        if f.is_dir():
            for m in sorted(f.iterdir()):
                if m.name.startswith("_") or not (m.suffix == ".py" or (m / "__init__.py").is_file()):
                    continue
                if not _mentions(entries[name], m.stem):
                    missing.append(str(m.relative_to(SRC)))
    assert not missing, f"docs/architecture.md's Layout tree does not name: {missing}"


def test_layout_tree_names_only_what_exists() -> None:
    """Every ``x.py`` and ``x/`` a package's entry names exists in that package, and every folder
    at the tree's root exists."""
    gone = [n for n in _layout() if not (REPO / n).exists()]
    for name, text in _package_entries().items():
        pkg = SRC / name.rstrip("/")
        if not pkg.exists():
            gone.append(name)
        for word in re.findall(r"(?<![\w/.-])([\w-]+(?:\.py|/))(?![\w])", text):
            found = (pkg / word).exists() if not pkg.is_dir() else any(pkg.rglob(word.rstrip("/")))
            if word != name and not found and not (SRC / word).exists():
                gone.append(f"{name}: {word}")
    assert not gone, f"docs/architecture.md's Layout tree names what is not there: {gone}"


def test_layout_tree_names_every_command() -> None:
    """Every command ``--help`` lists is named in the Layout tree: the product's in the ``cli``
    entry, the lab's in the ``lab`` entry (the older spellings, hidden, are not listed)."""
    tree = d.cli_tree()
    entries = _package_entries()
    cli = next(text for n, text in entries.items() if n.rstrip("/") in ("cli.py", "cli"))
    lab = entries.get("lab/", "")
    missing = [
        " ".join(p)
        for p in _command_paths(tree, ())
        if not all(_mentions(lab if p[0] == "lab" else cli, w) for w in p)
    ]
    assert not missing, f"docs/architecture.md's Layout tree (cli, lab) does not name: {missing}"


def _command_paths(cmd: d.Command, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    out = [path] if path else []
    for n, sub in cmd.sub.items():
        if not sub.hidden:
            out += _command_paths(sub, (*path, n))
    return out


def test_layer_table_is_the_layer_test_table() -> None:
    """The Layers block (``a, b  <  c  <  ...``) ranks exactly what tests/test_layers.py ranks."""
    text = " ".join(_block_after("## Layers"))
    documented = {
        name.strip(): rank
        for rank, group in enumerate(text.split("<"))
        for name in group.split(",")
        if name.strip()
    }
    code = {k.removeprefix("rollpacker."): v for k, v in LAYERS.items() if not k.startswith("=")}
    assert _ranks(documented) == _ranks(code), (documented, code)


def _ranks(table: dict[str, int]) -> list[set[str]]:
    """The layers in order, each as the set of its names (ranks compared by order, not number)."""
    return [{n for n, r in table.items() if r == rank} for rank in sorted(set(table.values()))]


def _call_table(text: str) -> list[tuple[str, str]]:
    return re.findall(r"\b(rollout|reward|judge|trainer|tracking)\.([a-z_]+)\b", text)


@pytest.mark.parametrize("where", ["docs/architecture.md", "src/rollpacker/services/api.py"])
def test_per_step_call_table_names_protocol_methods(where: str) -> None:
    if where.endswith(".md"):
        heading = next(line for line in ARCH.read_text().splitlines() if line.startswith("## Services"))
        text = "\n".join(_block_after(heading))
    else:
        text = (api.__doc__ or "").split("per step", 1)[1]
    calls = _call_table(text)
    assert len(calls) >= 8, calls
    secs = d.sections(ExperimentConfig)  # ``rollout.dynamic_sampling``: a config key, named as a condition
    bad = [
        f"{r}.{m}"
        for r, m in calls
        if m not in _methods(r) and not (r in secs and d.check_key(f"{r}.{m}", ExperimentConfig) is None)
    ]
    assert not bad, f"{where}: the per-step call table names methods no Protocol has: {bad}"
