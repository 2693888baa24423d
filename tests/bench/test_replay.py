from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rollpacker.bench.replay import BenchConfig, render_table, run_benchmark
from rollpacker.cli import app
from rollpacker.core.config import RolloutConfig
from rollpacker.core.trace import PRESETS, generate
from rollpacker.engines.fake import FakeEngine


def _bench(per_seq_s: float):
    eng = FakeEngine(concurrency=64, base_s=0.003, per_seq_s=per_seq_s)
    cfg = BenchConfig(RolloutConfig(prompts_per_step=8, responses_per_prompt=4), periods=2)
    return run_benchmark(eng, generate(PRESETS["smoke"], seed=1), cfg, source="smoke")


def test_both_policies_train_the_same_prompts_in_as_many_steps() -> None:
    rep = _bench(0.0)
    sync, tb = rep["policies"]["sync"], rep["policies"]["tail_batching"]
    assert rep["trained_prompts_identical"] is True
    assert sync["steps"] == tb["steps"] and tb["long_rounds"] == 2
    assert sync["tokens_wasted"] == 0 and tb["tokens_wasted"] > 0
    for s in (sync, tb):
        assert s["tokens_generated"] == s["tokens_useful"] + s["tokens_wasted"] == s["engine_tokens"]
        assert 0 <= s["bubble_ratio"] <= 1 and 0 < s["efficiency"] <= 1.0 + 1e-9
        assert {"speedup", "bubble_ratio", "efficiency", "tokens_generated", "tokens_wasted"} <= set(s)
    # On a memory-bound (flat) engine tail batching must pay on a long-tailed trace.
    assert tb["speedup"] > 1.3
    assert tb["bubble_ratio"] < sync["bubble_ratio"]
    assert "tail_batching" in render_table(rep)


def test_flatter_engines_gain_more() -> None:
    assert (
        _bench(0.0)["policies"]["tail_batching"]["speedup"]
        > _bench(0.0005)["policies"]["tail_batching"]["speedup"]
    )


def test_cli_runs_on_a_trace_file_and_writes_json(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(r.to_json() + "\n" for r in generate(PRESETS["smoke"], seed=5)))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "rollout",
            "--engine",
            "fake",
            "--trace",
            str(trace),
            "--p0",
            "4",
            "--r0",
            "2",
            "--max-tokens",
            "64",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert set(rep["policies"]) == {"sync", "tail_batching"}
    assert [p["batch"] for p in rep["batch_scaling"]] == [1, 8, 32, 128]  # Q=128 is in the curve


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eta-p", "0.8"], "eta_p"),
        (["--p0", "0"], "prompts_per_step"),
        (["--r0", "5"], "launch 7 responses"),
        (["--trace", "/nonexistent.jsonl"], "does not exist"),
        (["--preset", "nope"], "unknown preset"),
    ],
)
def test_cli_rejects_bad_input_with_a_named_message(args, message) -> None:
    res = CliRunner().invoke(app, ["bench", "rollout", "--engine", "fake", "--preset", "smoke", *args])
    assert res.exit_code == 2
    assert message in res.output


def test_cli_names_the_bad_trace_line(tmp_path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"prompt_id": "a", "prompt_len": 3, "response_lens": [5, 6, 7, 8, 9]}\n{"prompt_id": 3}\n'
    )
    res = CliRunner().invoke(app, ["bench", "rollout", "--engine", "fake", "--trace", str(trace)])
    assert res.exit_code == 2
    assert "bad.jsonl:2" in res.output and "prompt_id" in res.output
