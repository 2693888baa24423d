"""The command line as a new user meets it: shipped configs from any directory, inputs checked before
slow work, one ``error:`` line instead of a traceback, every default in the help."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from rollpacker import cli
from rollpacker.cli import app
from rollpacker.core.config import SHIPPED_CONFIGS, load_config, resolve_config, shipped_configs
from rollpacker.core.errors import ConfigError
from rollpacker.core.paths import writable_dir, writable_file

REPO = Path(__file__).resolve().parents[1]
ROLLPACKER = [sys.executable, "-m", "rollpacker.cli"]


def _run(
    args: list[str], cwd: Path, timeout: float = 60, **env: str
) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    res = subprocess.run(
        [*ROLLPACKER, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
    )
    return res, time.perf_counter() - t0


# --- shipped configs ---------------------------------------------------------------------------


def test_configs_ship_inside_the_package_and_the_repo_links_to_them() -> None:
    import rollpacker

    assert SHIPPED_CONFIGS.parent == Path(rollpacker.__file__).resolve().parent
    names = set(shipped_configs())
    assert {"default", "experiment", "code", "cluster"} <= names
    assert (REPO / "configs").resolve() == SHIPPED_CONFIGS
    assert (REPO / "manifests" / "experiment.yaml").resolve() == SHIPPED_CONFIGS / "cluster.yaml"
    assert 'rollpacker = ["configs/*.yaml", ' in (REPO / "pyproject.toml").read_text()


def test_resolve_config_takes_files_and_shipped_names_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    default = SHIPPED_CONFIGS / "default.yaml"
    assert resolve_config("default") == default
    assert resolve_config("default.yaml") == default
    assert resolve_config("configs/default.yaml") == default  # the README's spelling, elsewhere
    mine = tmp_path / "default.yaml"
    mine.write_text("steps: 3\n")
    assert resolve_config("default.yaml") == mine  # a file here wins over the shipped name
    assert load_config("default.yaml").steps == 3


def test_a_missing_config_names_its_absolute_path_and_the_shipped_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_config("sub/mine.yaml")
    assert str(tmp_path / "sub" / "mine.yaml") in str(e.value)
    assert "default" in str(e.value) and "config show" in str(e.value)
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        resolve_config("d")


def test_config_show_prints_a_shipped_config_and_refuses_unknown_names() -> None:
    res = CliRunner().invoke(app, ["config", "show", "default"])
    assert res.exit_code == 0, res.output
    assert res.output == (SHIPPED_CONFIGS / "default.yaml").read_text()
    res = CliRunner().invoke(app, ["config", "show", "nope"])
    assert res.exit_code == 2 and "no shipped config 'nope'" in res.output and "experiment" in res.output
    res = CliRunner().invoke(app, ["config", "list"])
    assert res.exit_code == 0 and all(name in res.output for name in shipped_configs())


# --- from an empty directory, in a fresh process (what a user types) ------------------------------


def test_compile_works_from_an_empty_directory_and_says_what_it_baked_in(tmp_path: Path) -> None:
    res, _ = _run(["compile", "--out", "./b"], tmp_path, ROLLPACKER_IMAGE_ROLLOUT="reg.local/rollout:dev")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "b" / "rl_experiment.yaml").is_file()
    steps = load_config("experiment").steps
    assert f"chains {steps} steps" in res.stdout
    assert "rollout reg.local/rollout:dev" in res.stdout and "controller ghcr.io/" in res.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["compile", "--out", "/proc/nope"],
        ["bench", "rollout-replay", "--preset", "smoke", "--engine", "fake", "--out", "/proc/nope.json"],
        ["trace", "generate", "--preset", "smoke", "--out", "/proc/nope.jsonl"],
    ],
)
def test_an_unwritable_output_fails_at_once_with_one_error_line(tmp_path: Path, args: list[str]) -> None:
    res, took = _run(args, tmp_path)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr + res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --out /proc/nope"), res.stderr
    assert took < 5
    assert res.stdout == ""  # nothing ran: no table, no progress


def test_an_output_onto_an_existing_file_or_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    res, _ = _run(["compile", "--out", "f"], tmp_path)
    assert res.returncode == 2 and "is a file, not a directory" in res.stderr
    assert "Traceback" not in res.stderr
    res, _ = _run(["trace", "generate", "--preset", "smoke", "--out", "."], tmp_path)
    assert res.returncode == 2 and "it is a directory" in res.stderr


def test_train_refuses_a_bad_policy_before_any_warm_up(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    res, took = _run(["train", "--set", "rollout.policy=nonsense"], tmp_path, ROLLPACKER_CACHE=str(cache))
    assert res.returncode == 2
    assert "rollout.policy = 'nonsense'" in res.stderr and "tail_batching" in res.stderr
    assert "Traceback" not in res.stderr
    assert took < 10
    assert not cache.exists()  # nothing was built or warmed up
    assert not (tmp_path / "build").exists()


# --- errors ------------------------------------------------------------------------------------


def _boom(exc: BaseException):  # type: ignore[no-untyped-def]
    def run() -> None:
        raise exc

    return run


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (PermissionError(13, "Permission denied", "/x/y"), "error: Permission denied: /x/y; check the path"),
        (ConfigError("store.endpoint: no"), "error: store.endpoint: no"),
        (
            ConnectionRefusedError(111, "Connection refused"),
            "error: Connection refused: a service did not answer",
        ),
        (
            KeyError("k"),
            "error: unexpected KeyError: 'k' (a bug in rollpacker: run again with `rollpacker --debug",
        ),
    ],
)
def test_main_turns_any_failure_into_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], exc: BaseException, expected: str
) -> None:
    monkeypatch.setattr(cli, "app", _boom(exc))
    monkeypatch.delenv("ROLLPACKER_DEBUG", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1 and "Traceback" not in err


def test_debug_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "app", _boom(PermissionError(13, "Permission denied", "/x")))
    monkeypatch.setenv("ROLLPACKER_DEBUG", "1")
    with pytest.raises(PermissionError):
        cli.main()


def test_debug_flag_reaches_main(tmp_path: Path) -> None:
    res, _ = _run(["--debug", "trace", "generate", "--preset", "smoke", "--out", "/proc/x/y.jsonl"], tmp_path)
    assert res.returncode == 2 and "error: --out" in res.stderr  # expected failures stay one line


def test_writable_file_and_dir(tmp_path: Path) -> None:
    p = writable_file(tmp_path / "a" / "b" / "r.json")
    assert p == tmp_path / "a" / "b" / "r.json" and p.parent.is_dir() and not p.exists()
    assert list(p.parent.iterdir()) == []  # the probe is gone
    assert writable_dir(tmp_path / "out") == tmp_path / "out" and (tmp_path / "out").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        writable_file(tmp_path / "file" / "r.json")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        writable_dir(tmp_path / "file")
    with pytest.raises(ConfigError, match="is a directory"):
        writable_file(tmp_path / "out", "--report")
    with pytest.raises(ConfigError, match=r"^--out /proc/nope/r.json: cannot write there"):
        writable_file("/proc/nope/r.json")


def test_writable_dir_without_making_it_checks_and_creates_nothing(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b"
    assert writable_dir(out, make=False) == out
    assert list(tmp_path.iterdir()) == []  # neither the directory nor a probe
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        writable_dir(tmp_path / "file" / "sub", make=False)
    with pytest.raises(ConfigError, match=r"^--out /proc/nope/x: cannot write there"):
        writable_dir("/proc/nope/x", make=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


# --- help ----------------------------------------------------------------------------------------


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """Every visible leaf command under ``group``, the lab's (mounted by name) included (typer vendors
    its own click: duck-typed)."""
    out: list[tuple[tuple[str, ...], Any]] = []
    ctx = typer.Context(group)
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        if cmd.hidden:
            continue
        if hasattr(cmd, "commands"):
            out += _commands(cmd, (*path, name))
        else:
            out.append(((*path, name), cmd))
    return out


COMMANDS = _commands(typer.main.get_command(app))


def test_the_command_tree_is_walked() -> None:
    names = {" ".join(p) for p, _ in COMMANDS}
    assert {"train", "run", "compile", "submit", "config show", "model warmup"} <= names
    lab = {"lab bench rollout-replay", "lab bench rollout-task", "lab whatif", "lab soak", "lab chaos"}
    assert lab <= names
    # the lab's older spellings still run, hidden from the help; the split `bench rollout` is hidden too
    assert not {n for n in names if n.split()[0] in ("bench", "whatif", "profile", "soak", "chaos")}
    assert "lab bench rollout" not in names


@pytest.mark.parametrize(("path", "cmd"), COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_option_shows_its_default(path: tuple[str, ...], cmd: Any) -> None:
    res = CliRunner().invoke(app, [*path, "--help"], env={"TERMINAL_WIDTH": "240", "NO_COLOR": "1"})
    assert res.exit_code == 0, res.output
    text = res.output[res.output.find("Options") :]  # the options panel, not the description
    options = [p for p in cmd.params if p.param_type_name == "option" and p.name != "help"]
    # each option's segment of the help: from its flag to the next option's flag
    starts = []
    for p in options:
        m = re.search(rf"(?<![\w-]){re.escape(p.opts[0])}(?![\w-])", text)
        assert m, f"{' '.join(path)}: {p.opts[0]} is not in the help"
        starts.append((m.start(), p))
    starts.sort(key=lambda t: t[0])
    ends = [s for s, _ in starts[1:]] + ([text.index("--help", starts[-1][0])] if starts else [])
    missing = [
        p.opts[0]
        for (start, p), end in zip(starts, ends, strict=True)
        if "[default:" not in text[start:end] and "[required]" not in text[start:end]
    ]
    assert missing == [], f"`rollpacker {' '.join(path)} --help` shows no default for {missing}"
    flat = re.sub(r"[\s│]+", " ", text)
    assert re.search(r"\w \.( |$)", flat) is None, "a help text lost a bracketed part (rich markup)"


# --- model warmup ---------------------------------------------------------------------------------


def test_model_warmup_warms_what_train_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpacker.tasks import warmup
    from rollpacker.tasks.models import warmup_spec

    seen = []

    def fake_warm_up(spec, force=False, progress=None):  # type: ignore[no-untyped-def]
        seen.append(spec)
        (tmp_path / "warmup.json").write_text(json.dumps({"steps": spec.steps}))
        return tmp_path

    monkeypatch.setattr(warmup, "warm_up", fake_warm_up)
    res = CliRunner().invoke(app, ["model", "warmup"])
    assert res.exit_code == 0, res.output
    assert seen[0].key() == warmup_spec(load_config("default")).key()
    assert seen[0].steps == load_config("default").model.warmup_steps
    res = CliRunner().invoke(app, ["model", "warmup", "--config", "experiment", "--steps", "7"])
    assert res.exit_code == 0, res.output
    assert seen[1].steps == 7 and seen[1].task.verbose  # the experiment's task shape
    res = CliRunner().invoke(app, ["model", "warmup", "--steps", "0"])
    assert res.exit_code == 2 and "nothing to warm up" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "5", "--faults", "9"], "--faults 9: at most one fault per arm and step"),
        (["--kinds", "stage,meteor"], "unknown fault kind(s) ['meteor']; known: stage, rollout-actor"),
        (["--steps", "3"], "--steps 3: the chaos suite needs at least 4 steps"),
    ],
)
def test_chaos_refuses_a_bad_schedule_before_starting_anything(
    tmp_path: Path, args: list[str], message: str
) -> None:
    res = CliRunner().invoke(
        app, ["chaos", *args, "--out-dir", str(tmp_path / "c"), "--out", str(tmp_path / "c.json")]
    )
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert not (tmp_path / "c" / "services").exists()


# --- shape ------------------------------------------------------------------------------------------


def _command_functions() -> list[tuple[str, int]]:
    """(file:name, lines of body after the docstring) of every function registered with ``command``."""
    import ast

    out = []
    for f in sorted(
        [*(REPO / "src/rollpacker/cli").glob("*.py"), *(REPO / "src/rollpacker/lab/cli").glob("*.py")]
    ):
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            if not any(
                isinstance(d, ast.Call) and getattr(d.func, "id", "") == "command"
                for d in node.decorator_list
            ):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            assert node.end_lineno is not None
            out.append((f"{f.name}:{node.name}", node.end_lineno - body[0].lineno + 1))
    return out


def test_every_command_is_registered_by_the_wrapper_and_fits_in_40_lines() -> None:
    found = _command_functions()
    assert len(found) == len(COMMANDS) + 1  # every visible command, plus the hidden `bench rollout` stub
    long = [(name, n) for name, n in found if n > 40]
    assert long == [], f"command bodies over 40 lines: {long}"


def test_done_prints_figures_then_one_wrote_line_then_exits_with_its_code(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rollpacker.cli.common import Done

    Done("table", wrote=[Path("a.json"), "b.png", "c.png"], note="(log in x)").show()
    assert capsys.readouterr().out == "table\nwrote a.json, b.png and c.png (log in x)\n"
    with pytest.raises(typer.Exit) as e:
        Done(wrote=[Path("a.json")], code=1).show()
    assert e.value.exit_code == 1 and capsys.readouterr().out == "wrote a.json\n"


def test_the_product_cli_loads_no_lab_module_until_a_lab_command_is_asked_for() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from rollpacker.cli import app\n"
        "r = CliRunner().invoke(app, ['train', '--help']); assert r.exit_code == 0, r.output\n"
        "assert not [m for m in sys.modules if m.startswith('rollpacker.lab')], 'lab loaded'\n"
        "r = CliRunner().invoke(app, ['lab', 'bench', '--help']); assert r.exit_code == 0, r.output\n"
        "assert 'rollpacker.lab.cli' in sys.modules\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
