from __future__ import annotations

from concurrent.futures import Future

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.rewards.base import RewardFunction, RewardRequest, RewardResult, RewardRouter, RewardStatus

MATH = TaskExample("m", "1+1?", RewardKind.MATH, reference="2")
CODE = TaskExample("c", "def f():\n", RewardKind.CODE, tests="assert f() == 1", entry_point="f")
JUDGE = TaskExample("j", "Say hi.", RewardKind.JUDGE)


class Constant:
    """A reward function that scores every response ``value``, resolved at once."""

    def __init__(self, kind: RewardKind, value: float) -> None:
        self.kind = kind
        self.value = value
        self.closed = 0

    def submit(self, req: RewardRequest) -> Future[RewardResult]:
        f: Future[RewardResult] = Future()
        f.set_result(RewardResult(req.sample_id, self.value, self.value == 1.0, RewardStatus.OK, 0.0))
        return f

    def close(self) -> None:
        self.closed += 1


def test_result_invariants() -> None:
    RewardResult("s", 0.0, False, RewardStatus.TIMEOUT, 0.2)
    with pytest.raises(ValueError, match="correct but status timeout"):
        RewardResult("s", 1.0, True, RewardStatus.TIMEOUT, 0.2)
    with pytest.raises(ValueError, match="not finite"):
        RewardResult("s", float("nan"), False, RewardStatus.OK, 0.1)
    with pytest.raises(AttributeError):
        RewardResult("s", 0.0, False, RewardStatus.OK, 0.1).reward = 1.0  # type: ignore[misc]


def test_router_dispatches_by_kind_and_closes_all() -> None:
    math_fn, judge_fn = Constant(RewardKind.MATH, 1.0), Constant(RewardKind.JUDGE, 0.25)
    assert isinstance(math_fn, RewardFunction)
    with RewardRouter([math_fn, judge_fn]) as router:
        assert router.kinds == {RewardKind.MATH, RewardKind.JUDGE}
        assert router.submit(RewardRequest("a", MATH, "2")).result().reward == 1.0
        r = router.submit(RewardRequest("b", JUDGE, "hi")).result()
        assert (r.sample_id, r.reward) == ("b", 0.25)
        with pytest.raises(
            ConfigError, match=r"kind 'code' \(have: judge, math\); code rewards need the sandbox"
        ):
            router.submit(RewardRequest("c", CODE, "def f(): return 1"))
        with pytest.raises(ConfigError, match="code rewards need the sandbox"):
            router.check_covers([MATH, CODE])
        router.check_covers([MATH, JUDGE])
    assert (math_fn.closed, judge_fn.closed) == (1, 1)
    router.close()  # idempotent
    assert math_fn.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        router.submit(RewardRequest("a", MATH, "2"))


def test_router_messages_and_construction_errors() -> None:
    with pytest.raises(ConfigError, match="judge rewards need an LLM judge"):
        RewardRouter([]).submit(RewardRequest("j", JUDGE, "hi"))
    with pytest.raises(ConfigError, match=r"math rewards need .*MathReward"):
        RewardRouter([]).submit(RewardRequest("m", MATH, "2"))
    with pytest.raises(ConfigError, match="two reward functions for kind 'math'"):
        RewardRouter([Constant(RewardKind.MATH, 1.0), Constant(RewardKind.MATH, 0.0)])
    with pytest.raises(ConfigError, match="no valid 'kind'"):
        RewardRouter([Constant("math", 1.0)])  # type: ignore[arg-type]
