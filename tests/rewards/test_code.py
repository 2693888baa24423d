"""The code reward on the real sandbox: verdicts, adaptive timeouts, live limits, the port's contract."""

from __future__ import annotations

import threading
import time

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout, TimeoutConfig
from rollpacker.rewards.base import RewardRequest, RewardStatus
from rollpacker.rewards.code import CodeReward, extract_program
from rollpacker.rewards.sandbox import Sandbox, SandboxLimits
from rollpacker.tasks import synthetic_code as sc

EX = sc.generate(sc.SyntheticCodeSpec(num_examples=4), seed=5)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxLimits(wall_s=20, cpu_s=20))


def _req(ex, response, sid="s"):
    return RewardRequest(sid, ex, response)


def test_verdicts_of_correct_wrong_and_doomed_programs(sandbox):
    t = AdaptiveTimeout(TimeoutConfig(t_min_s=0.5, t_max_s=3.0))
    with CodeReward(sandbox, t, workers=2) as cr:
        ex = EX[0]
        ok = cr.submit(_req(ex, sc.reference_solution(ex), "ok")).result()
        bad = cr.submit(_req(ex, sc.wrong_variant(ex), "bad")).result()
        hang = cr.submit(_req(ex, sc.nonterminating_variant(ex), "hang")).result()
    assert (ok.reward, ok.correct, ok.status, ok.sample_id) == (1.0, True, RewardStatus.OK, "ok")
    assert (bad.reward, bad.correct, bad.status) == (0.0, False, RewardStatus.OK)
    assert (hang.reward, hang.correct, hang.status) == (0.0, False, RewardStatus.TIMEOUT)
    # the hang was cut at the adaptive limit (the floor: the correct run took milliseconds), not t_max
    assert hang.elapsed_s < 2.5, hang


def test_only_fully_correct_responses_set_anchors(sandbox):
    t = AdaptiveTimeout(TimeoutConfig(t_min_s=0.5, t_max_s=3.0))
    ex = EX[1]
    with CodeReward(sandbox, t, workers=1) as cr:
        cr.score(_req(ex, sc.wrong_variant(ex)))
        assert len(t) == 0
        cr.score(_req(ex, sc.reference_solution(ex)))
    assert set(t.anchors()) == set(ex.case_keys())
    assert all(0 < v < 1.0 for v in t.anchors().values())


def test_a_doomed_run_is_cut_when_a_faster_correct_one_sets_the_anchor(sandbox):
    """The doomed response starts first, with no anchor (limit t_max = 8 s); a correct response then
    finishes and sets the anchor, and the running doomed one is cut at the new limit."""
    t = AdaptiveTimeout(TimeoutConfig(t_min_s=0.5, t_max_s=8.0))
    ex = EX[2]
    with CodeReward(sandbox, t, workers=2) as cr:
        t0 = time.perf_counter()
        hang = cr.submit(_req(ex, sc.nonterminating_variant(ex), "hang"))
        time.sleep(0.3)
        assert cr.submit(_req(ex, sc.reference_solution(ex), "ok")).result().correct
        res = hang.result()
        took = time.perf_counter() - t0
    assert res.status is RewardStatus.TIMEOUT
    assert took < 4.0, (took, res.detail)  # far below t_max: it was cut when the anchor appeared
    assert "tightened" in res.detail


def test_fixed_mode_waits_out_the_full_timeout(sandbox):
    t = AdaptiveTimeout(TimeoutConfig(adaptive=False, t_min_s=0.2, t_max_s=1.5))
    ex = EX[3]
    with CodeReward(sandbox, t, workers=1) as cr:
        assert cr.score(_req(ex, sc.reference_solution(ex))).correct
        res = cr.score(_req(ex, sc.nonterminating_variant(ex)))
    assert res.status is RewardStatus.TIMEOUT and res.elapsed_s >= 1.5


def test_program_extraction():
    ex = EX[0]
    assert extract_program(ex, "x\n```python\nprint(1)\n```\ntail") == "print(1)\n"
    assert extract_program(ex, "def f(x): return x") == "def f(x): return x"
    he = TaskExample(
        "h", "def g():\n", RewardKind.CODE, tests="assert g() == 1", metadata={"completion": True}
    )
    assert extract_program(he, "    return 1\n") == "def g():\n    return 1\n"


def test_contract_wrong_kind_closed_and_every_future_resolves(sandbox):
    t = AdaptiveTimeout(TimeoutConfig(t_min_s=0.5, t_max_s=2.0))
    cr = CodeReward(sandbox, t, workers=1)
    math_ex = TaskExample("m", "1+1", RewardKind.MATH, reference="2")
    with pytest.raises(ConfigError, match="not 'code'"):
        cr.submit(_req(math_ex, "2"))
    ex = EX[0]
    futs = [cr.submit(_req(ex, sc.nonterminating_variant(ex), f"h{i}")) for i in range(3)]
    closer = threading.Thread(target=cr.close)
    closer.start()
    results = [f.result(timeout=30) for f in futs]
    closer.join()
    assert [r.sample_id for r in results] == ["h0", "h1", "h2"]
    assert all(r.reward == 0.0 and not r.correct for r in results)
    assert any(r.status is RewardStatus.ERROR and "closed" in r.detail for r in results)
    with pytest.raises(RuntimeError, match="closed"):
        cr.submit(_req(ex, "x"))
    cr.close()  # idempotent
