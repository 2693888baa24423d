"""The megatron gang (Ray actors, gloo, CPU) against the torch backend and against itself.

One RL update from the same samples: gradients within 1e-5 relative and SGD weights within 1e-5
of the torch backend at TP=1, TP=2, PP=2 and DP=2; TP=2 / PP=2 / DP=2 within 1e-6 of megatron's
own TP=1; the streamed gradient (groups in random order and chunks, spread over DP replicas) equals
the monolithic one, and so does the stream trainer's update with both replicas computing at once;
a TP=2 checkpoint loads at TP=1 x DP=2; an Adam run resumes exactly from a dist_checkpointing
checkpoint with the distributed optimizer; a dead rank fails the call by name.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.config import MegatronConfig, TrainerConfig
from rollpacker.core.errors import TrainerError

from .exactness import Run, batch, logprob_err, megatron_run, rel, stream, torch_run, train_config

pytestmark = pytest.mark.slow  # each test starts a gang of 1-2 processes (~10-30 s here)


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    import ray

    started = not ray.is_initialized()
    yield
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="module")
def torch_ref(gqa_tied: Path) -> Run:
    return torch_run(gqa_tied)


@pytest.fixture(scope="module")
def tp1(gqa_tied: Path, ray_local: None) -> Run:
    run, mt = megatron_run(gqa_tied)
    mt.close()
    return run


@pytest.fixture(scope="module")
def tp2(gqa_tied: Path, ray_local: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    run, mt = megatron_run(gqa_tied, tp=2)
    try:
        ck = mt.save_checkpoint(tmp_path_factory.mktemp("tp2") / "ckpt")
    finally:
        mt.close()
    return run, ck


def _check(run: Run, torch_ref: Run, tp1: Run | None) -> None:
    assert float(sum(g.norm() for g in torch_ref.grads.values())) > 0
    assert rel(run.grads, torch_ref.grads) <= 1e-5
    assert rel(run.weights, torch_ref.weights) <= 1e-5
    assert logprob_err(run.logprobs, torch_ref.logprobs) <= 1e-5
    if tp1 is not None:
        assert rel(run.grads, tp1.grads) <= 1e-6
        assert rel(run.weights, tp1.weights) <= 1e-6
    # the tied head is exported too (vLLM on CPU keeps its own copy)
    assert torch.equal(run.weights["lm_head.weight"], run.weights["model.embed_tokens.weight"])


def test_tp1_matches_torch(torch_ref: Run, tp1: Run) -> None:
    _check(tp1, torch_ref, None)


def test_tp2_matches_torch_and_tp1(torch_ref: Run, tp1: Run, tp2: tuple[Run, Path]) -> None:
    _check(tp2[0], torch_ref, tp1)


def test_pp2_matches_torch_and_tp1(gqa_tied: Path, torch_ref: Run, tp1: Run, ray_local: None) -> None:
    run, mt = megatron_run(gqa_tied, pp=2)
    mt.close()
    _check(run, torch_ref, tp1)


def test_dp2_streamed_equals_monolithic_and_loads_a_tp2_checkpoint(
    gqa_tied: Path, torch_ref: Run, tp1: Run, tp2: tuple[Run, Path], ray_local: None
) -> None:
    from rollpacker.trainers.megatron.gang import MegatronTrainer
    from rollpacker.trainers.stream import StreamTrainer

    mt = MegatronTrainer(gqa_tied, train_config(dp=2), temperature=0.8)
    try:
        mt.accumulate([s for g in batch() for s in g])  # monolithic: one chunk
        assert min(mt._tokens) > 0  # both replicas got groups
        mono = mt.grads_hf()
        for seed in (3, 4):  # random order, random chunks
            stream(mt, seed)
            assert rel(mt.grads_hf(), mono) <= 1e-6
        assert rel(mono, tp1.grads) <= 1e-6 and rel(mono, torch_ref.grads) <= 1e-5
        st = StreamTrainer(mt)  # the stream trainer: one lane per replica, both computing at once
        try:
            assert st.lanes == 2
            for g in random.Random(5).sample(batch(), 6):
                st.submit(g)
            st.finish()
        finally:
            st.close()
        weights = dict(mt.weights())
        assert rel(weights, tp1.weights) <= 1e-6 and rel(weights, torch_ref.weights) <= 1e-5
        # saved at TP=2 x DP=1, loaded at TP=1 x DP=2: the same weights, bit for bit
        mt.load_checkpoint(tp2[1])
        assert mt.policy_version == 1
        for name, t in tp2[0].weights.items():
            assert torch.equal(dict(mt.weights())[name], t), name
    finally:
        mt.close()


def _adam(**kw: Any) -> TrainerConfig:
    m = MegatronConfig(dp=2, distributed_optimizer=True, **kw)
    return TrainerConfig(lr=1e-3, grad_clip=1.0, tokens_per_micro_batch=64, backend="megatron", megatron=m)


def _streamed_checkpoint(mt: Any, tmp_path: Path) -> Path:
    """``store_checkpoint`` into a file store: each rank uploads its own shard files, the HF
    weights go up one bucket file at a time; the download is a checkpoint ``load_checkpoint`` reads."""
    from safetensors.torch import load_file

    from rollpacker.core.config import StoreConfig
    from rollpacker.store import open_store

    cfg = StoreConfig(endpoint=f"file://{tmp_path / 'store'}")
    store = open_store(cfg)
    uri_key = store.key_of
    small = mt.mcfg
    mt.mcfg = dataclasses.replace(small, bucket_mb=0.05)  # several HF files
    try:
        uri = mt.store_checkpoint(store, cfg, "exp/arm/ckpt/step-000000-a/")
    finally:
        mt.mcfg = small
    keys = store.list("exp/arm/ckpt/step-000000-a/")
    # the ranks' shard files (DP replicas save a replicated tensor once) and rank 0's metadata
    assert any(k.endswith(".distcp") for k in keys) and f"{uri_key(uri)}dist/.metadata" in keys, keys
    assert sum("/model/model-" in k for k in keys) > 1, keys
    assert not list(Path(tempfile.gettempdir()).glob("rollpacker-dist-r*"))  # no scratch left behind
    ck = store.download_dir(uri, tmp_path / "ck")
    hf: dict[str, Any] = {}
    for f in sorted((ck / "model").glob("*.safetensors")):
        hf.update(load_file(str(f)))
    now = dict(mt.weights())
    assert set(hf) == set(now) and all(torch.equal(hf[n], now[n]) for n in hf)
    return ck


def test_adam_resume_is_exact_with_the_distributed_optimizer(
    gqa_untied: Path, tmp_path: Path, ray_local: None
) -> None:
    from rollpacker.trainers.megatron.gang import MegatronTrainer
    from rollpacker.trainers.torch_trainer import TorchTrainer

    cfg = _adam()
    ref = TorchTrainer(gqa_untied, dataclasses.replace(cfg, backend="torch"), temperature=0.8)
    samples = [s for g in batch() for s in g]
    mt = MegatronTrainer(gqa_untied, cfg, temperature=0.8)
    try:
        assert logprob_err(mt.logprobs(samples), ref.logprobs(samples)) <= 1e-5  # untied head
        stream(mt, 0)
        first = mt.finish_step()
        ref.accumulate(samples)
        want = ref.finish_step()
        assert first.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
        assert first.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-7)
        ck = _streamed_checkpoint(mt, tmp_path)
        stream(mt, 1)
        mt.finish_step()
        after = dict(mt.weights())
        mt.load_checkpoint(ck)  # weights and Adam moments (sharded over DP) back to step 1
        assert mt.policy_version == 1
        stream(mt, 1)
        mt.finish_step()
        again = dict(mt.weights())
        for name, t in after.items():
            assert torch.equal(again[name], t), name
        # buckets bounded by bucket_mb (a larger tensor comes alone), together all weights
        mt.mcfg = dataclasses.replace(mt.mcfg, bucket_mb=4096 / 2**20)
        buckets = list(mt.weight_buckets())
        assert len(buckets) > 3
        for b in buckets:
            size = sum(t.numel() * t.element_size() for t in b.values())
            assert size <= 4096 or len(b) <= 3  # one megatron tensor (qkv: 3 HF tensors)
        assert {n for b in buckets for n in b} == set(again)
        # a rank that dies fails the next call by name, and the gang is marked for a rebuild
        import ray

        ray.kill(mt.actors[1])
        with pytest.raises(TrainerError, match=r"rank 1 on node [\d.]+ died during accumulate"):
            mt.accumulate(samples)  # groups on both replicas
        assert mt.broken
    finally:
        mt.close()
