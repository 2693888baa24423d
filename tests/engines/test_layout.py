"""Layouts, in-step layout switching and scale-down on real vLLM: TP 1 x DP 2 and TP 2 x DP 1 on
two cores.

One pool (three engine processes: two TP-1 replicas, one TP-2 engine) serves every test here.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import pytest

from rollpacker.core.config import EngineConfig
from rollpacker.core.latency import Layout, Predictor, SwitchDecision, trajectory_error
from rollpacker.core.scaledown import LengthHistory, ScaleDownConfig
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.layout import (
    EnginePool,
    ScaleDownRuntime,
    SwitchingEngine,
    device_groups,
    kv_capacity_tokens,
)
from rollpacker.rollout.driver import generate

pytestmark = pytest.mark.slow
A, B = Layout(1, 2), Layout(2, 1)
TWO_CORES = len(os.sched_getaffinity(0)) >= 2


@pytest.fixture(scope="module")
def pool():
    if not TWO_CORES:
        pytest.skip("needs two CPU cores for TP 2 / DP 2")
    from rollpacker.tasks.tiny_model import build_tiny_model

    cfg = EngineConfig(model_dir=str(build_tiny_model("tiny")), max_num_seqs=32, max_model_len=512)
    p = EnginePool(cfg, (A, B), devices=["0", "1"])
    p.warm()
    yield p
    p.close()


def _reqs(tag: str, n: int, temperature: float) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{tag}/{i}",
            prompt=Prompt(f"p{i}", tuple(range(10 + i, 40 + i))),
            sample_index=0,
            sampling=SamplingSpec(max_tokens=24 + 6 * i, temperature=temperature, ignore_eos=True),
        )
        for i in range(n)
    ]


def _flip(log: list[Layout]):
    def decide(cur, loads, bound):
        tgt = B if cur == A else A
        log.append(tgt)
        return SwitchDecision(cur, tgt, 1.0, 0.5, 0.1, ())

    return decide


def test_device_groups_keep_tp_within_a_group() -> None:
    assert device_groups(A, ["0", "1"]) == [["0"], ["1"]]
    assert device_groups(B, ["0", "1"]) == [["0", "1"]]
    with pytest.raises(Exception, match="needs 4 devices"):
        device_groups(Layout(2, 2), ["0", "1"])


def test_greedy_tokens_are_the_same_with_and_without_switches(pool) -> None:
    """Recompute migration continues every stream exactly: greedy decoding gives the very tokens
    (and logprobs, to float tolerance) of an unswitched run, across many switches both ways."""
    base = generate(SwitchingEngine(pool, None, A, enabled=False), _reqs("g-base", 10, 0.0))
    log: list[Layout] = []
    sw = SwitchingEngine(pool, None, A, check_every=8, decide=_flip(log))
    got = generate(sw, _reqs("g-sw", 10, 0.0))
    assert len(sw.events) >= 4 and {e.target for e in sw.events} == {"tp1dp2", "tp2dp1"}
    for a, b in zip(base, got, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-3


def test_sampled_switch_yields_exactly_the_requested_tokens(pool) -> None:
    reqs = _reqs("s-sw", 12, 1.0)
    log: list[Layout] = []
    sw = SwitchingEngine(pool, None, A, check_every=10, decide=_flip(log))
    pre0 = sw.num_preemptions()
    done = generate(sw, reqs)
    assert [len(c.token_ids) for c in done] == [r.sampling.max_tokens for r in reqs]
    assert all(len(c.logprobs) == len(c.token_ids) for c in done)
    assert all(lp <= 0.0 for c in done for lp in c.logprobs)
    assert sw.events and all(e.control_s > 0 and e.recompute_s > 0 for e in sw.events if e.requests)
    # every migrated request was accounted for: the first switch moved all of them
    assert sw.events[0].requests == len(reqs)
    assert sw.num_preemptions() >= pre0
    assert not sw.has_unfinished()


def test_abort_reaches_a_migrated_request(pool) -> None:
    reqs = _reqs("a-sw", 4, 1.0)
    sw = SwitchingEngine(pool, None, A, enabled=False)
    for r in reqs:
        sw.add_request(r)
    for _ in range(3):
        sw.step()
    sw.switch_to(B)
    sw.abort([reqs[0].request_id])
    seen = set()
    while sw.has_unfinished():
        ups, _ = sw.step()
        seen.update(u.request_id for u in ups if u.finished)
    assert seen == {r.request_id for r in reqs[1:]}


@pytest.mark.alone  # a profile of the layouts, then a trajectory timed against it
def test_profile_and_trajectory_on_real_engines(pool) -> None:
    """A small profile of both layouts, then a real trajectory predicted from it."""
    from rollpacker.engines.profiler import ProfileSpec, profile_engines, record_trajectory

    spec = ProfileSpec(layouts=(A, B), batches=(1, 4, 16), contexts=(16, 64, 192), window=8)
    table = profile_engines(pool.cfg, spec, pool=pool)
    assert {lp.layout for lp in table.layouts} == {A, B}
    assert all(lp.kv_capacity_tokens > 16 * 200 for lp in table.layouts)
    assert table.kv_bytes_per_token == 2 * 4 * 2 * 64 * 4  # tiny: 4 layers, 2 KV heads of 64, fp32
    for lp in table.layouts:
        # a point whose batch does not stay whole through the decode window is tried again and then
        # skipped, and said (engines/profiler.py, POINT_TRIES): on a busy machine the TP1xDP2
        # layout's two engine cores drift apart and lose a point now and then (seen: (4, 64) once,
        # (x, 192) more often), so most of the grid is required, not every point
        got = {(p.batch, p.context) for p in lp.points}
        assert len(got) >= 6 and got <= {(b, c) for b in (1, 4, 16) for c in (16, 64, 192)}, sorted(got)
        assert {c for _, c in got} >= {16, 64}, sorted(got)
        # more context to prefill costs more
        short = min(p.prefill_s for p in lp.points if p.context == 16)
        longest = max(p.context for p in lp.points)
        assert max(p.prefill_s for p in lp.points if p.context == longest) > short
    steps = record_trajectory(pool[A], _reqs("traj", 16, 1.0))
    assert len(steps) > 20 and all(s.seconds > 0 for s in steps)
    err = trajectory_error(Predictor(table), A, steps)
    # the target (<= 10 %) is measured by `rollpacker lab profile` on a quiet machine; here only
    # that the prediction is in the right range, not off by a factor
    assert err.total_error < 0.6, err


# --- scale-down (RollPacker 4.4): two TP-1 replicas, greedy decoding -----------------------------
# The requests of the freed replica move to the kept one by recompute migration in the middle of
# decoding; greedy decoding must give the very tokens of the run without scale-down (logprobs to
# float tolerance), every request must finish exactly once, and the parked replica must not step.


def _sd_reqs(tag: str, n: int = 12) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{tag}/{i}",
            prompt=Prompt(f"p{i}", tuple(range(10 + i, 40 + i))),
            sample_index=0,
            sampling=SamplingSpec(max_tokens=12 + 10 * i, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


def _sd_run(eng: SwitchingEngine, reqs: list[GenerationRequest], rt: ScaleDownRuntime | None) -> dict:
    out: dict[str, tuple[list[int], list[float]]] = {}
    finished: Counter[str] = Counter()
    for r in reqs:
        eng.add_request(r)
        out[r.request_id] = ([], [])
    parked_steps = None
    while eng.has_unfinished():
        ups, _ = eng.step()
        for u in ups:
            out[u.request_id][0].extend(u.new_token_ids)
            out[u.request_id][1].extend(u.new_logprobs)
            finished[u.request_id] += u.finished
        if rt is not None:
            rt.observe(sum(finished.values()))
            if rt.decision is not None and parked_steps is None:
                parked_steps = [len(rt.engine.engine.replicas[i].live_request_ids()) for i in (0, 1)]
    assert set(finished.values()) == {1} and set(finished) == set(out)
    return {"out": out, "parked_live": parked_steps}


def test_greedy_tokens_survive_a_scale_down_on_vllm(pool) -> None:
    base = _sd_run(SwitchingEngine(pool, None, A, enabled=False), _sd_reqs("sd-base"), None)
    eng = SwitchingEngine(pool, None, A, enabled=False)
    lent: list[tuple[str, ...]] = []
    cap = kv_capacity_tokens(pool[A])
    assert cap > 1000
    rt = ScaleDownRuntime(
        eng, ScaleDownConfig(enabled=True), LengthHistory((), 200), lambda _l: cap, lent.append
    )
    got = _sd_run(eng, _sd_reqs("sd-on"), rt)
    outcome = rt.close()
    assert outcome.scaled_down and outcome.migrated_requests > 0 and len(lent) == 1
    assert lent[0] in (("0",), ("1",))
    freed = int(lent[0][0])
    assert got["parked_live"][freed] == 0, "the freed replica holds no request after the move"
    assert eng.scale_events[0].recompute_s > 0
    for i, r in enumerate(_sd_reqs("x")):
        a = base["out"][f"sd-base/{i}"]
        b = got["out"][f"sd-on/{i}"]
        assert len(b[0]) == r.sampling.max_tokens == len(b[1])
        assert a[0] == b[0], f"request {i}: tokens differ after the migration"
        assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < 1e-3
    assert eng.engine.active == [0, 1]


def test_weights_reach_every_engine_of_every_layout(pool) -> None:
    """In-place weight loading into engine cores in other processes (through a safetensors file:
    tensors do not survive vLLM's message queues), then back."""
    from safetensors.torch import load_file

    def greedy(tag: str) -> list[tuple[float, ...]]:
        reqs = [
            GenerationRequest(
                f"{tag}/{lay.name}",
                Prompt("w", (5, 6, 7, 8)),
                0,
                SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True),
            )
            for lay in pool.layouts
        ]
        return [generate(pool[lay], [r])[0].logprobs for lay, r in zip(pool.layouts, reqs, strict=True)]

    md = pool.cfg.model_dir
    w = list(load_file(str(next(Path(md).glob("*.safetensors")))).items())
    if not any(n == "lm_head.weight" for n, _ in w):
        w.append(("lm_head.weight", dict(w)["model.embed_tokens.weight"]))
    before = greedy("w0")
    pool.load_weights(
        [(n, t * 0 if n in ("model.embed_tokens.weight", "lm_head.weight") else t) for n, t in w]
    )
    flat = greedy("w1")
    # zero embeddings and head: every token equally likely, on both layouts
    assert all(lp == pytest.approx(-math.log(320), abs=1e-4) for lps in flat for lp in lps)
    pool.load_weights(w)
    after = greedy("w2")
    assert [x for lps in after for x in lps] == pytest.approx([x for lps in before for x in lps], abs=1e-4)
