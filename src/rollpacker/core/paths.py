"""Output paths checked before any slow work: a benchmark or a compile must not run for minutes and
then lose its result to a path it cannot write.

``writable_file`` and ``writable_dir`` create the missing parent directories (they would be
created by the write anyway; ``writable_dir(..., make=False)`` creates nothing and probes the
nearest existing directory), then probe the target directory by creating and removing a
uniquely named empty file in it: the only test that holds for every file system and every user
(``os.access`` says yes to root on a read-only mount or in ``/proc``). A failure raises
``ConfigError`` naming the option, the absolute path, the cause and what to do.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from rollpacker.core.errors import ConfigError


def _cannot(what: str, p: Path, why: str) -> ConfigError:
    return ConfigError(f"{what} {p}: cannot write there ({why}); choose a path in a writable directory")


def _probe_dir(what: str, d: Path, target: Path) -> None:
    try:
        d.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rollpacker-probe-", dir=d)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError:
        raise _cannot(what, target, f"{d} or a directory above it is a file") from None
    except OSError as e:
        raise _cannot(what, target, e.strerror or str(e)) from e


def writable_file(path: str | os.PathLike[str], what: str = "--out") -> Path:
    """``path`` as an absolute path, once a file can be written there (not a directory; its
    directory exists or was made, and takes a new file)."""
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        raise _cannot(what, p, "it is a directory; give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise _cannot(what, p, "the file exists and is read-only")
    _probe_dir(what, p.parent, p)
    return p


def writable_dir(path: str | os.PathLike[str], what: str = "--out", make: bool = True) -> Path:
    """``path`` as an absolute path, once it is a directory that takes new files (made if missing).
    ``make=False``: only once it could be made and take them: nothing is created (the command
    makes it after its other checks, so a refused command leaves no empty directory)."""
    p = Path(path).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise _cannot(what, p, "it is a file, not a directory")
    if make:
        _probe_dir(what, p, p)
        return p
    nearest = next(d for d in (p, *p.parents) if d.exists())
    if not nearest.is_dir():
        raise _cannot(what, p, f"{nearest} or a directory above it is a file")
    _probe_dir(what, nearest, p)  # an existing directory: the probe file is removed, nothing is made
    return p
