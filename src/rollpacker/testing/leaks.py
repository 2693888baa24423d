"""Find planted secrets in what a run left behind: files, directory trees, captured text.

A test plants known secrets (S3 keys, MLflow credentials, tokens in the environment), runs
rollpacker, then calls ``find_leaks`` over every output: log files, the MLflow database and
artifacts, compiled pipeline YAML, the object store's files, captured stdout/stderr and error
messages. A secret counts as leaked in any of the forms it could be written in: as it is, URL-quoted,
base64 (an ``Authorization: Basic`` header), JSON-escaped, or as UTF-16 (a Windows-style dump).

Invariants (tests/test_secrets.py):
- every occurrence of a secret in one of those forms, in any file under a given root (binary files,
  SQLite databases and compressed-looking files included: they are searched as bytes), is reported
  with where it was found; a file that cannot be read is reported too, never skipped silently;
- secrets shorter than ``MIN_SECRET_CHARS`` are refused (they would match by chance).
"""

from __future__ import annotations

import base64
import json
import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

MIN_SECRET_CHARS = 12


@dataclass(frozen=True)
class Leak:
    secret: str  # the secret's name (never its value)
    where: str  # a file path, or the label of a captured text
    form: str  # raw | url | base64 | json | utf-16 | unreadable
    offset: int = -1  # byte offset of the first match


def _forms(value: str) -> dict[str, bytes]:
    raw = value.encode()
    forms = {
        "raw": raw,
        "url": urllib.parse.quote(value, safe="").encode(),
        "json": json.dumps(value)[1:-1].encode(),
        "utf-16": value.encode("utf-16-le"),
    }
    # base64 of the secret at each of the three alignments it can have inside a longer payload
    for shift in range(3):
        enc = base64.b64encode(b"\0" * shift + raw)[4 * ((shift + 2) // 3) if shift else 0 :]
        forms[f"base64/{shift}"] = enc[: max(MIN_SECRET_CHARS, len(enc) - 4)]
    return {k: v for k, v in forms.items() if len(v) >= MIN_SECRET_CHARS}


def _check(secrets: Mapping[str, str]) -> dict[str, dict[str, bytes]]:
    out = {}
    for name, value in secrets.items():
        if len(value) < MIN_SECRET_CHARS:
            raise ValueError(f"secret {name!r} is {len(value)} characters: plant at least {MIN_SECRET_CHARS}")
        out[name] = _forms(value)
    return out


def _scan_bytes(data: bytes, where: str, forms: dict[str, dict[str, bytes]]) -> list[Leak]:
    found = []
    for name, by_form in forms.items():
        for form, needle in by_form.items():
            at = data.find(needle)
            if at >= 0:
                found.append(Leak(name, where, form.split("/")[0], at))
                break  # one form per secret and place is enough to report it
    return found


def find_leaks(
    secrets: Mapping[str, str],
    paths: Iterable[str | os.PathLike[str]] = (),
    texts: Mapping[str, str | bytes] | None = None,
) -> list[Leak]:
    """Every place a secret of ``secrets`` (name -> value) occurs: in the files under ``paths``
    (files or directories, recursively; symlinks not followed) and in ``texts`` (label -> text)."""
    forms = _check(secrets)
    leaks: list[Leak] = []
    for label, text in (texts or {}).items():
        data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
        leaks += _scan_bytes(data, label, forms)
    for root in paths:
        for f in _files(Path(root)):
            try:
                data = f.read_bytes()
            except OSError as e:
                leaks.append(Leak("(unreadable)", f"{f}: {e.strerror}", "unreadable"))
                continue
            leaks += _scan_bytes(data, str(f), forms)
    return leaks


def _files(root: Path) -> Iterable[Path]:
    if root.is_symlink() or not root.exists():
        return
    if root.is_file():
        yield root
        return
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                yield p


def describe(leaks: Iterable[Leak]) -> str:
    """One line per leak (secret names and places, never the values), for an assertion message."""
    return "\n".join(f"{lk.secret} ({lk.form}) in {lk.where} at byte {lk.offset}" for lk in leaks)
