"""The megatron gang's collective weight push (``train.weight_sync: collective``): its (tp 0, dp 0)
rank broadcasts each TP-gathered bucket straight to the engine's workers (here one worker: a thread
of the test receiving with ``engines.weight_transfer.receive``, the outer edge), and what arrives
is, bit for bit, what the gang's ``weights()`` hands the object-store path."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.errors import TrainerError
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines import weight_transfer as wt

from .exactness import train_config

pytestmark = pytest.mark.slow  # a gang of 2 ranks (~20-40 s here)


@pytest.fixture
def ray_local() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    yield
    if started and ray.is_initialized():
        ray.shutdown()


def test_a_tp2_gang_pushes_its_gathered_weights_bucket_by_bucket(gqa_tied: Path, ray_local: None) -> None:
    from rollpacker.trainers.megatron.gang import MegatronTrainer

    mt = MegatronTrainer(gqa_tied, train_config(tp=2), temperature=0.8)
    try:
        address, port = mt.weight_sender_address()
        group = TransferGroup(address, port, 2, 1, "gloo", 120.0)
        got: dict[str, Any] = {}
        loaded: list[int] = []

        def engine() -> None:
            pg = wt.open_group(group, 1)
            got["pg"] = pg

        th = threading.Thread(target=engine)
        th.start()
        mt.open_weight_group(group)
        th.join(timeout=120)

        def receive() -> None:
            def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
                loaded.append(len(bucket))
                got.update({n: t.clone() for n, t in bucket})

            got["report"] = wt.receive(got["pg"], torch.device("cpu"), load)

        th = threading.Thread(target=receive)
        th.start()
        sent = mt.push_weights(4096)  # small buckets: several of them
        th.join(timeout=120)
        recv = got.pop("report")
        got.pop("pg")
        want = dict(mt.weights())
        assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())
        assert recv.buckets == sent.buckets == len(loaded) > 3 and not recv.error
        assert (
            sent.payload_bytes
            == recv.payload_bytes
            == sum(t.numel() * t.element_size() for t in want.values())
        )
        # a pipelined gang would need a sender per stage: refused by name
        mt.pp = 2
        with pytest.raises(TrainerError, match=r"pp = 2.*use pp: 1"):
            mt.weight_sender_address()
    finally:
        mt.close()
