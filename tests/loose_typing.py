"""A checker for loose typing in the project's own modules (test support, not shipped).

It parses every ``.py`` under the given package roots with ``ast`` (nothing is imported or run) and
collects, per module, every *probe* — a call of ``hasattr`` or ``getattr``: an object asked for an
attribute by name, where a typed Protocol or field would say what it has — and every use of
``typing.Any`` (``Any`` or ``typing.Any`` in an annotation, a cast or an alias; the import itself
does not count).

Both belong in adapters: the modules that talk to a library or a system whose types are not ours
(vLLM, torch, megatron, S3, MLflow, Ray, KFP, typer). Every other module is held to a pinned
budget with a reason, so a new probe or ``Any`` outside an adapter fails the test, and a module
that drops one is told to lower its pin:

    uses = scan([Path("src/rollpacker"), Path("components")], base=Path("."))
    for f in findings(uses, adapters, budget): print(f)

An adapter key places that module and everything under it (``rollpacker.store`` covers
``rollpacker.store.s3``); a budget key names one module exactly.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from .layers import python_files

PROBES = ("hasattr", "getattr")
FIX = (
    "type it: a Protocol in the port (isinstance against a runtime_checkable Protocol, like "
    "engines.base.DraftMemory), a declared attribute on the base class, or a concrete type; if "
    "this module is an adapter of a foreign library, list it under ADAPTERS with what it adapts"
)


@dataclass(frozen=True)
class Use:
    """A probe (``hasattr``/``getattr`` call) or an ``Any`` at ``path:line`` of ``module``."""

    module: str
    kind: str  # "probe" | "any"
    what: str  # "hasattr", "getattr" or "Any"
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


class Budget(NamedTuple):
    """What one non-adapter module may hold, and why it needs it."""

    probes: int
    anys: int
    reason: str


def scan(roots: Sequence[Path], base: Path | None = None) -> dict[str, list[Use]]:
    """module name -> its probes and ``Any`` uses (every scanned module is a key, even with none)."""
    out: dict[str, list[Use]] = {}
    for name, f, shown, _ in python_files(roots, base):
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        out[name] = sorted(_uses(tree, name, shown), key=lambda u: (u.line, u.what))
    return out


def _uses(tree: ast.AST, module: str, path: str) -> Iterable[Use]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
            yield Use(module, "probe", node.func.id, path, node.lineno)
        elif (isinstance(node, ast.Name) and node.id == "Any") or (
            isinstance(node, ast.Attribute)
            and node.attr == "Any"
            and isinstance(node.value, ast.Name)
            and node.value.id == "typing"
        ):
            yield Use(module, "any", "Any", path, node.lineno)


def adapter_of(module: str, adapters: Mapping[str, str]) -> str | None:
    """The adapter key that places ``module`` (the longest), or None."""
    keys = [k for k in adapters if module == k or module.startswith(k + ".")]
    return max(keys, key=len) if keys else None


def findings(
    uses: Mapping[str, Sequence[Use]], adapters: Mapping[str, str], budget: Mapping[str, Budget]
) -> list[str]:
    """One message per problem: a module over its budget (or without one), a pin above what the
    module holds (lower it), a budget or adapter entry that names no module, a pin without reason."""
    out: list[str] = []
    for key, what in sorted(adapters.items()):
        if not any(adapter_of(m, {key: what}) for m in uses):
            out.append(f"ADAPTERS[{key!r}] names no scanned module: remove it")
        if not what.strip():
            out.append(f"ADAPTERS[{key!r}] says nothing: name the library or system it adapts")
    for module, pin in sorted(budget.items()):
        if module not in uses:
            out.append(f"BUDGET[{module!r}] names no scanned module: remove it")
        elif (key := adapter_of(module, adapters)) is not None:
            out.append(f"BUDGET[{module!r}]: the module is an adapter ({key}); remove its pin")
        if not pin.reason.strip():
            out.append(f"BUDGET[{module!r}] has no reason: say why this module needs what it holds")
    for module, found in sorted(uses.items()):
        if adapter_of(module, adapters):
            continue
        pin = budget.get(module, Budget(0, 0, ""))
        for kind, allowed in (("probe", pin.probes), ("any", pin.anys)):
            got = [u for u in found if u.kind == kind]
            label = "hasattr/getattr" if kind == "probe" else "Any"
            if len(got) > allowed:
                where = ", ".join(str(u) for u in got)
                out.append(
                    f"{module}: {len(got)} {label} where {allowed} are pinned "
                    f"({'no budget' if module not in budget else 'BUDGET'}): {where}; {FIX}"
                )
            elif len(got) < allowed:
                out.append(
                    f"{module}: holds {len(got)} {label} but BUDGET pins {allowed}: lower the pin to "
                    f"{len(got)} (a budget only goes down)"
                )
    return out
