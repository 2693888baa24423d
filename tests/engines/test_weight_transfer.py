"""The collective weight push (``engines/weight_transfer.py``): bucketed, checked by digest, loaded
bucket by bucket; into a real vLLM engine through its weight-transfer API, it serves exactly the
weights the object-store path loads, and after an optimizer step the trainer's logprobs."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines import weight_transfer as wt


def _pair(
    named: list[tuple[str, torch.Tensor]], bucket_bytes: int, load: Callable[[list[Any]], Any]
) -> tuple[wt.PushReport, wt.PushReport]:
    """A push from rank 0 to rank 1 over gloo, both in this process (a thread each)."""
    group = TransferGroup("127.0.0.1", wt.free_port("127.0.0.1"), 2, 1, "gloo", 60.0)
    got: dict[str, wt.PushReport] = {}

    def worker() -> None:
        got["r"] = wt.receive(wt.open_group(group, 1), torch.device("cpu"), load)

    th = threading.Thread(target=worker)
    th.start()
    sent = wt.send(wt.open_group(group, 0), named, bucket_bytes, torch.device("cpu"))
    th.join(timeout=60)
    return sent, got["r"]


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    named = [(f"layers.{i}.w", torch.randn(64 + i, 8, generator=g)) for i in range(6)]
    named.append(("norm.bf16", torch.randn(33, generator=g).to(torch.bfloat16)))
    named.append(("big", torch.randn(2000, generator=g)))  # larger than a bucket: alone
    return named


def test_a_push_loads_every_tensor_bit_for_bit_one_bucket_at_a_time() -> None:
    named = _weights()
    loaded: list[list[tuple[str, torch.Tensor]]] = []
    sent, recv = _pair(named, 4096, lambda b: loaded.append([(n, t.clone()) for n, t in b]))
    flat = dict(x for b in loaded for x in b)
    assert list(flat) == [n for n, _ in named]
    assert all(torch.equal(flat[n], t) and flat[n].dtype == t.dtype for n, t in named)
    assert recv.buckets == sent.buckets == len(loaded) > 3 and not recv.error
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= 4096 or len(b) == 1 for b in loaded)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert sent.payload_bytes == recv.payload_bytes == total
    assert sent.copied_bytes == 0  # sent from the tensors' own storage
    assert recv.copied_bytes == total  # one receive buffer per tensor, nothing more


def test_a_corrupted_bucket_is_refused_by_index_and_nothing_after_it_loads(monkeypatch: Any) -> None:
    named = _weights()
    real = wt.digest
    calls = {"n": 0}

    def sender_digest(tensors: Any) -> tuple[int, int]:  # the sender's 3rd bucket: a wrong digest
        a, b = real(tensors)
        if threading.current_thread() is threading.main_thread():  # the sender; the worker is a thread
            calls["n"] += 1
            return (a + 1, b) if calls["n"] == 3 else (a, b)
        return a, b

    monkeypatch.setattr(wt, "digest", sender_digest)
    loaded: list[int] = []
    sent, recv = _pair(named, 4096, lambda b: loaded.append(len(b)))
    assert "bucket 2 " in recv.error and "buckets 0..1 were loaded" in recv.error
    assert len(loaded) == 2  # buckets 0 and 1 only
    assert recv.buckets == sent.buckets  # the rest was drained: both sides stay aligned
    from rollpacker.core.errors import EngineError

    with pytest.raises(EngineError, match=r"bucket 2 .*reload them from the checkpoint"):
        wt.check_report(recv, "push")


def test_each_stage_sends_its_own_tensors_and_every_worker_receives_all_of_them() -> None:
    """Two senders (pipeline stages) side by side, three engine workers (two engines: offsets 2 and
    4): every worker loads both stages' tensors, stage 0's first, bit for bit."""
    named = _weights()
    stages = [named[:4], named[4:]]
    group = TransferGroup("127.0.0.1", wt.free_port("127.0.0.1"), 5, 2, "gloo", 60.0, senders=2)
    loaded: dict[int, list[str]] = {r: [] for r in (2, 3, 4)}
    reports: dict[int, wt.PushReport] = {}
    sent: dict[int, wt.PushReport] = {}

    def worker(rank: int) -> None:
        def load(bucket: list[tuple[str, torch.Tensor]]) -> None:
            assert all(torch.equal(t, dict(named)[n]) for n, t in bucket)
            loaded[rank].extend(n for n, _ in bucket)

        pgs = wt.open_group(group.with_offset(4 if rank == 4 else 2), rank)
        assert len(pgs) == 2  # a member of each stage's group
        reports[rank] = wt.receive(pgs, torch.device("cpu"), load)

    def sender(stage: int) -> None:
        sent[stage] = wt.send(wt.open_group(group, stage), stages[stage], 4096, torch.device("cpu"))

    threads = [threading.Thread(target=worker, args=(r,)) for r in (2, 3, 4)]
    threads += [threading.Thread(target=sender, args=(s,)) for s in (1, 0)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert all(loaded[r] == [n for n, _ in named] for r in loaded)
    total = sum(t.numel() * t.element_size() for _, t in named)
    assert sent[0].payload_bytes + sent[1].payload_bytes == total
    assert all(r.payload_bytes == total and not r.error for r in reports.values())
    assert all(r.buckets == sent[0].buckets + sent[1].buckets for r in reports.values())


def test_a_senders_group_holds_it_and_every_worker_once() -> None:
    g = TransferGroup("127.0.0.1", 29500, 6, 2, "gloo", senders=2)
    assert g.workers == 4
    assert [g.sender_group(1, r)[1] for r in (1, 2, 3, 4, 5)] == [0, 1, 2, 3, 4]
    assert g.sender_group(0, 0) == ("rollpacker-weights/0", 0, 5)
    from rollpacker.core.errors import ConfigError

    with pytest.raises(ConfigError, match="sender 1 is no member of sender 0"):
        g.sender_group(0, 1)
    with pytest.raises(ConfigError, match="rank_offset 1 must leave"):
        TransferGroup("127.0.0.1", 29500, 6, 1, "gloo", senders=2)


def test_a_worker_loads_in_place_only_where_vllm_keeps_the_checkpoint_layout() -> None:
    assert wt.loads_in_place("cuda", None)  # the receive buffer and one copy: 2 full copies
    assert not wt.loads_in_place("cpu", None)  # vLLM on CPU repacks its GEMM weights
    assert not wt.loads_in_place("cuda", "fp8")  # quantized weights are processed after loading


def test_on_cpu_norms_and_embeddings_load_in_place_and_the_rest_layerwise() -> None:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    def layer(method: Any = None, params: bool = True) -> torch.nn.Module:
        m = torch.nn.Module()
        if params:
            m.weight = torch.nn.Parameter(torch.ones(4))
        if method is not None:
            m.quant_method = method
        return m

    assert wt.keeps_checkpoint_layout(layer())  # a norm: its weight is what the checkpoint holds
    assert wt.keeps_checkpoint_layout(layer(UnquantizedEmbeddingMethod()))  # packed copy kept aside
    assert not wt.keeps_checkpoint_layout(layer(UnquantizedLinearMethod()))  # CPU repacks its weight
    assert not wt.keeps_checkpoint_layout(layer(params=False))  # a container: nothing of its own


def test_a_tied_heads_second_name_is_dropped_from_an_in_place_load() -> None:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(5, 3)
    model.head = torch.nn.Linear(3, 5, bias=False)
    model.head.weight = model.embed.weight  # tied: one parameter, two names
    assert wt.tied_aliases(model) == frozenset({"head.weight"})
    calls: list[list[str]] = []
    load = wt.without(wt.tied_aliases(model), lambda b: calls.append([n for n, _ in b]))
    t = torch.zeros(1)
    load([("embed.weight", t), ("head.weight", t)])
    load([("head.weight", t)])  # a bucket of aliases only: nothing to load
    assert calls == [["embed.weight"]]
    # a worker that loads straight into its parameters (CUDA in place, CPU's norms and
    # embeddings) skips the alias; the layerwise reload (a quantized model) gets every name
    model.load_weights = lambda b: calls.append([n for n, _ in b])
    wt.bucket_loader(model, straight=True)([("embed.weight", t), ("head.weight", t)])
    wt.bucket_loader(model, straight=False)([("embed.weight", t), ("head.weight", t)])
    assert calls[1:] == [["embed.weight"], ["embed.weight", "head.weight"]]


@pytest.mark.slow
def test_a_collective_push_into_vllm_serves_the_trainers_weights(tmp_path: Any) -> None:
    """One tiny engine (~1-2 min to start here): the collective push loads the same parameters as
    the object-store path, and after an optimizer step the engine's logprobs are the trainer's."""
    from rollpacker.core.config import EngineConfig, TrainerConfig
    from rollpacker.engines.vllm_engine import VLLMEngine
    from rollpacker.tasks.tiny_model import build_tiny_model
    from rollpacker.trainers.torch_trainer import TorchTrainer
    from tests.trainers.test_weight_sync import LOGPROB_TOL, _max_diff, _sample

    model_dir = build_tiny_model("micro")
    engine = VLLMEngine(
        EngineConfig(model_dir=str(model_dir), max_num_seqs=16, max_model_len=256, kv_cache_gib=1)
    )
    try:
        trainer = TorchTrainer(model_dir, TrainerConfig(lr=5e-3, grad_clip=0.0), temperature=1.0)
        group = TransferGroup("127.0.0.1", wt.free_port("127.0.0.1"), 2, 1, "gloo", 300.0)
        th = threading.Thread(target=engine.init_weight_transfer, args=(group,))
        th.start()
        pg = wt.open_group(group, 0)
        th.join()

        def push(version: int) -> tuple[wt.PushReport, list[wt.PushReport]]:
            out: dict[str, Any] = {}
            th = threading.Thread(target=lambda: out.setdefault("r", engine.receive_weights(version)))
            th.start()
            sent = wt.send(pg, trainer.weights(tied_head=False), 2**16, torch.device("cpu"))
            th.join()
            return sent, out["r"]

        def params() -> dict[str, torch.Tensor]:
            got = engine._engine.collective_rpc(
                lambda w: {n: p.detach().clone() for n, p in w.model_runner.model.named_parameters()}
            )
            return dict(got[0])

        engine.load_weights(trainer.weights())  # the object-store path's load
        by_store = params()
        sent, (recv,) = push(0)
        assert recv.buckets == sent.buckets > 1 and recv.payload_bytes == sent.payload_bytes
        # the micro model ties its head: it is not sent, and the engine still serves it (below)
        state = dict(trainer.weights())
        head = state.pop("lm_head.weight")
        assert head.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        assert sent.payload_bytes == sum(t.numel() * t.element_size() for t in state.values())
        # the micro model ties its head: the head's name is not sent, its embedding is
        state = dict(trainer.weights())
        assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
        assert sent.payload_bytes == sum(t.numel() * t.element_size() for t in state.values()) - (
            state["lm_head.weight"].numel() * state["lm_head.weight"].element_size()
        )
        by_collective = params()
        assert all(torch.equal(by_collective[n], t) for n, t in by_store.items())

        before = _sample(engine, "c/before", 1.0)
        trainer.accumulate(before)
        trainer.finish_step()
        assert _max_diff(trainer, before) > 20 * LOGPROB_TOL  # the step moved the logprobs
        push(1)
        after = _sample(engine, "c/after", 1.0)
        assert _max_diff(trainer, after) <= LOGPROB_TOL
    finally:
        engine.close()
