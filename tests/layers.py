"""An import-graph checker for the project's own modules (test support, not shipped).

It parses every ``.py`` under the given package roots with ``ast`` (nothing is imported or run),
collects every import of a module under those roots — module-level, function-local, inside
``if TYPE_CHECKING:`` or ``try:`` alike, plus ``importlib.import_module("...")`` and
``__import__("...")`` with a literal name — resolves relative imports, and reports:

- upward imports: a module importing a module of a higher layer; imports within one layer are
  allowed (also between different packages of that layer) unless the pair is listed as forbidden;
- imports of a wing (a package kept apart from the product, like the lab) by any module outside it,
  whatever the layers say;
- modules the layer table does not place (a new package must be given a layer);
- cycles between modules (a strongly connected component of more than one module) and cycles
  between packages (each module collapsed to its package, ``rollpacker.X``).

Third-party imports are ignored: this is only about the project's own modules.

    graph = scan([Path("src/rollpacker"), Path("components"), Path("pipelines")], base=Path("."))
    for v in upward_imports(graph, layers, forbidden): print(v)
    for c in module_cycles(graph) + package_cycles(graph): print(c)

A layer table maps a module name to its rank (0 = lowest). A key places that module and everything
under it; the longest key wins. A key written ``"=name"`` places only ``name`` itself: ``"=rollpacker"``
ranks the package's ``__init__`` without ranking a new ``rollpacker.X``, which is reported as unplaced.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FIX_UPWARD = "move the code down or pass it in (a parameter, a callback, a Protocol in the lower layer)"
FIX_WING = "the product never depends on a wing: move what it needs out of the wing, or pass it in"
FIX_CYCLE = "break it: move the shared code into the lower module, or pass it in"


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``imported`` at ``path:line`` (both are module names)."""

    importer: str
    imported: str
    path: str
    line: int


@dataclass
class Graph:
    """The project's modules (name -> file) and their imports of each other."""

    roots: tuple[str, ...]  # the root package names ("rollpacker", "components", ...)
    modules: dict[str, str] = field(default_factory=dict)
    imports: list[Import] = field(default_factory=list)

    def edges(self, unit: int | None = None) -> dict[tuple[str, str], list[Import]]:
        """(importer, imported) -> the import statements; ``unit`` = 2 collapses modules to
        ``root.X`` packages first. Self-edges are dropped."""
        out: dict[tuple[str, str], list[Import]] = {}
        for imp in self.imports:
            a, b = imp.importer, imp.imported
            if unit is not None:
                a, b = package_of(a, unit), package_of(b, unit)
            elif b not in self.modules:
                continue  # an import of something not scanned (a missing module)
            if a != b:
                out.setdefault((a, b), []).append(imp)
        return out


@dataclass(frozen=True)
class Violation:
    kind: str  # "upward" | "forbidden" | "wing"
    imp: Import
    importer_layer: int
    imported_layer: int

    def __str__(self) -> str:
        i = self.imp
        tail = {
            "upward": FIX_UPWARD,
            "forbidden": "this pair is listed as forbidden; " + FIX_UPWARD,
            "wing": f"{i.imported} is in a wing; {FIX_WING}",
        }[self.kind]
        return (
            f"{i.path}:{i.line}: {i.importer} (layer {self.importer_layer}) imports {i.imported} "
            f"(layer {self.imported_layer}): {self.kind} import; {tail}"
        )


@dataclass(frozen=True)
class Cycle:
    kind: str  # "module" | "package"
    members: tuple[str, ...]  # the whole strongly connected component, sorted
    path: tuple[str, ...]  # one cycle through it: path[0] -> path[1] -> ... -> path[0]
    evidence: tuple[Import, ...]  # one import statement per edge of ``path``

    def __str__(self) -> str:
        arrow = " -> ".join((*self.path, self.path[0]))
        lines = [f"{self.kind} cycle: {arrow} ({FIX_CYCLE})"]
        lines += [f"    {i.path}:{i.line}: {i.importer} imports {i.imported}" for i in self.evidence]
        if len(self.members) > len(self.path):
            lines.append(
                f"    (the component also holds: {', '.join(sorted(set(self.members) - set(self.path)))})"
            )
        return "\n".join(lines)


# -- scanning -------------------------------------------------------------------------------------
def scan(roots: Sequence[Path], base: Path | None = None) -> Graph:
    """Parse every ``.py`` under each root directory; a root's directory name is its package name.
    Paths in reports are relative to ``base`` when given."""
    graph = Graph(roots=tuple(r.name for r in roots))
    files = list(python_files(roots, base))
    graph.modules.update((name, shown) for name, _, shown, _ in files)
    for name, f, _, is_pkg in files:
        tree = ast.parse(f.read_text(encoding="utf-8"), filename=str(f))
        for target, line in _imports_of(tree, name, is_pkg, graph.modules):
            if target.split(".")[0] in graph.roots:
                graph.imports.append(
                    Import(name, _known_prefix(target, graph.modules), graph.modules[name], line)
                )
    return graph


def python_files(roots: Sequence[Path], base: Path | None = None) -> Iterator[tuple[str, Path, str, bool]]:
    """(module name, file, path shown in reports, is a package ``__init__``) of every ``.py`` under
    each root, in order; a root's directory name is its package name."""
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root.parent).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            shown = str(f.relative_to(base)) if base is not None else str(f)
            yield ".".join(parts), f, shown, rel.name == "__init__"


def _imports_of(
    tree: ast.AST, module: str, is_pkg: bool, known: Mapping[str, str]
) -> Iterator[tuple[str, int]]:
    """(imported module name, line) for every import anywhere in ``tree``."""
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            src = resolve_relative(package, node.level, node.module)
            for alias in node.names:
                sub = f"{src}.{alias.name}"
                yield (sub if sub in known else src), node.lineno
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield arg.value, node.lineno


def resolve_relative(package: str, level: int, module: str | None) -> str:
    """``from <level dots><module> import ...`` inside ``package`` -> the absolute module name."""
    if level == 0:
        return module or ""
    parts = package.split(".")
    if level - 1 >= len(parts):
        raise ValueError(f"relative import of level {level} goes above the top package {package!r}")
    head = parts[: len(parts) - (level - 1)]
    return ".".join([*head, module] if module else head)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def _known_prefix(name: str, known: Mapping[str, str]) -> str:
    """The longest prefix of ``name`` that is a scanned module (``a.b.func`` -> ``a.b``)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in known:
            return cand
    return name


def package_of(module: str, unit: int = 2) -> str:
    """``rollpacker.core.policies.sync`` -> ``rollpacker.core`` (the first ``unit`` parts)."""
    return ".".join(module.split(".")[:unit])


# -- layers -----------------------------------------------------------------------------------------
def layer_of(module: str, layers: Mapping[str, int]) -> int | None:
    """The rank of the longest key that is ``module`` or a package above it (``"=name"`` keys match
    only ``name``); None when no key places it."""
    best: tuple[int, int] | None = None
    for key, rank in layers.items():
        exact = key.startswith("=")
        name = key.removeprefix("=")
        if (module == name or (not exact and module.startswith(name + "."))) and (
            best is None or len(name) > best[0]
        ):
            best = (len(name), rank)
    return None if best is None else best[1]


def unplaced(graph: Graph, layers: Mapping[str, int]) -> list[str]:
    """A message for each scanned or imported module that no layer-table key places."""
    where = {i.imported: f"{i.path}:{i.line} (imported by {i.importer})" for i in reversed(graph.imports)}
    where.update({m: f"{p}:1" for m, p in graph.modules.items()})
    return [
        f"{loc}: {m} has no layer; add it to the layer table at the rank its imports allow"
        for m, loc in sorted(where.items())
        if layer_of(m, layers) is None
    ]


def upward_imports(
    graph: Graph, layers: Mapping[str, int], forbidden: Iterable[tuple[str, str]] = ()
) -> list[Violation]:
    """Every import of a higher layer, or of a forbidden (importer prefix, imported prefix) pair
    (imports of or by unplaced modules are left to ``unplaced``)."""

    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    pairs = list(forbidden)
    out: list[Violation] = []
    for imp in graph.imports:
        la = layer_of(imp.importer, layers)
        lb = layer_of(imp.imported, layers)
        if la is None or lb is None:
            continue
        if lb > la:
            out.append(Violation("upward", imp, la, lb))
        elif any(under(imp.importer, a) and under(imp.imported, b) for a, b in pairs):
            out.append(Violation("forbidden", imp, la, lb))
    return out


def wing_imports(graph: Graph, layers: Mapping[str, int], wings: Iterable[str]) -> list[Violation]:
    """Every import of a module under a wing (a package prefix) by a module outside that wing."""
    out: list[Violation] = []
    for imp in graph.imports:
        for wing in wings:
            inside = imp.importer == wing or imp.importer.startswith(wing + ".")
            if not inside and (imp.imported == wing or imp.imported.startswith(wing + ".")):
                la, lb = layer_of(imp.importer, layers), layer_of(imp.imported, layers)
                out.append(Violation("wing", imp, -1 if la is None else la, -1 if lb is None else lb))
    return out


def report(
    graph: Graph,
    layers: Mapping[str, int],
    forbidden: Iterable[tuple[str, str]] = (),
    wings: Iterable[str] = (),
) -> list[str]:
    """Every finding as one message: unplaced modules, upward and wing imports, module and package
    cycles."""
    found = [*unplaced(graph, layers), *map(str, upward_imports(graph, layers, forbidden))]
    found += map(str, wing_imports(graph, layers, wings))
    return found + [str(c) for c in module_cycles(graph) + package_cycles(graph)]


# -- cycles -----------------------------------------------------------------------------------------
def module_cycles(graph: Graph) -> list[Cycle]:
    return _cycles("module", graph.edges())


def package_cycles(graph: Graph, unit: int = 2) -> list[Cycle]:
    return _cycles("package", graph.edges(unit))


def _cycles(kind: str, edges: Mapping[tuple[str, str], list[Import]]) -> list[Cycle]:
    succ: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        succ.setdefault(a, []).append(b)
        succ.setdefault(b, [])
    out = []
    for comp in strongly_connected(succ):
        if len(comp) < 2:
            continue
        path = _shortest_cycle(comp, succ)
        hops = zip(path, (*path[1:], path[0]), strict=True)
        evidence = tuple(min(edges[hop], key=lambda i: (i.path, i.line)) for hop in hops)
        out.append(Cycle(kind, tuple(sorted(comp)), path, evidence))
    return out


def strongly_connected(succ: Mapping[str, Sequence[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iterative (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                comps.append(sorted(comp))
    return comps


def _shortest_cycle(comp: Sequence[str], succ: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """A shortest cycle through the component's first node (breadth-first, inside the component)."""
    members = set(comp)
    start = comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in succ[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return tuple(reversed(path))
                if w in members and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{comp} is not strongly connected")  # unreachable for a Tarjan component
