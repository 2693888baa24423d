"""The collective weight push into engines in layouts (``engines/layout_push.py``) over real gloo
groups: every replica of every started layout receives every stage's tensors at its own ranks, and
a layout started after the push (on demand, as on GPUs) serves the pushed weights from the rollout
service's copy. The engines are stand-ins whose workers receive with ``weight_transfer.receive``
(the outer edge: a vLLM engine's workers do the same, tests/engines/test_weight_transfer.py and
the slow test below on real vLLM)."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import EngineError
from rollpacker.core.latency import Layout
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines import weight_transfer as wt
from rollpacker.engines.fake import FakeEngine
from rollpacker.engines.layout import EnginePool, LayoutEngine, SwitchingEngine
from rollpacker.engines.layout_push import PushTargets

A, B = Layout(1, 2), Layout(2, 1)


class Workers(FakeEngine):
    """A TP-``tp`` engine whose workers join and receive the push as vLLM's do (one thread each)."""

    def __init__(self, tp: int) -> None:
        super().__init__(tp_size=tp)
        self.tp = tp
        self.ranks: list[int] = []
        self.pgs: list[Any] = []
        self.got: list[dict[str, torch.Tensor]] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def _each_worker(self, fn: Any) -> list[Any]:
        out: list[Any] = [None] * self.tp
        threads = [threading.Thread(target=lambda w=w: out.__setitem__(w, fn(w))) for w in range(self.tp)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        return out

    def init_weight_transfer(self, group: TransferGroup) -> None:
        self.ranks = [group.rank_offset + w for w in range(self.tp)]
        self.pgs = self._each_worker(lambda w: wt.open_group(group, self.ranks[w]))

    def receive_weights(self, policy_version: int, keep_dir: str = "") -> list[wt.PushReport]:
        self.got = [{} for _ in range(self.tp)]

        def one(w: int) -> wt.PushReport:
            load: Any = lambda b: self.got[w].update(dict(b))  # noqa: E731
            if keep_dir and w == 0:  # as the vLLM worker extension does
                load = wt.keeping(load, keep_dir)
            return wt.receive(self.pgs[w], torch.device("cpu"), load)

        return self._each_worker(one)

    def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.loaded = dict(named_tensors)


def _stages() -> list[list[tuple[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    first = [(f"model.layers.{i}.w", torch.randn(40, 8, generator=g)) for i in range(3)]
    last = [
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("lm_head.weight", torch.randn(32, 8, generator=g)),
    ]
    return [first, last]


def _push(targets: PushTargets, senders: int) -> tuple[list[wt.PushReport], list[wt.PushReport]]:
    """Open a group of ``senders`` stages and ``targets``, push each stage's tensors side by side."""
    group = TransferGroup(
        "127.0.0.1",
        wt.free_port("127.0.0.1"),
        senders + targets.workers,
        senders,
        "gloo",
        60.0,
        senders=senders,
    )
    stages = _stages() if senders == 2 else [[x for s in _stages() for x in s]]
    pgs: list[Any] = [None] * senders
    threads = [
        threading.Thread(target=lambda s=s: pgs.__setitem__(s, wt.open_group(group, s)))
        for s in range(senders)
    ]
    for th in threads:
        th.start()
    targets.join(group)
    for th in threads:
        th.join(timeout=60)
    sent: list[Any] = [None] * senders

    def send(s: int) -> None:
        sent[s] = wt.send(pgs[s], stages[s], 512, torch.device("cpu"))

    threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
    for th in threads:
        th.start()
    got = targets.receive(3)
    for th in threads:
        th.join(timeout=60)
    return sent, got


def _switching(resident: int) -> tuple[SwitchingEngine, dict[Layout, list[Workers]]]:
    reps = {A: [Workers(1), Workers(1)], B: [Workers(2)]}
    started = {A: reps[A]} if resident == 1 else reps
    pool = EnginePool.of({lay: LayoutEngine(lay, r) for lay, r in started.items()})
    pool.candidates = (A, B)
    pool.resident = resident
    return SwitchingEngine(pool, None, A, enabled=False), reps


@pytest.mark.parametrize("senders", [1, 2])
def test_every_replica_of_every_started_layout_gets_every_stages_tensors(senders: int) -> None:
    eng, reps = _switching(resident=2)
    targets = PushTargets(eng, "/nonexistent")
    assert targets.pool is None and not targets.keep_dir  # every layout started: no copy kept
    assert targets.workers == 4  # A: two TP-1 replicas, B: one TP-2 engine
    sent, got = _push(targets, senders)
    engines = reps[A] + reps[B]
    assert sorted(r for e in engines for r in e.ranks) == list(range(senders, senders + 4))
    want = {n: t for s in _stages() for n, t in s}
    for e in engines:
        for w in e.got:
            assert w.keys() == want.keys() and all(torch.equal(w[n], t) for n, t in want.items())
    assert len(got) == 4 and all(r.payload_bytes == sum(s.payload_bytes for s in sent) for r in got)


def test_a_layout_started_after_the_push_serves_the_pushed_weights(monkeypatch: Any, tmp_path: Path) -> None:
    """One layout fits at a time (GPUs at 0.9): the first engine's first worker keeps the push's
    copy on the node, and the layout started on demand loads it."""
    eng, reps = _switching(resident=1)
    with pytest.raises(EngineError, match="need a directory to keep"):
        PushTargets(eng)
    (tmp_path / "bucket-00007.safetensors").write_bytes(b"an older push's file")
    targets = PushTargets(eng, str(tmp_path))
    assert targets.pool is eng.pool and targets.workers == 2  # A's two TP-1 replicas
    key = targets.key
    _, got = _push(targets, 2)
    assert len(got) == 2 and not any(r.error for r in got)
    assert not (tmp_path / "bucket-00007.safetensors").exists()
    monkeypatch.setattr(
        LayoutEngine, "start", classmethod(lambda cls, cfg, lay, devices: cls(lay, reps[lay]))
    )
    eng.set_layout(B)  # closes A, starts B with the kept weights
    want = {n: t for s in _stages() for n, t in s}
    assert reps[B][0].loaded.keys() == want.keys()
    assert all(torch.equal(reps[B][0].loaded[n], t) for n, t in want.items())
    assert PushTargets(eng, str(tmp_path)).key != key  # B is not in the group: the next push opens a new one


def test_engines_that_take_no_push_are_refused_by_name() -> None:
    pool = EnginePool.of({A: LayoutEngine(A, [FakeEngine(), FakeEngine()])})
    with pytest.raises(EngineError, match="needs vLLM engines; FakeEngine takes none"):
        PushTargets(SwitchingEngine(pool, None, A, enabled=False))
    targets = PushTargets(Workers(1))
    with pytest.raises(EngineError, match="for 3 engine workers; these engines have 1"):
        targets.join(TransferGroup("127.0.0.1", 1234, 4, 1, "gloo"))
    with pytest.raises(EngineError, match="before the engines joined"):
        targets.receive(0)


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPU cores for TP 2 / DP 2")
def test_a_layout_started_on_demand_serves_the_collective_push_on_vllm(tmp_path: Path) -> None:
    """Real vLLM, one layout at a time (as on GPUs): TP 1 x DP 2 receives the push (flat
    embeddings: every token equally likely), then TP 2 starts on demand and serves the same."""
    from safetensors.torch import load_file

    from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
    from rollpacker.rollout.driver import generate
    from rollpacker.tasks.tiny_model import build_tiny_model

    cfg = EngineConfig(model_dir=str(build_tiny_model("tiny")), max_num_seqs=8, max_model_len=256)
    pool = EnginePool(cfg, (A, B), devices=["0", "1"], resident=1)
    try:
        eng = SwitchingEngine(pool, None, A, enabled=False)
        w = list(load_file(str(next(Path(cfg.model_dir).glob("*.safetensors")))).items())
        if not any(n == "lm_head.weight" for n, _ in w):
            w.append(("lm_head.weight", dict(w)["model.embed_tokens.weight"]))
        flat = [(n, t * 0 if n in ("model.embed_tokens.weight", "lm_head.weight") else t) for n, t in w]
        targets = PushTargets(eng, str(tmp_path))
        assert targets.workers == 2
        group = TransferGroup("127.0.0.1", wt.free_port("127.0.0.1"), 3, 1, "gloo", 300.0)
        out: dict[str, Any] = {}
        th = threading.Thread(target=lambda: out.setdefault("pg", wt.open_group(group, 0)))
        th.start()
        targets.join(group)
        th.join()
        th = threading.Thread(target=lambda: out.setdefault("sent", wt.send(out["pg"], flat, 2**16, "cpu")))
        th.start()
        reports = targets.receive(1)
        th.join()
        assert len(reports) == 2 and reports[0].payload_bytes == out["sent"].payload_bytes

        def logprobs(tag: str) -> list[float]:
            sp = SamplingSpec(max_tokens=4, temperature=0.0, ignore_eos=True)
            reqs = [GenerationRequest(f"{tag}/{i}", Prompt("w", (5, 6, 7, 8)), 0, sp) for i in range(2)]
            return [x for c in generate(eng, reqs) for x in c.logprobs]

        on_a = logprobs("a")
        eng.set_layout(B)  # A closes (one layout at a time), B starts on the kept copy
        assert pool.started == (B,)
        on_b = logprobs("b")
        uniform = -math.log(pool[B].vocab_size)
        assert on_a == pytest.approx([uniform] * 8, abs=1e-4) and on_b == pytest.approx(on_a, abs=1e-4)
    finally:
        pool.close()


def test_a_copy_that_cannot_be_written_is_dropped_and_the_push_still_loads(
    tmp_path: Path, monkeypatch: Any
) -> None:
    from safetensors import torch as st

    loaded: list[str] = []
    calls = {"n": 0}
    real = st.save_file

    def save_file(tensors: Any, path: str, **kw: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(28, "No space left on device")
        real(tensors, path, **kw)

    monkeypatch.setattr(st, "save_file", save_file)
    load = wt.keeping(lambda b: loaded.extend(n for n, _ in b), str(tmp_path))
    for i in range(3):
        load([(f"w{i}", torch.ones(4))])
    assert loaded == ["w0", "w1", "w2"]  # every bucket loaded
    assert calls["n"] == 2 and not list(tmp_path.iterdir())  # the partial copy is gone
    with pytest.raises(EngineError, match="no pushed weights kept in"):
        wt.read_kept(str(tmp_path))
