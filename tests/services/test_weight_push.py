"""``train.weight_sync: collective`` in the trainer service: the update's weights go to the engine's
workers over a process group (the engine's side is the outer edge here: a worker thread that
receives with ``engines.weight_transfer.receive``), the group is set up once and again only when
the engine is not in it, a due Hugging Face export is still written, and a push that cannot run
falls back to the object store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines import weight_transfer as wt
from rollpacker.services.api import WeightPeer, WeightProbe, WeightPush
from tests.services.test_scaledown_runtime import _group
from tests.services.test_trainer_attempts import _service


class _Engine:
    """The rollout service's side of the push: one worker, receiving into a dict."""

    def __init__(self) -> None:
        self.pg: Any = None
        self.port = 0
        self.inits = 0
        self.loaded: dict[str, torch.Tensor] = {}
        self.by_store: list[int] = []
        self.broken = False
        self.receive_error: tuple[Exception, float] | None = None

    def weight_peer(self, port: int) -> WeightPeer:
        if self.broken:
            raise RuntimeError("the engine died")
        return WeightPeer(1, self.pg is not None and port == self.port)

    def init_weight_transfer(self, group: TransferGroup) -> None:
        self.inits += 1
        self.pg, self.port = wt.open_group(group, 1), group.port

    def receive_weights(self, policy_version: int, checkpoint_uri: str) -> WeightPush:
        got: dict[str, torch.Tensor] = {}
        t0 = time.monotonic()
        try:
            r = wt.receive(self.pg, torch.device("cpu"), lambda b: got.update({n: t.clone() for n, t in b}))
        except Exception as e:  # what the engine saw, and after how long
            self.receive_error = (e, time.monotonic() - t0)
            raise
        self.loaded = got
        return WeightPush(r.seconds, 1, r.buckets, r.payload_bytes)

    def load_weights(self, policy_version: int, checkpoint_uri: str, weights: dict[str, Any]) -> float:
        self.by_store.append(policy_version)
        return 0.0

    def probe(self, prompts: int, max_tokens: int) -> WeightProbe:
        return WeightProbe(0, (), (), ())  # no engine to sample: the weight-sync probe is skipped


class _Peers:
    def __init__(self) -> None:
        self.engine = _Engine()

    def rollout(self) -> _Engine:
        return self.engine

    def refresh(self) -> None:
        pass


@pytest.mark.slow  # a trainer on the small model, two updates (~20 s here)
def test_the_update_is_pushed_by_collective_once_a_group_is_up_and_by_the_store_when_it_cannot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = "train: {weight_sync: collective}\ncheckpoint: {export_every: 1}\n"
    svc, state, base = _service(tmp_path, monkeypatch, extra)
    peers = _Peers()
    svc._peers = peers  # the engine side of the push (_service bound the default peers)
    svc.begin("a0", state, base)
    try:
        for step in range(2):
            svc.submit("a0", f"g{step}", _group(f"g{step}", step))
            r = svc.finish("a0", step, (f"g{step}",), f"t/ckpt/s{step}/", f"t/batch/s{step}")
            want = dict(svc.trainer.weights(tied_head=False))
            assert "lm_head.weight" in dict(svc.trainer.weights()) and "lm_head.weight" not in want  # tied
            assert set(peers.engine.loaded) == set(want)
            assert all(torch.equal(peers.engine.loaded[n], t) for n, t in want.items())
            assert r.metrics["sync/collective"] == 1.0
            exported = svc.store().list(f"t/sync/export/step-{step:06d}-a0/")
            assert any(k.endswith(".safetensors") for k in exported), exported  # the HF export too
            assert r.metrics["sync/weights_bytes"] == sum(t.numel() * t.element_size() for t in want.values())
            state = state.successor(checkpoint_uri=r.checkpoint_uri, policy_version=r.policy_version)
            svc.begin(f"a{step + 1}", state, base)
            svc._attempt = "a0"  # the next finish is this attempt's again
        assert peers.engine.inits == 1 and peers.engine.by_store == []  # one group, reused

        # a send that fails half-way (the engine already waits in the group for the first bucket):
        # the group is closed, so the engine's receive fails at once, not at the group's timeout
        # (600 s), and the push goes through the object store
        real_send = wt.send

        def failing_send(*args: Any, **kwargs: Any) -> Any:
            time.sleep(0.5)  # the engine's receive is waiting
            raise RuntimeError("the trainer's device failed mid-push")

        monkeypatch.setattr(wt, "send", failing_send)
        svc.submit("a0", "g2", _group("g2", 2))
        t0 = time.monotonic()
        r = svc.finish("a0", 2, ("g2",), "t/ckpt/s2/", "t/batch/s2")
        assert time.monotonic() - t0 < 60, "the failed push waited for the group's timeout"
        assert peers.engine.by_store == [r.policy_version] and r.metrics["sync/collective"] == 0.0
        deadline = time.monotonic() + 90
        while peers.engine.receive_error is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert peers.engine.receive_error is not None, "the engine's receive still waits in the group"
        assert peers.engine.receive_error[1] < 30, peers.engine.receive_error
        monkeypatch.setattr(wt, "send", real_send)
        state = state.successor(checkpoint_uri=r.checkpoint_uri, policy_version=r.policy_version)
        svc.begin("a3", state, base)
        svc._attempt = "a0"
        svc.submit("a0", "g3", _group("g3", 3))
        r = svc.finish("a0", 3, ("g3",), "t/ckpt/s3/", "t/batch/s3")  # a new group, by collective
        assert peers.engine.inits == 2 and r.metrics["sync/collective"] == 1.0
        state = state.successor(checkpoint_uri=r.checkpoint_uri, policy_version=r.policy_version)
        svc.begin("a4", state, base)
        svc._attempt = "a0"

        peers.engine.broken = True  # no engine can receive: the object store takes the push
        svc.submit("a0", "g4", _group("g4", 4))
        r = svc.finish("a0", 4, ("g4",), "t/ckpt/s4/", "t/batch/s4")
        assert peers.engine.by_store == [3, r.policy_version] and r.metrics["sync/collective"] == 0.0
    finally:
        svc.close()


class _Stages:
    """A pipelined gang's side of the group (the outer edge): one sender per stage."""

    def __init__(self, pp: int) -> None:
        self.weight_senders = pp
        self.address = ("127.0.0.1", wt.free_port("127.0.0.1"))
        self.pgs: list[Any] = []

    def weight_sender_address(self) -> tuple[str, int]:
        return self.address

    def open_weight_group(self, group: TransferGroup) -> None:
        import threading

        self.pgs = [None] * group.senders
        threads = [
            threading.Thread(target=lambda s=s: self.pgs.__setitem__(s, wt.open_group(group, s)))
            for s in range(group.senders)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)


def test_a_pipelined_gang_opens_the_group_with_one_sender_per_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.services.trainer import TrainerService

    text = (
        f'experiment: t\nstore: {{endpoint: "file://{tmp_path}"}}\n'
        "train: {backend: megatron, weight_sync: collective, megatron: {pp: 2}}\n"
    )
    svc = TrainerService(text, "sync")
    peers = _Peers()
    got: list[TransferGroup] = []

    def join(group: TransferGroup) -> None:  # an engine of three workers at ranks 2..4
        got.append(group)
        import threading

        threads = [threading.Thread(target=wt.open_group, args=(group, 2 + w)) for w in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)

    monkeypatch.setattr(peers.engine, "init_weight_transfer", join)
    svc.bind(peers)  # type: ignore[arg-type]
    svc.trainer = _Stages(2)
    pg, port = svc._open_transfer(3)
    assert pg is None and port == svc.trainer.address[1]  # the handles stay with the gang's senders
    (group,) = got
    assert (group.senders, group.rank_offset, group.world_size, group.backend) == (2, 2, 5, "gloo")
    assert all(p is not None for p in svc.trainer.pgs)


def test_a_gang_rebuilt_after_a_lost_rank_opens_a_new_group_at_its_next_push(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group's senders are ranks of the gang: once the gang is rebuilt (a rank died), the old
    group is gone with them, and the engine, still a member of it, must not be pushed to over it
    (seen: the new gang's senders, in no group, sent nothing, and the engine waited for the dead
    sender's broadcast until the group's timeout)."""
    from rollpacker.services.trainer import TrainerService
    from rollpacker.trainers.megatron import gang, source

    text = (
        f'experiment: t\nstore: {{endpoint: "file://{tmp_path}"}}\n'
        "train: {backend: megatron, weight_sync: collective}\n"
    )
    svc = TrainerService(text, "sync")
    built: list[object] = []

    class _Source:
        def __init__(self, store: object, uri: str) -> None:
            self.uri = uri

        def exists(self, name: str) -> bool:
            return True  # a checkpoint with its optimizer state: not the base model

        def model(self) -> str:
            return self.uri

    class _Gang:
        broken = ""

        def __init__(self, *args: object, **kwargs: object) -> None:
            built.append(self)

        def restore(self, src: object) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(source, "StoreSource", _Source)
    monkeypatch.setattr(gang, "MegatronTrainer", _Gang)
    old = _Gang()
    svc.trainer = old  # type: ignore[assignment]
    svc._wt = (None, 12345)  # the group the old gang's senders opened with the engine
    svc._restore_megatron("s3://b/ckpt/s1/")  # the gang is whole: it reloads, the group stays
    assert svc.trainer is old and svc._wt == (None, 12345)
    old.broken = "rank 0 on node 10.0.0.2 died"  # type: ignore[misc]
    svc._restore_megatron("s3://b/ckpt/s1/")
    assert svc.trainer is not old and len(built) == 2
    assert svc._wt is None  # the next push opens a group with the new gang's senders
