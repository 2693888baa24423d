"""``rollpacker config``: the example configs shipped with rollpacker."""

from __future__ import annotations

from typing import Annotated

import typer

from rollpacker.core.errors import RollpackerError

from .common import Done, command

config_app = typer.Typer(help="The example configs shipped with rollpacker.", no_args_is_help=True)


@command(config_app, "list")
def config_list() -> Done:
    """The shipped configs: name, path and what each is for (its first comment line)."""
    from rollpacker.core.config import shipped_configs

    rows = [f"{name:<11} {summary(path.read_text())}" for name, path in shipped_configs().items()]
    tail = "\nuse one with --config NAME; `rollpacker config show NAME > my.yaml` to start your own"
    return Done("\n".join(rows) + "\n" + tail)


def summary(text: str, width: int = 100) -> str:
    """A config's first sentence, from its leading comment block, cut to ``width`` characters."""
    lines = []
    for ln in text.splitlines():
        if not ln.startswith("#"):
            break
        lines.append(ln.lstrip("# ").strip())
    sentence = " ".join(lines).split(". ")[0].split(": `")[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


@command(config_app, "show")
def config_show(
    name: Annotated[str, typer.Argument(help="A shipped config's name (`rollpacker config list`).")],
) -> None:
    """Print a shipped config (with its comments): `rollpacker config show default > my.yaml`."""
    from rollpacker.core.config import shipped_configs

    shipped = shipped_configs()
    if name.removesuffix(".yaml") not in shipped:
        raise RollpackerError(f"no shipped config {name!r}; use one of {', '.join(shipped)}")
    typer.echo(shipped[name.removesuffix(".yaml")].read_text(), nl=False)
