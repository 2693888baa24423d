"""The libraries' output to a log file, rollpacker's own lines to the terminal.

vLLM, torch, transformers, Ray and MLflow print warnings, INFO lines and progress bars while a run
starts its engines: through Python ``warnings``, ``logging`` handlers (vLLM's writes to stdout), and
C++ code and subprocesses writing to file descriptors 1 and 2 directly. ``library_output_to(path)``
sends all of it to ``path``: the descriptors are redirected (subprocesses started inside inherit
them), ``sys.stdout`` / ``sys.stderr`` and the handlers bound to them point at the file, and
``warnings`` are written there. Errors (``ERROR`` and above) logged through the root logger are also
shown on the terminal.

rollpacker's own progress lines and bars write to ``console()``: the terminal's stderr, inside the
block as outside. The command's summary is printed after the block, to stdout as usual.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from rollpacker.core.config import ExperimentConfig

_console: TextIO | None = None


def console() -> TextIO:
    """Where rollpacker's own progress goes: the terminal's stderr, also inside ``library_output_to``."""
    return _console or sys.stderr


def log_path(cfg: ExperimentConfig, name: str) -> Path:
    """``<out_dir>/logs/<experiment>/<name>.log``, absolute: the log of a command on ``cfg``
    (``name``: the arm for ``train``, ``run`` for the whole experiment)."""
    return Path(cfg.out_dir).resolve() / "logs" / cfg.experiment / f"{name}.log"


@contextmanager
def library_output_to(path: Path) -> Iterator[None]:
    """Send everything the libraries print while the block runs to ``path`` (appended to, one
    header line per block); say once where. A nested block keeps the outer one's file."""
    global _console
    if _console is not None:
        yield
        return
    path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    old_out, old_err, old_showwarning = sys.stdout, sys.stderr, warnings.showwarning
    old_out.flush()
    old_err.flush()
    term = _own_stream(old_err)
    log_out = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    log_err = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115
    log_err.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    root = logging.getLogger()
    to_log, to_term = logging.StreamHandler(log_err), logging.StreamHandler(term)
    to_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    to_term.setLevel(logging.ERROR)
    term.write(f"[logs] library output (vLLM, torch, MLflow warnings and bars): {path}\n")
    term.flush()
    try:
        _swap_handler_streams({id(old_out): log_out, id(old_err): log_err})
        for fd in (1, 2):
            os.dup2(log_err.fileno(), fd)
        sys.stdout, sys.stderr, _console = log_out, log_err, term
        warnings.showwarning = _warning_to(log_err)
        root.addHandler(to_log)
        root.addHandler(to_term)
        yield
    except Exception:
        term.write(f"[logs] the libraries' output up to the failure: {path}\n")
        raise
    finally:
        root.removeHandler(to_term)
        root.removeHandler(to_log)
        warnings.showwarning = old_showwarning
        sys.stdout, sys.stderr, _console = old_out, old_err, None
        log_out.flush()
        log_err.flush()
        for fd, dup in saved.items():
            os.dup2(dup, fd)
            os.close(dup)
        _swap_handler_streams({id(log_out): old_out, id(log_err): old_err})
        log_out.close()
        log_err.close()
        if term is not old_err:
            term.close()


def _own_stream(stream: TextIO) -> TextIO:
    """A stream on a duplicate of ``stream``'s descriptor (it keeps reaching the terminal when
    descriptor 2 is redirected), or ``stream`` itself when it has none (a test's capture)."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return open(os.dup(fd), "w", buffering=1, encoding=getattr(stream, "encoding", None) or "utf-8")


def _swap_handler_streams(to: dict[int, TextIO]) -> None:
    """Point every logging stream handler that writes to a stream in ``to`` (by id) at its
    replacement: handlers the libraries bound to ``sys.stdout`` / ``sys.stderr`` at import."""
    loggers = [logging.getLogger(), *logging.root.manager.loggerDict.values()]
    for lg in loggers:
        for h in getattr(lg, "handlers", ()):
            # logging's last-resort handler reads sys.stderr each time (no setter): it follows
            last_resort = isinstance(h, type(logging.lastResort))
            if isinstance(h, logging.StreamHandler) and not last_resort and id(h.stream) in to:
                h.setStream(to[id(h.stream)])


def _warning_to(log: TextIO) -> Callable[..., None]:
    """A ``warnings.showwarning`` that writes to ``log``."""

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        log.write(warnings.formatwarning(message, category, filename, lineno, line))

    return show
