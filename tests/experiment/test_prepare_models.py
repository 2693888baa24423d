"""The runners' model preparation before an arm's first step: the start model into the store and,
when the task has judge prompts and no judge model is given, the toy judge's warm-up in the
terminal (the judge service then finds it cached); "cached" said only when it is."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rollpacker import experiment
from rollpacker.core.config import config_from_text


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen: list[Any] = []
    monkeypatch.setattr(experiment, "prepare_arm", lambda cfg, store, arm, **k: seen.append(("start", arm)))
    monkeypatch.setattr(experiment, "judge_model_dir", lambda cfg, quiet: seen.append(("judge", quiet)))
    return seen


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ("task: {name: mixed}", [("start", "sync"), ("judge", False)]),  # judge prompts, the toy judge
        ("task: {name: synthetic_math}", [("start", "sync")]),  # no judge prompts
        ("task: {name: mixed}\nreward: {judge: {model: /models/judge}}", [("start", "sync")]),  # given
    ],
)
def test_the_toy_judge_is_warmed_up_only_for_a_task_with_judge_prompts(calls, config: str, want) -> None:  # type: ignore[no-untyped-def]
    experiment.prepare_models(config_from_text(f"experiment: e\n{config}\n"), "store", "sync")  # type: ignore[arg-type]
    assert calls == want


def test_a_cached_toy_judge_says_cached_and_one_that_trains_shows_a_bar(
    tmp_path: Path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    from rollpacker.rewards.factory import judge_model_dir
    from rollpacker.tasks.judge_task import JudgeWarmupSpec, judge_dir

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path))
    cfg = config_from_text("experiment: e\ntask: {name: mixed}\nreward: {judge: {warmup_steps: 3}}\n")
    out = tmp_path / "trained"

    def warm_up_judge(spec, progress=None):  # type: ignore[no-untyped-def]
        for s in range(spec.steps):
            progress(s, 0.5)
        return out

    monkeypatch.setattr("rollpacker.tasks.judge_task.warm_up_judge", warm_up_judge)
    assert judge_model_dir(cfg, quiet=False) == out
    bar = capsys.readouterr().err
    assert "judge warm-up" in bar and "3/3" in bar and "cached" not in bar
    cached = judge_dir(JudgeWarmupSpec(model="micro", steps=3))
    cached.mkdir(parents=True)
    (cached / "judge.json").write_text("{}")
    assert judge_model_dir(cfg, quiet=False) == cached
    assert capsys.readouterr().err == f"judge warm-up: cached ({cached})\n"
