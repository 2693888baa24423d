"""What every ``rollpacker`` command shares: the one command wrapper and the option types.

A command body parses its options, calls one function below the CLI and returns a :class:`Done`
(the rendered figures, the files written, an exit code). :func:`command` registers it on its group
and owns the rest: an expected failure (``RollpackerError``, a bad value, an unwritable path) becomes
one ``error:`` line and exit code 2, nothing is printed before the work succeeded, then the figures,
then one ``wrote ...`` line.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer

from rollpacker.core.errors import RollpackerError

CONFIG_HELP = "Experiment YAML: a file, or a shipped config by NAME (`rollpacker config list`)."
NO_OVERRIDES = "none"

SetOption = Annotated[
    list[str], typer.Option("--set", help="Override a config key (repeatable).", show_default=NO_OVERRIDES)
]
ConfigOption = Annotated[str, typer.Option(help=CONFIG_HELP)]


def config_option(what: str) -> Any:
    """The --config option of a command that reads ``what`` from the experiment YAML."""
    return typer.Option("--config", help=f"Experiment YAML ({what}): a file, or a shipped config by NAME.")


def flag(name: str, help: str) -> Any:
    """An on/off option spelled ``name`` (off unless given)."""
    return typer.Option(name, help=help, show_default="off")


def shown(help: str, default: str = "none") -> Any:
    """An option whose default is shown as ``default`` (words, not the value: None, "", a rule)."""
    return typer.Option(help=help, show_default=default)


ReportOption = Annotated[Path, typer.Option(help="JSON report path.")]

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Done:
    """What a command did: ``text`` (the rendered figures) is printed first, then one line naming
    the files in ``wrote`` (and ``note`` after them), then the process exits with ``code``."""

    text: str = ""
    wrote: Sequence[Path | str] = ()
    note: str = ""
    code: int = 0

    def show(self) -> None:
        if self.text:
            typer.echo(self.text)
        line = f"wrote {_and(self.wrote)}" if self.wrote else ""
        line = " ".join(s for s in (line, self.note) if s)
        if line:
            typer.echo(line)
        if self.code:
            raise typer.Exit(code=self.code)


def _and(items: Sequence[Path | str]) -> str:
    names = [str(i) for i in items]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def failure(e: BaseException) -> str:
    """One line for a failure: the problem and, where known, what to do."""
    if isinstance(e, RollpackerError):
        return str(e)
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        if isinstance(e, ConnectionError | TimeoutError):
            return f"{e.strerror or e}{where}: a service did not answer; check that it runs (`rollpacker up`)"
        return f"{e.strerror or e}:{where}; check the path and its permissions"
    return (
        f"unexpected {type(e).__name__}: {e} (a bug in rollpacker: run again with "
        "`rollpacker --debug ...` for the traceback and report it)"
    )


def fail(message: str) -> typer.Exit:
    """Print ``error: message`` and return the exit to raise (code 2)."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)


def command(
    group: typer.Typer, name: str, *, expected: tuple[type[Exception], ...] = (), **options: Any
) -> Callable[[Callable[P, Done | None]], Callable[P, Done | None]]:
    """Register ``fn`` as ``group``'s command ``name``: expected failures (``RollpackerError``,
    ``ValueError``, ``OSError`` and ``expected``) become one ``error:`` line and exit code 2; the
    returned :class:`Done` is shown. ``options`` go to ``typer.Typer.command`` (``hidden=True``...)."""
    caught: tuple[type[Exception], ...] = (RollpackerError, ValueError, OSError, *expected)

    def register(fn: Callable[P, Done | None]) -> Callable[P, Done | None]:
        @functools.wraps(fn)
        def run(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                done = fn(*args, **kwargs)
            except typer.Exit:
                raise
            except caught as e:
                raise fail(str(e) if isinstance(e, ValueError) else failure(e)) from None
            if done is not None:
                done.show()

        group.command(name, **options)(run)
        return fn

    return register


def config_path(value: str) -> Path:
    """The --config value as an absolute path (a file, or a shipped config by name)."""
    from rollpacker.core.config import resolve_config

    return resolve_config(value)


def parse_sets(sets: list[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` items as config overrides (values parsed as YAML)."""
    import yaml

    out: dict[str, object] = {}
    for item in sets:
        if "=" not in item:
            raise typer.BadParameter(f"--set {item!r}: use KEY=VALUE, e.g. --set rollout.policy=sync")
        k, v = item.split("=", 1)
        out[k.strip()] = yaml.safe_load(v)
    return out


def comma_list(value: str) -> list[str]:
    """A comma-separated option as its non-empty items."""
    return [x.strip() for x in value.split(",") if x.strip()]


def say(prefix: str = "") -> Callable[[str], None]:
    """A progress line printer to the terminal (stderr, or the console when library output is
    redirected to a log file), each line under ``prefix``."""
    from rollpacker.logs import console

    def _say(line: str) -> None:
        print(f"{prefix}{line}", file=console(), flush=True)

    return _say


def mlflow_look(uri: str) -> str:
    """How to look at a tracking URI: the server's address, or the `mlflow ui` command for a
    database file (its path made absolute, so the line works from any directory)."""
    from rollpacker.core.redact import redact_uri

    if uri.startswith("http"):
        return redact_uri(uri)  # a password in the URL is not printed
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = f"sqlite:///{Path(uri.removeprefix('sqlite:///')).absolute()}"
    exe = Path(sys.executable).parent / "mlflow"  # the venv's, beside this interpreter
    return f"{exe.absolute() if exe.exists() else 'mlflow'} ui --backend-store-uri {uri}"
