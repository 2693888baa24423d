"""``rollpacker sandbox``: the nsjail sandbox code rewards run untrusted programs in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rollpacker.core.errors import RollpackerError

from .common import Done, command, flag

sandbox_app = typer.Typer(
    help="The secure code sandbox (nsjail) that code rewards run untrusted programs in.", no_args_is_help=True
)


@command(sandbox_app, "run")
def sandbox_run(
    code: Annotated[Path, typer.Option(help="Python file: the program under test (e.g. a model's answer).")],
    tests: Annotated[
        Path, typer.Option(help="Python file run after the program, in the same interpreter and globals.")
    ],
    timeout_s: Annotated[
        float, typer.Option(help="Wall seconds the tests may run (the program itself gets 5 s before them).")
    ] = 10.0,
    memory_mb: Annotated[int, typer.Option(help="Address-space limit per process in the jail, MB.")] = 512,
    json_out: Annotated[
        bool, flag("--json", "Print the result as JSON (status, exec_s, per-test outcomes).")
    ] = False,
) -> Done:
    """Run a program, then its tests in the same interpreter, in the nsjail sandbox.

    The jail has no network, no host files or environment, and only a 16 MB /scratch to write to.

    It passes when the tests run to their end without an exception (docs/sandbox.md).

    Exit code: 0 passed; 1 failed, timed out or the sandbox failed (status error); 2 usage error.
    """
    from rollpacker.rewards.sandbox import Sandbox, SandboxLimits

    sources: dict[str, str] = {}
    for name, path in (("--code", code), ("--tests", tests)):
        if not path.is_file():
            raise RollpackerError(f"{name} {path}: no such file; give the path of a Python source file")
        sources[name] = path.read_text(encoding="utf-8", errors="replace")
    limits = SandboxLimits(wall_s=timeout_s + 10.0, cpu_s=timeout_s + 5.0, memory_mb=memory_mb, code_s=5.0)
    result = Sandbox(limits).run(sources["--code"], sources["--tests"], timeouts_s=timeout_s)
    if json_out:
        return Done(json.dumps(result.to_dict(), indent=2), code=0 if result.passed else 1)
    lines = [f"status: {result.status.value}   exec_s: {result.exec_s:.3f}   {result.detail}"]
    lines += [
        f"  test {t.index}: {t.status.value} in {t.exec_s:.3f} s {t.detail}".rstrip() for t in result.tests
    ]
    for name, text in (("stdout", result.stdout), ("stderr", result.stderr)):
        if text:
            lines.append(f"--- {name}{' (truncated)' if result.output_truncated else ''}\n{text.rstrip()}")
    return Done("\n".join(lines), code=0 if result.passed else 1)
