"""RollPacker Algorithm 1 at runtime: the rollout's scale-down acts (migrate, park, lend devices to
the trainer) and gives everything back before the next round.

The engine is the outer edge faked here (``FakeEngine`` replicas behind the real ``LayoutEngine``
and ``SwitchingEngine``); the policy, the driver, the runtime, the rollout service's round and the
trainer service (with a real torch trainer on a tiny model) are the real ones. The fake's tokens
depend on the request and its context only, never on the replica, so a round that migrated its
requests must produce exactly the completions of the same round without scale-down.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.advantages import TrainSample, group_advantages
from rollpacker.core.config import RolloutConfig
from rollpacker.core.latency import Layout
from rollpacker.core.policies.tail_batching import TailBatchingPolicy
from rollpacker.core.prompts import PromptCursor
from rollpacker.core.scaledown import LengthHistory, ScaleDownConfig
from rollpacker.core.state import ControllerState, TPPlan
from rollpacker.core.types import Completion, GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.layout import EnginePool, LayoutEngine, ScaleDownRuntime, SwitchingEngine
from rollpacker.rollout.driver import RoundRun, run_round
from tests.conftest import make_prompts
from tests.services.fakes import RoundPeers
from tests.small_model import build_small_model

DP2 = Layout(1, 2)
ON = ScaleDownConfig(enabled=True)


class _Replica(FakeEngine):
    """A simulated replica that reports its KV capacity as vLLM's does (block count x size)."""

    kv_capacity_tokens = 1 << 20


def _engine(concurrency: int = 512) -> SwitchingEngine:
    reps = [_Replica(concurrency=concurrency, stop_prob=0.0) for _ in range(DP2.dp)]
    pool = EnginePool.of({DP2: LayoutEngine(DP2, reps, virtual=True)})
    return SwitchingEngine(pool, None, DP2, enabled=False)


def _lens(seed: int, n: int = 60, r: int = 6) -> list[list[int]]:
    """Long-tailed response lengths: most short, a few up to 400 tokens."""
    rng = random.Random(seed)
    return [[min(400, int(rng.paretovariate(1.2) * 8)) for _ in range(r)] for _ in range(n)]


def _rounds(
    config: ScaleDownConfig | None, steps: int = 8
) -> tuple[list[RoundRun], list[Any], SwitchingEngine]:
    """``steps`` tail-batching rounds on two fake replicas; with ``config`` every round runs under
    a ``ScaleDownRuntime`` (fed by the driver's ``on_step``) and records what it lent."""
    cfg = RolloutConfig(prompts_per_step=4, responses_per_prompt=4, eta_p=1.25, eta_r=1.5, max_tokens=400)
    pol = TailBatchingPolicy(
        cfg,
        PromptCursor(make_prompts(_lens(7)), shuffle=False, epochs=1),
        lambda p, j: SamplingSpec(max_tokens=p.response_lens[j], temperature=1.0, ignore_eos=True),
    )
    eng = _engine()
    runs, lent = [], []
    history = LengthHistory((), cfg.max_tokens)
    for step in range(steps):
        rt = None
        if config is not None:
            rt = ScaleDownRuntime(
                eng, config, history, lambda _lay: 1 << 20, lambda d, step=step: lent.append((step, d))
            )
        rr = run_round(
            eng,
            pol.open_round(pol.plan_step(step)),
            on_step=(lambda _s, c, rt=rt: rt.observe(c)) if rt is not None else None,
        )
        if rt is not None:
            out = rt.close()
            lent.append((step, out))
            assert not eng.engine.parked, "the replicas serve again when the round ends"
        pol.commit(rr.result)
        history = history.extended(c.num_tokens for g in rr.result.groups for c in g.responses)
        runs.append(rr)
    return runs, lent, eng


def _completions(rr: RoundRun) -> list[Completion]:
    return sorted((c for g in rr.result.groups for c in g.responses), key=lambda c: c.request_id)


def test_scale_down_migrates_requests_once_and_keeps_every_token_and_logprob() -> None:
    """Scale-down on vs off: the same groups, completions, tokens and behaviour logprobs; the
    moved requests finish exactly once on the kept replica; the freed device is lent once."""
    off, _, _ = _rounds(None)
    on, lent, eng = _rounds(ON)
    outcomes = [o for _, o in lent if not isinstance(o, tuple)]
    released = [(s, d) for s, d in lent if isinstance(d, tuple)]
    assert any(o.scaled_down for o in outcomes), "no round scaled down: the test proves nothing"
    assert sum(o.migrated_requests for o in outcomes) > 0
    assert {e.requests for e in eng.scale_events} and all(e.requests >= 0 for e in eng.scale_events)
    # one release per scaled-down round, of exactly one replica's device (half of DP 2)
    assert len(released) == sum(o.scaled_down for o in outcomes)
    assert all(len(d) == 1 and d[0] in ("0", "1") for _, d in released)
    for o in outcomes:
        if o.scaled_down:
            assert 0.2 <= o.completed_fraction <= 0.5 and o.freed_replicas == 1
            assert o.logged()["rollout/scaled_down_at"] == o.completed_fraction
    for a, b in zip(off, on, strict=True):
        ga = {g.prompt.prompt_id: g for g in a.result.groups}
        gb = {g.prompt.prompt_id: g for g in b.result.groups}
        assert set(ga) == set(gb)
        assert [p.prompt_id for p in a.result.deferred] == [p.prompt_id for p in b.result.deferred]
        ca, cb = _completions(a), _completions(b)
        assert len(ca) == len(cb) and len({c.request_id for c in cb}) == len(cb)  # none lost or twice
        by_id = {c.request_id: c for c in ca}
        for y in cb:
            assert len(y.logprobs) == len(y.token_ids) == y.num_tokens
            x = by_id.get(y.request_id)
            if x is not None:  # the same response: the very tokens and behaviour logprobs
                assert (x.token_ids, x.logprobs, x.finish_reason) == (
                    y.token_ids,
                    y.logprobs,
                    y.finish_reason,
                )
        for pid in ga:
            # a migration reorders one step's updates: a response that tied with another (same
            # length, same step) may be picked instead of it, never a longer one
            assert sorted(c.num_tokens for c in ga[pid].responses) == sorted(
                c.num_tokens for c in gb[pid].responses
            )
    assert not eng.live_request_ids()


def test_a_parked_replica_gets_no_request_and_is_not_stepped() -> None:
    eng = _engine()
    reqs = [SamplingSpec(max_tokens=30 + 10 * i, temperature=1.0, ignore_eos=True) for i in range(6)]
    for i, sp in enumerate(reqs):
        eng.add_request(GenerationRequest(f"q{i}", Prompt(f"p{i}", (5, 6, 7, 8)), 0, sp))
    for _ in range(5):
        eng.step()
    on_r1 = [rid for rid, rep, _, _ in eng.running() if rep == 1]
    assert on_r1
    ev = eng.scale_down([1], dict.fromkeys(on_r1, 0))
    assert ev.requests == len(on_r1)
    assert all(rep == 0 for _, rep, _, _ in eng.running())
    assert eng.engine.active == [0]
    r1 = eng.engine.replicas[1]
    assert not r1.has_unfinished()
    clock = r1.now()
    eng.add_request(GenerationRequest("late", Prompt("late", (1, 2, 3)), 0, reqs[0]))
    assert all(rep == 0 for _, rep, _, _ in eng.running())
    done: Counter[str] = Counter()
    tokens: Counter[str] = Counter()
    while eng.has_unfinished():
        ups, _ = eng.step()
        for u in ups:
            tokens[u.request_id] += len(u.new_token_ids)
            done[u.request_id] += u.finished
    assert r1.now() == clock, "a parked replica must not be stepped"
    assert set(done) == {f"q{i}" for i in range(6)} | {"late"} and set(done.values()) == {1}
    # the ones that moved were 5 tokens in: they get exactly their remaining tokens
    assert all(tokens[f"q{i}"] == 30 + 10 * i - 5 for i in range(6))
    eng.restore_replicas()
    assert eng.engine.active == [0, 1]


def test_refused_attempts_are_counted_and_nothing_moves() -> None:
    """A KV capacity that cannot hold the projected peak: attempts happen, none acts."""
    eng = _engine()
    released: list[tuple[str, ...]] = []
    rt = ScaleDownRuntime(eng, ON, LengthHistory((), 400), lambda _lay: 10, released.append)
    for i in range(20):
        sp = SamplingSpec(max_tokens=5 + 10 * i, temperature=1.0, ignore_eos=True)
        eng.add_request(GenerationRequest(f"q{i}", Prompt(f"p{i}", (5, 6, 7)), 0, sp))
    completed = 0
    while eng.has_unfinished():
        ups, _ = eng.step()
        completed += sum(u.finished for u in ups)
        rt.observe(completed)
    out = rt.close()
    assert out.attempts > 0 and out.refused == out.attempts and not out.scaled_down
    assert not released and not eng.scale_events
    assert "rollout/scaled_down_at" not in out.logged()


# -- the rollout service's round on the fake replicas -------------------------------------------------


SERVICE_CONFIG = """
experiment: sd-test
task: {{name: synthetic_math, num_examples: 200, val_size: 16}}
rollout: {{policy: tail_batching, prompts_per_step: 4, responses_per_prompt: 4, max_tokens: 200,
          scale_down: {{enabled: {enabled}}}}}
planner: {{devices: 2, max_tp: 1}}
store: {{endpoint: "file://{root}"}}
"""


def _service(tmp_path: Path, enabled: bool) -> tuple[Any, RoundPeers]:
    from rollpacker.services.rollout import RolloutService
    from rollpacker.tasks.tiny_model import build_tiny_model, vocab

    svc = RolloutService(SERVICE_CONFIG.format(enabled=str(enabled).lower(), root=tmp_path), "tail_batching")
    peers = RoundPeers()
    svc.bind(peers)
    svc.model_dir = build_tiny_model("micro")
    reps = [_Replica(concurrency=512, vocab_size=len(vocab()), stop_prob=1 / 48) for _ in range(2)]
    svc.engine = SwitchingEngine(
        EnginePool.of({DP2: LayoutEngine(DP2, reps, virtual=True)}), None, DP2, enabled=False
    )
    return svc, peers


def _state() -> ControllerState:
    return ControllerState(
        experiment="sd-test",
        arm="tail_batching",
        step=-1,
        cursor_seed=0,
        cursor_epoch=0,
        cursor_position=0,
        checkpoint_uri="file:///unused",
        policy_version=0,
        tp_plan=TPPlan(1, 1),
        seed=0,
        mlflow_run_id="run",
    )


@pytest.mark.parametrize("enabled", [False, True])
def test_the_rollout_service_round_lends_devices_only_when_enabled(tmp_path: Path, enabled: bool) -> None:
    svc, peers = _service(tmp_path, enabled)
    report = svc.run_round(_state(), 0, "att1")
    assert len(report.trained) == 4 and sorted(peers.rewards.groups) == sorted(report.trained)
    assert not svc.engine.engine.parked and not svc.engine.live_request_ids()
    m = report.metrics
    if not enabled:  # off: no scale-down bookkeeping, no trainer call, nothing migrated
        assert not peers.train.calls and not svc.engine.scale_events
        assert not any(k.startswith("rollout/scale") for k in m)
        return
    assert m["rollout/scaled_down"] == 1.0, m
    assert 0.2 <= m["rollout/scaled_down_at"] <= 0.5 and m["rollout/scaled_down_at_s"] > 0
    assert m["rollout/replicas_freed"] == 1.0 and m["rollout/devices_freed"] == 1.0
    assert peers.train.calls and peers.train.calls[0][0] == "att1"
    assert len(peers.train.calls) == 1 and len(peers.train.calls[0][1]) == 1


# -- the trainer service: devices lent and given back --------------------------------------------------


def start_state(experiment: str, arm: str, base_uri: str) -> ControllerState:
    """Step -1 of an arm whose checkpoint is ``base_uri``."""
    return ControllerState(
        experiment=experiment,
        arm=arm,
        step=-1,
        cursor_seed=0,
        cursor_epoch=0,
        cursor_position=0,
        checkpoint_uri=base_uri,
        policy_version=0,
        tp_plan=TPPlan(1, 1),
        seed=0,
        mlflow_run_id="run",
    )


def _group(prompt_id: str, seed: int) -> tuple[TrainSample, ...]:
    rng = random.Random(seed)
    rewards = [1.0, 0.0, 1.0, 0.0]
    adv = group_advantages(rewards)
    prompt = tuple(rng.randrange(1, 64) for _ in range(5))
    out = []
    for j, r in enumerate(rewards):
        n = rng.randint(3, 12)
        out.append(
            TrainSample(
                sample_id=f"{prompt_id}/{j}",
                prompt_id=prompt_id,
                prompt_ids=prompt,
                response_ids=tuple(rng.randrange(1, 64) for _ in range(n)),
                behaviour_logprobs=tuple(-rng.uniform(2, 5) for _ in range(n)),
                advantage=adv[j],
                reward=r,
            )
        )
    return tuple(out)


class _Rollout:
    def load_weights(self, *args: Any) -> float:
        return 0.0

    def probe(self, prompts: int, max_tokens: int) -> Any:
        from rollpacker.services.api import WeightProbe

        return WeightProbe(0, (), (), ())  # no engine up: the probe is skipped


class _TrainerPeers:
    def rollout(self) -> _Rollout:
        return _Rollout()

    def refresh(self) -> None:
        pass


def _worker_affinity(svc: Any) -> set[int]:
    svc.stream._queues[0].join()  # the placement message is applied
    return set(os.sched_getaffinity(svc.stream._threads[0].native_id))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux thread affinity")
def test_the_trainer_takes_the_freed_cores_and_gives_them_back_before_the_next_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from rollpacker.core.config import StoreConfig
    from rollpacker.services.trainer import TrainerService
    from rollpacker.store import open_store

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    store = open_store(StoreConfig(endpoint=f"file://{tmp_path / 'store'}"))
    base = store.upload_dir(build_small_model(tmp_path / "model"), "sd/base/")
    text = (
        f'experiment: sd\nstore: {{endpoint: "file://{tmp_path / "store"}"}}\n'
        "planner: {devices: 2, max_tp: 1}\nrollout: {scale_down: {enabled: true}}\n"
    )
    svc = TrainerService(text, "tail_batching")
    svc.bind(_TrainerPeers())
    state = start_state("sd", "tail_batching", base)
    base_cores = set(os.sched_getaffinity(0))
    core = str(max(base_cores))
    seen: list[tuple[str, set[int], int]] = []
    svc.begin("a1", state, base)
    acc = svc.trainer.accumulate

    def spy(samples: Any) -> Any:
        seen.append((samples[0].prompt_id, set(os.sched_getaffinity(0)), torch.get_num_threads()))
        return acc(samples)

    svc.trainer.accumulate = spy
    svc.submit("a1", "g0", _group("g0", 0))
    assert _worker_affinity(svc) == base_cores
    time.sleep(0.05)
    lease = svc.repurpose("a1", (core,))
    assert lease.devices == (core,) and lease.threads == 1 and lease.at_s > 0
    assert svc.repurpose("old-attempt", ("0",)).devices == ()  # a late call is ignored
    assert _worker_affinity(svc) == {int(core)}
    svc.submit("a1", "g1", _group("g1", 1))
    svc.stream._queues[0].join()
    time.sleep(0.05)
    report = svc.finish("a1", 0, ("g0", "g1"), "sd/ckpt/step-0/", "sd/batch/step-0.json")
    assert seen[0][0] == "g0" and seen[0][1] == base_cores
    # pinned to the lent core; the thread count is torch's process-wide setting, which another
    # trainer of the same test process may have changed meanwhile: the lease reports it (threads == 1)
    assert seen[1][:2] == ("g1", {int(core)})
    assert _worker_affinity(svc) == base_cores, "devices given back at finish"
    assert svc.stream.placement is None and svc._lease == ()
    m = report.metrics
    assert 0 < m["train/devices"] < 1 and m["train/devices_max"] == 1.0
    assert 0 < m["train/repurposed_at_s"] < m["train/returned_at_s"]
    assert m["train/repurposed_s"] == pytest.approx(m["train/returned_at_s"] - m["train/repurposed_at_s"])
    # the next round starts with no device lent and a fresh timeline
    svc.begin("a2", state, base)
    assert svc._lease == () and svc._devices.peak() == 0 and svc.stream.placement is None
    svc.close()
