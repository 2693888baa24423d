"""``reward.group_rewards`` (DAPO's dynamic sampling asks it of each complete group) on the real
code sandbox and the real LLM judge: it returns the group's rewards, scores each response once (the
score ``score`` began is reused, and the ``group`` of a kept group reuses them: the trainer gets the
same rewards), a dropped group never reaches the trainer, and a call of another attempt is refused."""

from __future__ import annotations

import threading

import pytest

from rollpacker.core.errors import RewardError
from rollpacker.core.tasks import RewardKind
from rollpacker.core.types import Completion, FinishReason, Group, Prompt
from rollpacker.services.reward import RewardService
from rollpacker.tasks import synthetic_code as sc
from rollpacker.tasks.jsonl import dump_jsonl


class _Trainer:
    def __init__(self) -> None:
        self.got: dict[str, tuple[float, ...]] = {}
        self.arrived = threading.Event()

    def submit(self, attempt, prompt_id, samples) -> None:
        self.got[prompt_id] = tuple(s.reward for s in samples)
        self.arrived.set()


class _Peers:
    def __init__(self) -> None:
        self.t = _Trainer()

    def trainer(self):
        return self.t

    def cast_failure(self, attempt):
        return None

    def refresh(self) -> None:
        pass


def _counting(svc: RewardService) -> list[str]:
    """Every sample id the service's reward functions are asked to score."""
    assert svc._router is not None
    seen: list[str] = []
    submit = svc._router.submit

    def counted(req):  # type: ignore[no-untyped-def]
        seen.append(req.sample_id)
        return submit(req)

    svc._router.submit = counted  # type: ignore[method-assign]
    return seen


def _group(pid: str, n: int, attempt: str) -> Group:
    comps = tuple(
        Completion(f"{attempt}/{pid}/k{j}", pid, j, (1,), (0.0,), FinishReason.STOP) for j in range(n)
    )
    return Group(Prompt(pid, (1,)), comps)


def _check(svc: RewardService, keep_pid: str, keep: tuple[str, ...], drop_pid: str, drop: tuple[str, ...]):
    """A kept and a dropped group through score / group_rewards / group; returns both rewards."""
    trainer = _Peers()
    svc.bind(trainer)
    svc.begin("a1", ())
    seen = _counting(svc)
    kept, dropped = _group(keep_pid, len(keep), "a1"), _group(drop_pid, len(drop), "a1")
    svc.score("a1", kept.responses[0].request_id, keep_pid, keep[0])  # finished first: scored at once
    got = svc.group_rewards("a1", kept, keep)
    off = svc.group_rewards("a1", dropped, drop)
    assert got.prompt_id == keep_pid and len(got.rewards) == len(keep)
    assert off.prompt_id == drop_pid and len(off.rewards) == len(drop)
    svc.group("a1", kept, keep)  # the kept group goes on to the trainer; the dropped one does not
    assert trainer.t.arrived.wait(30)
    assert trainer.t.got == {keep_pid: got.rewards}  # the trainer's rewards are the decision's
    svc.score("a1", kept.responses[1].request_id, keep_pid, keep[1])  # a late score: ignored
    want = sorted(c.request_id for c in (*kept.responses, *dropped.responses))
    assert sorted(seen) == want, "each response is scored exactly once"
    with pytest.raises(RewardError, match=r"attempt a0.*on attempt a1"):
        svc.group_rewards("a0", kept, keep)
    return got.rewards, off.rewards


def test_code_sandbox_group_rewards(tmp_path) -> None:
    exs = sc.generate(sc.SyntheticCodeSpec(num_examples=2), seed=5)
    task = tmp_path / "code.jsonl"
    dump_jsonl(list(exs), task)
    text = f"experiment: t\ntask: {{name: {task}}}\nreward: {{sandbox: {{workers: 2, t_max_s: 3.0}}}}\n"
    svc = RewardService(text, "sync")
    try:
        svc._ready()
        a, b = exs
        right, wrong = sc.reference_solution(a), sc.wrong_variant(a)
        got, off = _check(
            svc, a.example_id, (right, wrong), b.example_id, (sc.wrong_variant(b), sc.wrong_variant(b))
        )
    finally:
        svc.close()
    assert got == (1.0, 0.0)  # variance: kept
    assert off == (0.0, 0.0)  # all equal: what dynamic sampling drops


@pytest.mark.slow
def test_judge_group_rewards() -> None:
    from rollpacker.tasks.registry import load_task

    text = "experiment: t\ntask: {name: mixed, num_examples: 60}\nreward: {judge: {warmup_steps: 3}}\n"
    svc = RewardService(text, "sync", role="judge")
    try:
        svc._ready()
        judged = [ex for ex in load_task("mixed", num_examples=60) if ex.reward_kind is RewardKind.JUDGE]
        a, b = judged[:2]
        keep = (a.reference, "no idea", a.reference)
        got, off = _check(svc, a.example_id, keep, b.example_id, (b.reference, "zzz"))
    finally:
        svc.close()
    assert all(0.0 <= r <= 1.0 for r in (*got, *off))
    assert got[0] == pytest.approx(got[2], abs=1e-6)  # one response, one score, whatever the batch
