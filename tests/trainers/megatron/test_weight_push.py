"""The megatron gang's collective weight push (``train.weight_sync: collective``): each pipeline
stage's (tp 0, dp 0) rank broadcasts its stage's TP-gathered buckets straight to the engines'
workers (here two workers: threads of the test receiving with ``engines.weight_transfer.receive``,
the outer edge), and what every worker gets is, bit for bit, what the gang's ``weights()`` hands
the object-store path."""

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


def _push_to_two_workers(mt: Any, bucket_bytes: int) -> tuple[Any, list[Any], list[dict[str, torch.Tensor]]]:
    """Open a group of the gang's senders (one per stage) and two engine workers (threads of this
    test: the outer edge), push once; (the gang's report, each worker's report, what each loaded)."""
    address, port = mt.weight_sender_address()
    senders = mt.weight_senders
    group = TransferGroup(address, port, senders + 2, senders, "gloo", 120.0, senders=senders)
    pgs: dict[int, Any] = {}
    threads = [
        threading.Thread(target=lambda r=r: pgs.__setitem__(r, wt.open_group(group, senders + r)))
        for r in (0, 1)
    ]
    for th in threads:
        th.start()
    mt.open_weight_group(group)
    for th in threads:
        th.join(timeout=120)
    loaded: list[dict[str, torch.Tensor]] = [{}, {}]
    reports: list[Any] = [None, None]

    def receive(r: int) -> None:
        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            assert not set(loaded[r]) & {n for n, _ in bucket}  # each tensor arrives once
            loaded[r].update({n: t.clone() for n, t in bucket})

        reports[r] = wt.receive(pgs[r], torch.device("cpu"), load)

    threads = [threading.Thread(target=receive, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    sent = mt.push_weights(bucket_bytes)
    for th in threads:
        th.join(timeout=120)
    return sent, reports, loaded


@pytest.mark.parametrize("split", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_a_gang_pushes_its_gathered_weights_bucket_by_bucket(
    gqa_tied: Path, ray_local: None, split: dict[str, int]
) -> None:
    """TP 2: the one stage's (tp 0, dp 0) rank sends; PP 2: each stage's rank sends its own layers
    (exact names and shapes), side by side, and every engine worker gets both stages."""
    from rollpacker.trainers.megatron.gang import MegatronTrainer

    mt = MegatronTrainer(gqa_tied, train_config(**split), temperature=0.8)
    try:
        assert mt.weight_senders == split.get("pp", 1)
        sent, reports, loaded = _push_to_two_workers(mt, 4096)  # small buckets: several of them
        want = dict(mt.weights(tied_head=False))  # a tied head is not sent: no engine loads it
        assert set(dict(mt.weights())) - set(want) == {"lm_head.weight"}
        for got, recv in zip(loaded, reports, strict=True):
            assert set(got) == set(want)
            assert all(got[n].shape == t.shape and torch.equal(got[n], t) for n, t in want.items())
            assert recv.buckets == sent.buckets > 3 and not recv.error
            assert recv.payload_bytes == sent.payload_bytes
        assert sent.payload_bytes == sum(t.numel() * t.element_size() for t in want.values())
        if split.get("pp"):  # the first stage sends the embedding, the last the final norm
            assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(want)
        with pytest.raises(TrainerError, match=r"sender\(s\) for a gang of"):
            mt.open_weight_group(
                TransferGroup("127.0.0.1", 1234, 5, 3, "gloo", senders=mt.weight_senders + 1)
            )
    finally:
        mt.close()
