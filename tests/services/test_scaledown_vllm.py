"""Scale-down on real vLLM: two TP-1 replicas (one core each), greedy decoding.

The requests of the freed replica move to the kept one by recompute migration in the middle of
decoding; greedy decoding must give the very tokens of the run without scale-down (logprobs to
float tolerance), every request must finish exactly once, and the parked replica must not step.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from rollpacker.core.config import EngineConfig
from rollpacker.core.latency import Layout
from rollpacker.core.scaledown import LengthHistory, ScaleDownConfig
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.layout import EnginePool, ScaleDownRuntime, SwitchingEngine, kv_capacity_tokens

pytestmark = pytest.mark.slow
DP2 = Layout(1, 2)


@pytest.fixture(scope="module")
def pool():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPU cores for two replicas")
    from rollpacker.tasks.tiny_model import build_tiny_model

    cfg = EngineConfig(model_dir=str(build_tiny_model("tiny")), max_num_seqs=32, max_model_len=512)
    p = EnginePool(cfg, (DP2,), devices=["0", "1"])
    p.warm()
    yield p
    p.close()


def _reqs(tag: str, n: int = 12) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            request_id=f"{tag}/{i}",
            prompt=Prompt(f"p{i}", tuple(range(10 + i, 40 + i))),
            sample_index=0,
            sampling=SamplingSpec(max_tokens=12 + 10 * i, temperature=0.0, ignore_eos=True),
        )
        for i in range(n)
    ]


def _run(eng: SwitchingEngine, reqs: list[GenerationRequest], rt: ScaleDownRuntime | None) -> dict:
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
    base = _run(SwitchingEngine(pool, None, DP2, enabled=False), _reqs("sd-base"), None)
    eng = SwitchingEngine(pool, None, DP2, enabled=False)
    lent: list[tuple[str, ...]] = []
    cap = kv_capacity_tokens(pool[DP2])
    assert cap > 1000
    rt = ScaleDownRuntime(
        eng, ScaleDownConfig(enabled=True), LengthHistory((), 200), lambda _l: cap, lent.append
    )
    got = _run(eng, _reqs("sd-on"), rt)
    outcome = rt.close()
    assert outcome.scaled_down and outcome.migrated_requests > 0 and len(lent) == 1
    assert lent[0] in (("0",), ("1",))
    freed = int(lent[0][0])
    assert got["parked_live"][freed] == 0, "the freed replica holds no request after the move"
    assert eng.scale_events[0].recompute_s > 0
    for i, r in enumerate(_reqs("x")):
        a = base["out"][f"sd-base/{i}"]
        b = got["out"][f"sd-on/{i}"]
        assert len(b[0]) == r.sampling.max_tokens == len(b[1])
        assert a[0] == b[0], f"request {i}: tokens differ after the migration"
        assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < 1e-3
    assert eng.engine.active == [0, 1]
