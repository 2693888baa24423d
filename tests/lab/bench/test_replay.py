from __future__ import annotations

import itertools
import json

import pytest
from typer.testing import CliRunner

from rollpacker.cli import app
from rollpacker.core.config import PartialConfig, RolloutConfig
from rollpacker.core.errors import ConfigError
from rollpacker.core.policies.sync import SyncPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.scaledown import RunningRequest, ScaleDownConfig
from rollpacker.core.trace import PRESETS, generate, to_prompts
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.fake import FakeEngine
from rollpacker.lab.bench.replay import (
    ALL_POLICIES,
    SORTEDRL_PAPER_BUBBLE,
    BenchConfig,
    ScaleDownObserver,
    TrackingEngine,
    bench_policies,
    make_engine,
    measure_kv_capacity,
    render_table,
    replay_sampling,
    run_benchmark,
    run_policy,
    scaledown_layout,
)

P0, R0, N_GROUP = 8, 4, 4


def _bench(per_seq_s: float, concurrency: int = 64, in_flight: int = 0, **bench):
    eng = FakeEngine(concurrency=concurrency, base_s=0.003, per_seq_s=per_seq_s)
    rc = RolloutConfig(
        prompts_per_step=P0, responses_per_prompt=R0, partial=PartialConfig(in_flight=in_flight)
    )
    cfg = BenchConfig(rc, periods=2, **bench)
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


def test_both_throughputs_are_reported_side_by_side_under_their_own_names(five) -> None:
    """SortedRL's output tokens/s counts every generated token; rollpacker's trained tokens/s only
    the trained ones: the on-policy sorted arm regenerates what it terminates, so its two differ
    by exactly its wasted tokens, and the printed table shows both."""
    for name, s in five["policies"].items():
        t = s["rollout_time_s"]
        assert s["output_tokens_per_s"] == pytest.approx(s["tokens_generated"] / t), name
        assert s["trained_tokens_per_s"] == pytest.approx(s["tokens_trained"] / t), name
        assert s["s_per_trained_step"] == pytest.approx(t / s["steps"]), name
        assert s["wasted_share"] == pytest.approx(s["tokens_wasted"] / s["tokens_generated"]), name
    on = five["policies"]["sorted"]
    assert on["tokens_wasted"] > 0 and on["output_tokens_per_s"] > on["trained_tokens_per_s"]
    assert (on["output_tokens_per_s"] - on["trained_tokens_per_s"]) * on["rollout_time_s"] == pytest.approx(
        on["tokens_wasted"]
    )
    lines = render_table(five).splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("throughput per arm (Q = 32)"))
    assert "out tok/s (all)" in lines[title + 1] and "trained tok/s" in lines[title + 1]
    row = lines[title + 3].split()
    assert row[0] == "sync" and row[2] == row[4] == "1.00"


def test_the_sorted_arms_keep_the_engine_at_q_in_every_round_but_a_groups_last(five) -> None:
    """A group is 4 x 8 x 4 = 128 requests against Q = 32: a round that is not the group's last
    starts with at least 64 owed and owes fewer than Q only in its last few steps (when most of the
    other prompts' responses are in), so eq. 4 over those rounds stays near 0 (a driver that
    refills per half batch leaves 20 % idle); the arm's bubble is mostly the drains'."""
    pol = five["policies"]
    for arm in ("sorted", "sorted_partial"):
        before = pol[arm]["bubble_ratio_before_drain"]
        assert before < 0.05 and before < pol[arm]["bubble_ratio"] / 3, arm
    assert pol["sync"]["bubble_ratio_before_drain"] is None
    assert "before each group's drain" in render_table(five)


def test_each_arms_bubble_is_split_into_its_parts_and_the_drains_share(five) -> None:
    pol = five["policies"]
    for arm, s in pol.items():
        assert s["bubble_outside_steps"] + s["bubble_under_filled"] == pytest.approx(s["bubble_ratio"]), arm
    for arm in ("sorted", "sorted_partial"):
        s, steps = pol[arm], five["per_step"][arm]
        t = sum(m["time_s"] for m in steps)
        kept = sum(m["time_s"] for i, m in enumerate(steps) if i % 4 != 3) / t
        # the rounds before each drain and the drains, weighted by their time, make the arm's ratio
        assert s["bubble_ratio_before_drain"] * kept + s["bubble_in_drains"] == pytest.approx(
            s["bubble_ratio"]
        )
        assert s["bubble_in_drains"] > s["bubble_ratio"] / 2, arm  # the drains hold most of it here
    assert pol["sync"]["bubble_in_drains"] is None
    assert "where the idle slots went: sync" in " ".join(render_table(five).split())


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


def test_in_sortedrls_configuration_both_sorted_arms_halve_syncs_bubble() -> None:
    """SortedRL's throughput experiment (sec. 4.4.1) on the simulated engine of ``--engine fake``
    (step time growing with the batch, as a real engine's does): its trace shape (``sortedrl-cpu``:
    P80 ~0.37 of the max, ~6 % at the max), one response a prompt, rollout batch = update batch =
    Q = 128, groups of 4 batches. Both sorted arms cut the synchronous baseline's bubble by more
    than half (the paper: 74 % -> 5.81 % / 3.37 %), and every round but a group's last keeps all Q
    slots busy; a controller that feeds the engine only one update's worth per round does not."""
    eng = make_engine("fake", "bench", concurrency=128, kv_gib=1, max_model_len=512, seed=0)
    rc = RolloutConfig(prompts_per_step=128, responses_per_prompt=1, max_tokens=256)
    arms = ("sync", "tail_batching", "sorted", "sorted_partial")
    cfg = BenchConfig(rc, periods=1, policies=arms, scaledown_replicas=0)
    trace = generate(PRESETS["sortedrl-cpu"], seed=0)
    pol = run_benchmark(eng, trace, cfg, source="sortedrl-cpu")["policies"]
    sync = pol["sync"]["bubble_ratio"]
    assert 0.6 < sync < 0.85  # the paper's baseline: 74 %
    for arm in ("sorted", "sorted_partial"):
        assert pol[arm]["bubble_ratio"] < sync / 2, arm
        assert pol[arm]["bubble_ratio_before_drain"] < 0.02, arm


# -- Algorithm 1 (scale-down) observed on the rounds ------------------------------------------------


def test_scaledown_decides_inside_the_20_50_window_and_frees_half_the_replicas(five) -> None:
    cfg = five["config"]["scaledown"]
    assert cfg["replicas"] == 4 and cfg["replica_kv_tokens"] == (1 << 30) // 4  # FakeEngine's KV / 4
    assert cfg["kv_checked"] is True and "engine estimate" in cfg["kv_source"]
    for name, s in five["policies"].items():
        sd = s["scaledown"]
        assert sd["rounds"] == s["steps"] and len(sd["per_round"]) == s["steps"], name
        decided = [r for r in sd["per_round"] if r["scaled_down"]]
        # a long-tailed trace: most rounds pass through the window one completion at a time
        assert len(decided) == sd["rounds_scaled_down"] >= sd["rounds"] // 2, name
        for r in decided:
            assert 0.2 <= r["completed_frac"] <= 0.5, (name, r)
            assert r["freed_replicas"] == 2 and r["migrated"] > 0, (name, r)
            assert 0 < r["decision_s"] < r["round_s"], (name, r)
            assert r["freed_replica_s"] == pytest.approx(2 * (r["round_s"] - r["decision_s"]))
        assert 0.2 <= sd["completed_frac_mean"] <= 0.5, name
        assert sd["replicas_freed"] == 2 * sd["rounds_scaled_down"], name
        assert sd["requests_migrated"] == sum(r["migrated"] for r in decided) > 0, name
        assert sd["freed_replica_s"] > 0 and sd["freed_device_s"] == pytest.approx(sd["freed_replica_s"])
        assert 0 < sd["freed_share"] < 1 and sd["refused_kv"] == 0 and sd["aborted_pick"] == 0, name
    table = render_table(five)
    assert "Algorithm 1's decision on this trace" in table and "not enacted" in table
    rest = table[table.index("scale-down:") :].splitlines()
    block = rest[:1] + list(itertools.takewhile(lambda line: line.startswith("  "), rest[1:]))
    assert len(block) > 3 + len(ALL_POLICIES) and all(len(line) < 120 for line in block)
    assert any(line.split()[:1] == ["tail_batching"] for line in block)


def test_scaledown_sees_every_completion_and_only_earlier_rounds_lengths() -> None:
    """Sync on a flat engine with room for every request: a response of length L finishes at engine
    step L, so the first attempt is at the first step t with 20 % <= done(t)/|R| <= 50 %. The
    monitor of round k projects with the natural lengths of rounds 0..k-1, never later ones."""
    eng = FakeEngine(concurrency=64, base_s=0.003, per_seq_s=0.0)
    rc = RolloutConfig(prompts_per_step=P0, responses_per_prompt=R0)
    prompts = to_prompts(generate(PRESETS["smoke"], seed=1), vocab_size=259, seed=0)
    policy = SyncPolicy(rc, PromptCursor(prompts, shuffle=False, epochs=1), replay_sampling(1024, 0))
    obs = ScaleDownObserver(eng, scaledown_layout(4, 1 << 20, 1), ScaleDownConfig(), rc.max_tokens)
    run_policy(eng, policy, lambda _p, steps: len(steps) >= 3, 3, scaledown=obs)
    assert [r.history_lengths for r in obs.rounds] == [0, P0 * R0, 2 * P0 * R0]
    lengths = [[min(n, 1024) for n in p.response_lens[:R0]] for p in prompts[: 3 * P0]]
    assert list(obs.history.lengths) == sorted(n for ls in lengths for n in ls)
    for k, rec in enumerate(obs.rounds):
        mine = [n for ls in lengths[k * P0 : (k + 1) * P0] for n in ls]
        total = len(mine)
        done = [sum(n <= t for n in mine) for t in range(max(mine) + 1)]
        first = next((t for t in range(1, len(done)) if 0.2 * total <= done[t] <= 0.5 * total), None)
        assert rec.requests == total and rec.attempts == (first is not None), k
        if first is not None:
            assert rec.completed_frac == done[first] / total, k
            assert rec.decision_s == pytest.approx(first * 0.003) and rec.round_s == pytest.approx(
                max(mine) * 0.003
            )
            assert 0 < rec.migrated < sum(n > first for n in mine)  # the freed replicas' share


def test_the_tracking_engine_reports_exactly_the_live_requests() -> None:
    """What the monitor reads: unfinished, unaborted requests with prompt and generated tokens
    (a resumed response's cached tokens included), replicas round-robin in submission order."""
    tracked = TrackingEngine(FakeEngine(concurrency=2), ("r0", "r1"))
    prompt = Prompt(prompt_id="p", token_ids=(5, 6, 7))
    for i, (n, prefix) in enumerate([(1, ()), (3, ()), (5, (9, 9))]):
        tracked.add_request(
            GenerationRequest(
                request_id=f"q{i}",
                prompt=prompt,
                sample_index=i,
                sampling=SamplingSpec(max_tokens=n, ignore_eos=True),
                prefix_token_ids=prefix,
                prefix_logprobs=(-1.0,) * len(prefix),
            )
        )
    assert tracked.launched is None
    tracked.step()  # q0 and q1 run (concurrency 2), q0 finishes; q2 waits
    assert tracked.launched == 3
    assert tracked.running() == [RunningRequest("q1", "r1", 3, 1), RunningRequest("q2", "r0", 3, 2)]
    tracked.step()  # q1 and q2 run
    assert tracked.running() == [RunningRequest("q1", "r1", 3, 2), RunningRequest("q2", "r0", 3, 3)]
    tracked.abort(["q2"])
    tracked.step()  # q1 finishes
    assert tracked.running() == [] and not tracked.has_unfinished()
    tracked.begin_round()
    assert tracked.submitted == 0 and tracked.launched is None


def test_scaledown_refuses_and_counts_when_the_kv_capacity_is_too_small() -> None:
    rep = _bench(0.0, concurrency=32, policies=("sync", "tail_batching"), scaledown_replica_kv_tokens=16)
    assert rep["config"]["scaledown"]["kv_source"] == "configured"
    for name, s in rep["policies"].items():
        sd = s["scaledown"]
        assert sd["rounds_scaled_down"] == 0 and sd["completed_frac_mean"] is None, name
        assert sd["refused_kv"] == sd["attempts"] > 0 and sd["aborted_pick"] == 0, name
        assert sd["replicas_freed"] == sd["requests_migrated"] == 0 and sd["freed_replica_s"] == 0, name
        # Algorithm 1 keeps trying at each milestone of the window: more attempts than rounds
        assert sd["attempts"] > sd["rounds"], name
    assert "KV refused" in render_table(rep)


def test_scaledown_with_one_replica_never_decides() -> None:
    rep = _bench(0.0, concurrency=32, policies=("sync", "tail_batching"), scaledown_replicas=1)
    for name, s in rep["policies"].items():
        sd = s["scaledown"]
        assert sd["rounds_scaled_down"] == 0 and sd["replicas_freed"] == 0, name
        assert sd["aborted_pick"] == sd["attempts"] > 0 and sd["refused_kv"] == 0, name


def _same(a, b, rel: float = 0.0) -> bool:
    """Equal, floats within ``rel`` (0 = exactly), through nested dicts and lists."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=rel, abs=rel) if rel else a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rel) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_scaledown_observation_changes_nothing_the_benchmark_measures(five) -> None:
    off = _bench(0.0, concurrency=32, scaledown_replicas=0)
    assert off["config"]["scaledown"] is None
    assert all("scaledown" not in s for s in off["policies"].values())
    assert "scale-down" not in render_table(off)
    decides = _bench(0.0, concurrency=32, scaledown_replica_kv_tokens=1 << 20)
    refuses = _bench(0.0, concurrency=32, scaledown_replica_kv_tokens=16)  # many attempts per round
    assert all(s["scaledown"]["rounds_scaled_down"] > 0 for s in decides["policies"].values())
    assert all(s["scaledown"]["refused_kv"] > 0 for s in refuses["policies"].values())

    def without(rep) -> dict:
        return {n: {k: v for k, v in s.items() if k != "scaledown"} for n, s in rep["policies"].items()}

    # A configured KV capacity runs no probe: the engine's clock is the same, so every figure is too.
    for on in (decides, refuses):
        assert _same(on["per_step"], off["per_step"])  # per-step seconds, tokens, lengths, aborts...
        assert _same(without(on), without(off)) and _same(on["batch_scaling"], off["batch_scaling"])
    # The default probes the engine's KV capacity first; the virtual clock then starts later, which
    # moves the per-step seconds by float rounding only, and nothing else at all.
    assert _same(five["per_step"], off["per_step"], rel=1e-9)
    assert _same(without(five), without(off), rel=1e-9)
    for name in ALL_POLICIES:
        steps_on, steps_off = five["per_step"][name], off["per_step"][name]
        for key in ("engine_steps", "tokens_generated", "tokens_wasted", "aborted_requests"):
            assert [m[key] for m in steps_on] == [m[key] for m in steps_off], (name, key)


def test_kv_capacity_is_estimated_through_the_port() -> None:
    assert measure_kv_capacity(FakeEngine(kv_capacity_tokens=40_000)) == 40_000
    # smaller than the probe itself: read once the preempted requests no longer wait
    assert measure_kv_capacity(FakeEngine(kv_capacity_tokens=1_500)) == 1_500
    rep = _bench(0.0, concurrency=32, policies=("sync", "tail_batching"), scaledown_replicas=3)
    assert rep["config"]["scaledown"]["replica_kv_tokens"] == (1 << 30) // 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scaledown_replicas": -1}, "scaledown_replicas"),
        ({"scaledown_replicas": True}, "scaledown_replicas"),
        ({"scaledown_replica_kv_tokens": 0}, "scaledown_replica_kv_tokens"),
        ({"scaledown_replica_kv_tokens": 1.5}, "scaledown_replica_kv_tokens"),
    ],
)
def test_scaledown_settings_are_validated(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        BenchConfig(RolloutConfig(), **kwargs)


def test_an_arm_that_runs_out_of_trace_stops_and_gets_no_speedup() -> None:
    # 64 in flight: partial rollout draws P0 + 64 prompts per step and the 128-prompt trace runs out
    rep = _bench(0.0, concurrency=64, in_flight=64)
    pol = rep["policies"]
    pr, n_sync = pol["partial"], pol["sync"]["steps"]
    assert pr["trace_used_up"] is True and 0 < pr["steps"] < n_sync == pol["tail_batching"]["steps"]
    assert all(m["groups"] == P0 for m in rep["per_step"]["partial"])
    # its steps are not the ones sync's mean is over: no speedup, and the JSON says why
    assert pr["speedup"] is None
    why = f"{pr['steps']} trained steps vs {n_sync} for sync (the trace ran out): no speedup given"
    assert pr["speedup_note"] == why
    assert pol["tail_batching"]["speedup"] > 1 and pol["tail_batching"]["speedup_note"] is None
    # the sorted arms run whole groups (more steps than sync): a per-step speedup, and a note
    for name in ("sorted", "sorted_partial"):
        assert pol[name]["steps"] > n_sync and pol[name]["speedup"] > 0, name
        assert "whole SortedRL groups" in pol[name]["speedup_note"], name
    table = render_table(rep).splitlines()
    row = next(line for line in table if line.startswith("partial "))
    assert row.split()[3] == "-"  # policy, steps, s/step, speedup
    assert f"note: partial: {why}" in table


def test_the_fake_engine_report_says_simulated_in_its_title() -> None:
    rep = _bench(0.0, concurrency=32, policies=("sync", "tail_batching"))
    assert rep["simulated"] is True and rep["simulated_by"].startswith("FakeEngine (virtual clock")
    text = render_table(rep)
    title = text[: text.index("\n\n")]  # the title paragraph
    assert "SIMULATED on FakeEngine" in title and "not a measurement" in title
    measured = render_table({**rep, "simulated": False, "simulated_by": None})
    assert "SIMULATED" not in measured and measured.startswith("rollout benchmark: measured on a real engine")


def test_the_table_fits_in_120_columns_with_a_legend_for_each_part(five) -> None:
    long_source = {**five, "trace": {**five["trace"], "source": "/data/traces/" + "very-long-name-" * 12}}
    for rep in (five, long_source):
        lines = render_table(rep).splitlines()
        assert max(len(line) for line in lines) <= 120
    lines = render_table(five).splitlines()
    # one legend under the time table, the token table, the throughput table and the scale-down table
    assert [line.strip() for line in lines].count("legend:") == 4
    legend = lines[lines.index("legend:") + 1 :]
    for term in ("speedup", "bubble", "efficiency", "lag mean", "lag max", "off-policy"):
        assert any(line.split("  ")[1:2] == [term] for line in legend), term
    header = next(line for line in lines if line.startswith("policy "))
    assert "effic." not in header and "off-pol " not in header


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


REPLAY = ["lab", "bench", "rollout-replay"]


def test_cli_runs_on_a_trace_file_and_writes_json(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(r.to_json() + "\n" for r in generate(PRESETS["smoke"], seed=5)))
    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        app,
        [
            "lab",
            "bench",
            "rollout-replay",
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
    args = [*REPLAY, "--engine", "fake", "--preset", "smoke", "--p0", "4", "--r0", "2"]
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
    args = [*REPLAY, "--engine", "fake", "--preset", "smoke", "--p0", "4", "--r0", "2"]
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
    res = CliRunner().invoke(app, [*REPLAY, "--engine", "fake", "--preset", "smoke", *args])
    assert res.exit_code == 2
    assert message in res.output


@pytest.mark.parametrize(
    ("args", "new"),
    [
        (["--preset", "smoke"], "rollpacker lab bench rollout-replay --preset smoke"),
        (["--mode", "replay", "--p0", "4"], "rollpacker lab bench rollout-replay --p0 4"),
        (["--mode=task", "--config", "code"], "rollpacker lab bench rollout-task --config code"),
        (["--mode", "task"], "rollpacker lab bench rollout-task"),
    ],
)
def test_the_old_bench_rollout_names_the_command_that_replaced_it(args, new) -> None:
    for prefix in (["bench"], ["lab", "bench"]):
        res = CliRunner().invoke(app, [*prefix, "rollout", *args])
        assert res.exit_code == 2, res.output
        assert "`bench rollout` is now two commands" in res.output
        assert res.output.rstrip().endswith(f"run: {new}"), res.output


def test_each_rollout_command_takes_only_its_own_options() -> None:
    res = CliRunner().invoke(app, ["lab", "bench", "rollout-replay", "--arms", "sync"])
    assert res.exit_code == 2 and "No such option: --arms" in res.output
    res = CliRunner().invoke(app, ["lab", "bench", "rollout-task", "--preset", "smoke"])
    assert res.exit_code == 2 and "No such option: --preset" in res.output


def test_cli_names_the_bad_trace_line(tmp_path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"prompt_id": "a", "prompt_len": 3, "response_lens": [5, 6, 7, 8, 9]}\n{"prompt_id": 3}\n'
    )
    res = CliRunner().invoke(app, ["bench", "rollout-replay", "--engine", "fake", "--trace", str(trace)])
    assert res.exit_code == 2
    assert "bad.jsonl:2" in res.output and "prompt_id" in res.output
