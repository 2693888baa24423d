from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rollpacker.bench.replay import (
    ALL_POLICIES,
    SORTEDRL_PAPER_BUBBLE,
    BenchConfig,
    bench_policies,
    render_table,
    run_benchmark,
)
from rollpacker.cli import app
from rollpacker.core.config import PartialConfig, RolloutConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.trace import PRESETS, generate
from rollpacker.engines.fake import FakeEngine

P0, R0, N_GROUP = 8, 4, 4


def _bench(per_seq_s: float, concurrency: int = 64, in_flight: int = 0):
    eng = FakeEngine(concurrency=concurrency, base_s=0.003, per_seq_s=per_seq_s)
    rc = RolloutConfig(
        prompts_per_step=P0, responses_per_prompt=R0, partial=PartialConfig(in_flight=in_flight)
    )
    cfg = BenchConfig(rc, periods=2)
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


@pytest.fixture(scope="module")
def five() -> dict:
    """All five arms on the smoke trace, memory-bound engine (per_seq_s = 0). Q = 32 so that partial
    rollout's prompt pool (P0 + in_flight) fits the 128-prompt trace for every step."""
    return _bench(0.0, concurrency=32)


def test_one_run_compares_all_five_policies_on_the_same_engine(five) -> None:
    pol = five["policies"]
    assert list(pol) == list(ALL_POLICIES) == five["config"]["policies"]
    n_steps = pol["tail_batching"]["steps"]
    assert n_steps >= 2 and pol["sync"]["steps"] == n_steps and pol["partial"]["steps"] == n_steps
    # the sorted arms run whole SortedRL groups: N rounded up to a multiple of n
    whole = -(-n_steps // N_GROUP) * N_GROUP
    assert five["config"]["sorted_steps"] == whole == pol["sorted"]["steps"] == pol["sorted_partial"]["steps"]
    assert not any(s["trace_used_up"] for s in pol.values())
    for name in ALL_POLICIES:
        steps = five["per_step"][name]
        assert len(steps) == pol[name]["steps"]
        assert all(m["groups"] == P0 and m["responses"] == P0 * R0 for m in steps), name


def test_every_arm_accounts_for_every_token(five) -> None:
    for name, s in five["policies"].items():
        assert s["tokens_generated"] == s["tokens_useful"] + s["tokens_wasted"] + s["tokens_cached"], name
        assert s["tokens_generated"] == s["engine_tokens"], name
        assert s["tokens_trained"] == s["tokens_useful"] + s["tokens_resumed"], name
        # cached tokens are trained later, still cached at the end, or dropped as stale: never lost
        assert s["tokens_cached"] == s["tokens_resumed"] + s["tokens_left_cached"] + s["tokens_dropped_stale"]
        assert s["tokens_dropped_stale"] >= 0 and s["tokens_left_cached"] >= 0, name
        assert 0 <= s["bubble_ratio"] <= 1 and 0 < s["efficiency"] <= 1.0 + 1e-9, name


def test_on_policy_arms_have_no_lag_and_partial_arms_do(five) -> None:
    pol = five["policies"]
    for name in ("sync", "tail_batching", "sorted"):
        s = pol[name]
        assert s["policy_lag"] == 0 and s["policy_lag_max"] == 0 and s["off_policy_frac"] == 0, name
        assert s["tokens_cached"] == 0 and s["tokens_resumed"] == 0, name
        assert all(m["policy_lag"] == 0 for m in five["per_step"][name]), name
    # SortedRL on-policy scavenges: unfinished responses are thrown away and regenerated
    assert pol["sorted"]["tokens_wasted"] > 0
    # the partial modes keep what they interrupt: nothing wasted, older tokens trained (lag > 0)
    sp, pr = pol["sorted_partial"], pol["partial"]
    for s in (sp, pr):
        assert s["tokens_wasted"] == 0 and s["tokens_cached"] > 0 and s["tokens_resumed"] > 0
        assert 0 < s["policy_lag"] <= s["policy_lag_max"] and 0 < s["off_policy_frac"] < 1
    # SortedRL's bounded wait (n - 1 steps) and whole groups: every cached token is trained in the run
    assert sp["policy_lag_max"] <= N_GROUP - 1
    assert sp["tokens_resumed"] == sp["tokens_cached"] and sp["tokens_left_cached"] == 0
    assert sp["tokens_dropped_stale"] == 0
    # partial rollout's staleness bound
    assert pr["policy_lag_max"] <= five["config"]["partial_max_staleness"]


def test_sorted_and_partial_fill_a_memory_bound_engine_better_than_sync(five) -> None:
    pol = five["policies"]
    for name in ("sorted", "sorted_partial", "partial"):
        assert pol[name]["bubble_ratio"] < pol["sync"]["bubble_ratio"], name
        assert pol[name]["speedup"] > 1.0, name
    ref = five["sortedrl_reference"]
    assert (
        ref["paper"]["bubble_ratio"]
        == SORTEDRL_PAPER_BUBBLE
        == {
            "baseline": 0.74,
            "sorted": 0.0581,
            "sorted_partial": 0.0337,
        }
    )
    assert ref["paper"]["reduction"]["sorted"] == pytest.approx(1 - 0.0581 / 0.74)
    measured = ref["measured"]["bubble_ratio"]
    assert measured["baseline"] == pol["sync"]["bubble_ratio"]
    assert measured["sorted_partial"] == pol["sorted_partial"]["bubble_ratio"]
    assert 0 < ref["measured"]["reduction"]["sorted"] < 1
    table = render_table(five)
    assert all(name in table for name in ALL_POLICIES)
    assert "lag max" in table and "off-pol" in table
    assert "SortedRL bubble ratio" in table and "74%" in table and "5.81%" in table


def test_an_arm_that_runs_out_of_trace_stops_and_says_so() -> None:
    # 64 in flight: partial rollout draws P0 + 64 prompts per step and the 128-prompt trace runs out
    rep = _bench(0.0, concurrency=64, in_flight=64)
    pr = rep["policies"]["partial"]
    assert pr["trace_used_up"] is True and 0 < pr["steps"] < rep["policies"]["tail_batching"]["steps"]
    assert all(m["groups"] == P0 for m in rep["per_step"]["partial"])
    assert "(trace used up)" in render_table(rep)


def test_the_baseline_always_runs_and_unknown_arms_are_named() -> None:
    assert bench_policies("partial") == ("sync", "tail_batching", "partial")
    assert bench_policies(" sorted_partial,sync ,") == ("sync", "tail_batching", "sorted_partial")
    with pytest.raises(ConfigError, match="'sorted_on'"):
        bench_policies("sorted_on")
    with pytest.raises(ConfigError, match="tail_batching"):
        BenchConfig(RolloutConfig(), policies=("sync", "sorted"))


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
            "--policies",
            "sync,tail_batching",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert set(rep["policies"]) == {"sync", "tail_batching"}
    assert set(rep["per_step"]) == {"sync", "tail_batching"}
    assert [p["batch"] for p in rep["batch_scaling"]] == [1, 8, 32, 128]  # Q=128 is in the curve


def test_cli_compares_all_five_policies_by_default_and_writes_the_new_keys(tmp_path) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "rollout", "--engine", "fake", "--preset", "smoke", "--p0", "4", "--r0", "2"]
    args += ["--max-tokens", "64", "--concurrency", "16", "--group-size", "2", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["config"]["policies"] == list(ALL_POLICIES)  # report order (the JSON sorts its keys)
    assert set(rep["policies"]) == set(rep["per_step"]) == set(ALL_POLICIES)
    # partial keeps one update (P0 x R0 = 8 requests, within Q = 16) in flight by default
    assert rep["config"]["group_size"] == 2 and rep["config"]["partial_in_flight"] == 8
    new = {
        "policy_lag",
        "policy_lag_max",
        "off_policy_frac",
        "tokens_cached",
        "tokens_useful",
        "trace_used_up",
    }
    for s in rep["policies"].values():
        assert new <= set(s) and s["steps"] > 0
    assert rep["sortedrl_reference"]["paper"]["bubble_ratio"]["baseline"] == 0.74
    assert set(rep["sortedrl_reference"]["measured"]["bubble_ratio"]) == {
        "baseline",
        "sorted",
        "sorted_partial",
    }
    assert "SortedRL bubble ratio" in res.output


def test_cli_runs_the_baseline_with_any_policy_subset(tmp_path) -> None:
    out = tmp_path / "r.json"
    args = ["bench", "rollout", "--engine", "fake", "--preset", "smoke", "--p0", "4", "--r0", "2"]
    res = CliRunner().invoke(app, [*args, "--max-tokens", "64", "--policies", "sorted", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads(out.read_text())
    assert rep["config"]["policies"] == ["sync", "tail_batching", "sorted"]
    assert set(rep["policies"]) == {"sync", "tail_batching", "sorted"}
    assert set(rep["sortedrl_reference"]["measured"]["bubble_ratio"]) == {"baseline", "sorted"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--eta-p", "0.8"], "eta_p"),
        (["--p0", "0"], "prompts_per_step"),
        (["--r0", "5"], "launch 7 responses"),
        (["--trace", "/nonexistent.jsonl"], "does not exist"),
        (["--preset", "nope"], "unknown preset"),
        (["--policies", "sync,fifo"], "unknown policy 'fifo'"),
        (["--group-size", "0"], "group_size"),
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
