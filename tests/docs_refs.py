"""What README.md and docs/*.md name, and whether it exists (test support for tests/test_docs.py).

The docs are parsed, not grepped: fenced code blocks and inline code spans are told apart from
prose, and each kind of reference is read where it is written:

- **paths**: in code spans and fenced blocks, a word with a file extension, ending in ``/``, or
  starting with a top-level folder of the repository (``src/``, ``tests/``, ``docs/``, ...);
  in prose, a word starting with such a folder; and markdown link targets. A path resolves
  against the repository root, ``src/rollpacker/``, ``src/``, ``docs/`` or ``tests/``; a bare
  file name (no ``/``) is found anywhere in the tree. Placeholders (``<stage>``, ``*``, ``$X``,
  ``{a,b}``), URLs and what runs write (``build/``, absolute paths, store keys) are not paths;
- **commands**: ``rollpacker WORD [WORD]`` where a shell would run it (a line's or a code span's
  start, after ``&&``, ``|``, ``;``, ``$(``) in a code span or a shell block, checked against the
  CLI's own command tree (a group's subcommand too), and each ``--option`` after it against that
  command's options;
- **make targets**: ``make TARGET`` (placed as a command is) in a code span or a shell block,
  against the Makefile's rules;
- **config keys**: a code span ``section.key[.key...]`` (optionally ``=value`` or ``: value``),
  or a ``--set section.key=value`` in a span or a shell block, whose first part is a section of the
  experiment config, walked through the config's frozen dataclasses (``core/config.py``).

Nothing here imports more than the CLI's command tree and the config schema.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_DIRS = (
    "src",
    "tests",
    "docs",
    "configs",
    "components",
    "pipelines",
    "images",
    "manifests",
    "requirements",
)
EXTENSIONS = ("py", "md", "yaml", "yml", "toml", "json", "jsonl", "txt", "env", "sh", "cfg", "ini", "lock")
BASES = ("", "src/rollpacker/", "src/", "docs/", "tests/", "manifests/")
OUTPUT_DIRS = ("build", "dist")  # what runs and builds write (git-ignored), never a doc's claim on the tree
SHELL_LANGS = ("", "bash", "sh", "shell", "console", "text")

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PROSE_PATH = re.compile(r"(?<![\w./:-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*[\w/])")
_WORD_PATH = re.compile(r"^[\w.-]+(?:/[\w.-]+)*/?$")
# a command where a shell would run it: at the start (after a prompt and VAR=value assignments, a
# path like .venv/bin/) or after && || ; | ( $(
_AT = r"(?:^\s*(?:\$\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*|(?:&&|\|\||;|\||\$?\()\s*)(?:[\w./-]*/)?"
_COMMAND = re.compile(_AT + r"rollpacker((?:\s+[^\s|;&)`]+)*)")
_MAKE = re.compile(_AT + r"make\s+(.*)$")
_SET = re.compile(r"--set[ =]['\"]?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=")
_KEY = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)\s*(?:=.*|:\s.*|:)?$")


@dataclass(frozen=True)
class Ref:
    """A name a doc uses: ``kind`` is path | command | make | key."""

    doc: str
    line: int
    kind: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}: {self.kind} {self.text!r}"


@dataclass(frozen=True)
class Chunk:
    """A piece of a doc: prose (code spans removed), a code span, or a fenced block's line."""

    doc: str
    line: int
    kind: str  # prose | span | block
    lang: str
    text: str


def doc_files(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def chunks(path: Path, repo: Path = REPO) -> Iterator[Chunk]:
    """The doc cut into prose, code spans and fenced-block lines, each with its line number."""
    name = str(path.relative_to(repo))
    fence: str | None = None
    lang = ""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence, lang = m.group(1), m.group(2).lower()
            continue
        if fence is not None:
            if line.strip().startswith(fence[0] * 3) and not line.strip().strip(fence[0]):
                fence = None
            else:
                yield Chunk(name, n, "block", lang, line)
            continue
        for s in _SPAN.finditer(line):
            yield Chunk(name, n, "span", "", s.group(2).strip())
        yield Chunk(name, n, "prose", "", _SPAN.sub(" ", line))


# -- references -----------------------------------------------------------------------------------
def _path_word(word: str) -> str | None:
    """``word`` as a repository path, or None when it is not one (or a placeholder, URL, output)."""
    word = word.strip(".,;:'\"()[]")
    word = re.sub(r"::.*$", "", word)  # tests/x.py::test_name
    word = re.sub(r":\d+(?:-\d+)?$", "", word)  # file.py:12
    if not word or not _WORD_PATH.match(word) or word.startswith(("/", "~", ".")):
        return None
    if "." in word.rsplit("/", 1)[-1]:
        ext = word.rsplit(".", 1)[-1]
        if ext in EXTENSIONS:
            return word
        return None
    if word.endswith("/") or (word.split("/")[0] in TOP_DIRS and "/" in word):
        return word
    return None


def refs(path: Path, repo: Path = REPO) -> Iterator[Ref]:
    for c in chunks(path, repo):
        if c.kind == "prose":
            for m in _PROSE_PATH.finditer(c.text):
                if (p := _path_word(m.group(1))) is not None:
                    yield Ref(c.doc, c.line, "path", p)
            for m in _LINK.finditer(c.text):
                target = m.group(1).split("#")[0]
                if target and "://" not in target and not target.startswith("mailto:"):
                    yield Ref(c.doc, c.line, "path", _link_target(c.doc, target))
            continue
        shell = c.kind == "span" or c.lang in SHELL_LANGS
        if c.kind == "span" or c.lang in (*SHELL_LANGS, "yaml", "makefile"):
            for word in re.split(r"[\s=,]+", c.text):
                if (p := _path_word(word)) is not None:
                    yield Ref(c.doc, c.line, "path", p)
        if shell:
            for m in _COMMAND.finditer(c.text):
                yield Ref(c.doc, c.line, "command", ("rollpacker" + m.group(1)).strip())
            for m in _MAKE.finditer(c.text):
                for word in _make_words(m.group(1)):
                    yield Ref(c.doc, c.line, "make", word)
            for m in _SET.finditer(c.text):  # --set train.lr=1e-4
                yield Ref(c.doc, c.line, "key", m.group(1))
        if c.kind == "span" and (k := _KEY.match(c.text)) is not None and _path_word(k.group(1)) is None:
            yield Ref(c.doc, c.line, "key", k.group(1))


def _make_words(rest: str) -> list[str]:
    """The targets of ``make ...`` (variable assignments and options left out), up to ``&&``/``|``."""
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:
        words = rest.split()
    out = []
    for w in words:
        if w in ("&&", "||", "|", ";", ")") or not re.fullmatch(r"[\w.=-]+|\S+=.*", w):
            break
        if "=" not in w and not w.startswith("-"):
            out.append(w)
    return out


def _link_target(doc: str, target: str) -> str:
    """A link target as a path from the repository root (docs link relative to their folder)."""
    base = Path(doc).parent
    parts: list[str] = list(base.parts)
    for part in Path(target).parts:
        if part == "..":
            parts = parts[:-1]
        elif part != ".":
            parts.append(part)
    return "/".join(parts) + ("/" if target.endswith("/") else "")


def all_refs(repo: Path = REPO) -> list[Ref]:
    return [r for p in doc_files(repo) for r in refs(p, repo)]


# -- what exists ----------------------------------------------------------------------------------
def repo_files(repo: Path = REPO) -> set[str]:
    """Every tracked or untracked-but-not-ignored file, and every folder above one (``a/b/``)."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    files = {f for f in out if f and (repo / f).exists()}
    dirs = {"/".join(f.split("/")[:i]) + "/" for f in files for i in range(1, f.count("/") + 1)}
    return files | dirs


def claims_tree(p: str, files: set[str]) -> bool:
    """Whether the doc's path ``p`` is a claim on this repository's tree: its first folder is one
    of the tree's (under a base), or, for a bare name, a Python module or a doc. Other paths name
    store keys (``state/step-N.json``), outputs (``build/``), files inside a checkpoint or a
    sandbox (``trainer.json``) or third-party code (``vllm/...``), which this test cannot see."""
    head = p.split("/")[0]
    if head in OUTPUT_DIRS:
        return False
    if "/" not in p.rstrip("/"):
        return p.endswith((".py", ".md"))
    return any(b + head + "/" in files for b in BASES)


def path_exists(p: str, files: set[str]) -> bool:
    if "/" not in p.rstrip("/"):  # a bare name: anywhere in the tree
        return any(f == p or f.endswith("/" + p) for f in files)
    return any(b + p in files or (b + p).rstrip("/") + "/" in files for b in BASES)


def make_targets(repo: Path = REPO) -> set[str]:
    text = (repo / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M)}


@dataclass(frozen=True)
class Command:
    """One CLI command: its options, and its subcommands when it is a group."""

    options: frozenset[str]
    sub: dict[str, Command]
    hidden: bool = False  # an older spelling that still runs, not listed in --help


def cli_tree() -> Command:
    """The ``rollpacker`` command tree, read from the CLI itself (click under typer)."""
    import typer

    from rollpacker import cli

    root = typer.main.get_command(cli.app)

    def walk(cmd: typing.Any) -> Command:  # a click command (typer vendors its own click)
        opts = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")}
        subs: dict[str, Command] = {}
        if hasattr(cmd, "list_commands"):  # a group: its commands as the CLI lists them (the lab's
            ctx = typer.Context(cmd)  # group is mounted by name, not held in ``commands``)
            subs = {n: walk(cmd.get_command(ctx, n)) for n in cmd.list_commands(ctx)}
        return Command(frozenset(opts | {"--help"}), subs, bool(getattr(cmd, "hidden", False)))

    return walk(root)


def check_command(text: str, tree: Command) -> str | None:
    """Why ``rollpacker ...`` names no command (or an option it lacks), or None."""
    try:
        words = shlex.split(text, comments=True)[1:]
    except ValueError:
        words = text.split()[1:]
    cmd, path = tree, ["rollpacker"]
    for i, w in enumerate(words):
        if w in ("...", "…"):
            break  # "rollpacker lab ...": any command of that group
        if w.startswith("-"):
            opt = w.split("=")[0]
            if opt not in cmd.options and not cmd.sub:
                return f"{' '.join(path)} has no option {opt} (it has {', '.join(sorted(cmd.options))})"
            continue
        if not cmd.sub:
            continue  # an argument, or an option's value
        if w not in cmd.sub:
            if i > 0 and words[i - 1].startswith("-"):
                continue  # an option's value
            return f"{' '.join(path)} has no command {w!r} (it has {', '.join(sorted(cmd.sub))})"
        cmd, path = cmd.sub[w], [*path, w]
    return None


def check_key(key: str, root: type) -> str | None:
    """Why ``section.key...`` is not a key of the config schema ``root``, or None."""
    tp: object = root
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
            return f"{'.'.join(parts[:i])} is not a section"
        hints = typing.get_type_hints(tp)
        if part not in hints:
            known = ", ".join(f.name for f in dataclasses.fields(tp))
            where = ".".join(parts[:i]) or "the top level"
            return f"{where} has no key {part!r} (it has {known})"
        tp = hints[part]
    return None


def sections(root: type) -> set[str]:
    """The experiment config's sections: top-level fields that are dataclasses."""
    hints = typing.get_type_hints(root)
    return {n for n, t in hints.items() if isinstance(t, type) and dataclasses.is_dataclass(t)}
