"""Speculative decoding of the tail on the real vLLM engine: lossless (greedy tokens identical;
sampled distributions indistinguishable at T = 1 and T = 0.7 / top_p 0.9 with drafts on, accepted
drafts equal to their exact expectation under the target, processed logprobs equal to the plain
path's; greedy and sampled requests in one batch; planted biases caught), drafts counted, a
drafting failure decoded plainly."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollpacker.core.config import EngineConfig
from rollpacker.core.drafts import DraftStore, SpeculationConfig
from rollpacker.core.types import Completion, GenerationRequest, Prompt, SamplingSpec, request_id
from rollpacker.testing.lossless import LosslessReport, compare_samples

pytestmark = pytest.mark.slow

PROMPTS = 24
PER_PROMPT = 32  # 768 responses per sample: power against a 0.9-vs-1.0 temperature, p < 1e-5 here
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def warm_model() -> Path:
    """The bench tiny model after a short supervised warm-up on the math task (~40 s, cached): its
    responses have the task's structure, so siblings share most of their tokens and drafts from
    them are often right, as in RL (a random model's drafts almost never are)."""
    from rollpacker.tasks.warmup import WarmupSpec, warm_up

    return warm_up(WarmupSpec(model="bench", steps=400, batch_size=16))


def _task_prompts(warm_model: Path) -> list[Prompt]:
    from rollpacker.tasks.models import task_data

    return list(task_data("synthetic_math", 0, 200, 10, str(warm_model)).train_prompts[: PROMPTS + 1])


@pytest.fixture(scope="module")
def prompts(warm_model: Path) -> list[Prompt]:
    return _task_prompts(warm_model)[:PROMPTS]


@pytest.fixture(scope="module")
def unseen_prompt(warm_model: Path) -> Prompt:
    """A prompt no other test samples: its draft history is only what a test remembers for it."""
    return _task_prompts(warm_model)[PROMPTS]


def _engine(model: Path, spec: SpeculationConfig) -> Any:
    from rollpacker.engines.vllm_engine import VLLMEngine

    return VLLMEngine(
        EngineConfig(model_dir=str(model), max_num_seqs=128, max_model_len=256, speculation=spec)
    )


SPEC = SpeculationConfig(enabled=True, max_draft_tokens=4, adaptive=False)


@pytest.fixture(scope="module")
def plain(warm_model: Path) -> Any:
    eng = _engine(warm_model, SpeculationConfig())
    _OPEN.append(eng)
    return eng


@pytest.fixture(scope="module")
def speculative(warm_model: Path) -> Any:
    eng = _engine(warm_model, SPEC)
    _OPEN.append(eng)
    return eng


_round = iter(range(10**6))


def _stats(eng: Any) -> Any:
    st = eng.speculation_stats()
    assert st is not None, "speculation is on in this engine"
    return st


def _compare(a: list[Completion], b: list[Completion]) -> LosslessReport:
    """The losslessness check at the tests' settings: 16 positions, alpha 1e-3 (Bonferroni)."""
    return compare_samples([c.token_ids for c in a], [c.token_ids for c in b], positions=16, alpha=1e-3)


def _requests(
    temperature: float, prompts: list[Prompt], per_prompt: int, top_p: float = 1.0, first: int = 0
) -> list[GenerationRequest]:
    step = next(_round)
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=temperature, top_p=top_p)
    return [
        GenerationRequest(request_id(step, p.prompt_id, j), p, j, sampling)
        for p in prompts
        for j in range(first, first + per_prompt)
    ]


def _sample(
    eng: Any, temperature: float, prompts: list[Prompt], per_prompt: int = PER_PROMPT, top_p: float = 1.0
) -> list[Completion]:
    from rollpacker.rollout.driver import generate

    return generate(eng, _requests(temperature, prompts, per_prompt, top_p))


_PLAIN: dict[tuple[float, float], list[Completion]] = {}


def _plain_sample(
    plain: Any, temperature: float, prompts: list[Prompt], top_p: float = 1.0
) -> list[Completion]:
    """One sample without speculation per setting, shared by the tests that compare against it
    (each comparison is valid on its own; the suite pays for the reference once)."""
    if (temperature, top_p) not in _PLAIN:
        _PLAIN[(temperature, top_p)] = _sample(plain, temperature, prompts, top_p=top_p)
    return _PLAIN[(temperature, top_p)]


@dataclasses.dataclass(frozen=True)
class _Draft:
    request_id: str  # the rollout's id
    context: tuple[int, ...]  # prompt + response so far, as the proposer saw it
    prompt_len: int
    draft: tuple[int, ...]
    temperature: float


@contextlib.contextmanager
def _recording(eng: Any) -> Iterator[list[_Draft]]:
    """Every non-empty draft the engine's proposer returns while the block runs."""
    from rollpacker.engines.speculation import _INTERNAL_SUFFIX

    proposer = eng._proposer
    got: list[_Draft] = []

    def propose(sampled: Any, num_tokens: Any, token_ids: Any, *a: Any, **k: Any) -> list[list[int]]:
        out: list[list[int]] = type(proposer).propose(proposer, sampled, num_tokens, token_ids, *a, **k)
        batch = proposer._runner.input_batch
        for i, d in enumerate(out):
            if d:
                got.append(
                    _Draft(
                        _INTERNAL_SUFFIX.sub("", batch.req_ids[i]),
                        tuple(token_ids[i, : int(num_tokens[i])].tolist()),
                        int(batch.num_prompt_tokens[i]),
                        tuple(d),
                        float(batch.temperature_cpu[i]),
                    )
                )
        return out

    proposer.propose = propose
    try:
        yield got
    finally:
        del proposer.propose


def test_greedy_decoding_gives_the_same_tokens_with_speculation(
    plain: Any, speculative: Any, prompts: list[Prompt]
) -> None:
    off = _sample(plain, 0.0, prompts[:8], per_prompt=4)
    before = _stats(speculative)
    on = _sample(speculative, 0.0, prompts[:8], per_prompt=4)
    after = _stats(speculative)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]
    for a, b in zip(on, off, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert after.accepted_tokens > before.accepted_tokens  # drafts were in fact used


@pytest.fixture(scope="module")
def hf_model(warm_model: Path) -> Any:
    """The same weights in transformers: the independent reference for the target's probabilities."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(warm_model, dtype=torch.float32).eval()


def _processed(logits: Any, temperature: float, top_p: float) -> Any:
    """Probabilities as vLLM samples them: logits / temperature, then top-p (vLLM's rule: the
    smallest tokens whose cumulative probability is <= 1 - top_p dropped, at least one kept)."""
    probs = (logits.double() / temperature).softmax(-1)
    if top_p < 1:
        sorted_p, idx = probs.sort(dim=-1)
        drop = sorted_p.cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        probs = probs.masked_fill(drop.new_zeros(drop.shape).scatter(-1, idx, drop), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@dataclasses.dataclass(frozen=True)
class _Acceptance:
    accepted: int
    expected: float
    variance: float
    drafts: int

    @property
    def z(self) -> float:
        return (self.accepted - self.expected) / math.sqrt(max(self.variance, 1e-12))


def _acceptance(
    drafts: list[_Draft], out: dict[str, Completion], model: Any, top_p: float, eos: int, limit: int = 300
) -> _Acceptance:
    """Accepted drafted tokens against their exact expectation: a draft ``d`` of a deterministic
    drafter keeps its first ``j`` tokens with probability ``prod_{i<=j} p_T(d_i | context, d_<i)``
    (p_T: the target after temperature and top-p, from transformers). Observed from the final
    response: a rejected position is resampled from ``max(0, p - onehot(d))``, never ``d``, so the
    accepted count is the common prefix of the draft and what the response holds there. Drafts that
    hold eos or could run past max_tokens are left out (their outcome is not always observable)."""
    import torch

    acc, mean, var, n = 0, 0.0, 0.0, 0
    for d in drafts:
        c = out[d.request_id]
        g = len(d.context) - d.prompt_len
        if eos in d.draft or g + len(d.draft) >= MAX_TOKENS or d.temperature <= 0:
            continue
        assert tuple(c.token_ids[:g]) == d.context[d.prompt_len :]
        cont = c.token_ids[g : g + len(d.draft)]
        acc += next(
            (i for i, (a, b) in enumerate(zip(d.draft, cont, strict=False)) if a != b),
            min(len(d.draft), len(cont)),
        )
        with torch.no_grad():
            ids = torch.tensor([list(d.context) + list(d.draft[:-1])])
            logits = model(ids).logits[0, len(d.context) - 1 :]
        probs = _processed(logits, d.temperature, top_p)
        p = [float(probs[i, t]) for i, t in enumerate(d.draft)]
        keep = [math.prod(p[: j + 1]) for j in range(len(p))]  # P(first j+1 drafts accepted)
        m = sum(keep)
        mean += m
        var += sum(keep[max(i, j)] for i in range(len(p)) for j in range(len(p))) - m * m
        n += 1
        if n >= limit:
            break
    return _Acceptance(acc, mean, var, n)


def _same_context_logprobs(a: list[Completion], b: list[Completion]) -> list[float]:
    """|logprob difference| of every token that ``a`` and ``b`` sampled after the same prompt and
    the same preceding tokens: the same context and token, so the same processed logprob."""
    ref: dict[tuple[str, tuple[int, ...]], float] = {}
    for c in b:
        for i, lp in enumerate(c.logprobs):
            ref[(c.prompt_id, c.token_ids[: i + 1])] = lp
    return [
        abs(lp - ref[key])
        for c in a
        for i, lp in enumerate(c.logprobs)
        if (key := (c.prompt_id, c.token_ids[: i + 1])) in ref
    ]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampled_decoding_with_drafts_is_lossless(
    plain: Any, speculative: Any, prompts: list[Prompt], hf_model: Any, temperature: float, top_p: float
) -> None:
    """``sampled: auto`` drafts sampled requests where verification is exact (on this CPU: with the
    expand override, ``engines/verification.py``). With drafts on: the per-position token
    distribution equals plain sampling's, the accepted drafts match their exact expectation under
    the target (transformers), and the processed logprobs equal the plain path's."""
    from rollpacker.engines import speculation

    assert speculation.PROPOSERS[-1].sampled, "sampled drafts are off: the expand probe failed here"
    off = _plain_sample(plain, temperature, prompts, top_p)
    with _recording(speculative) as drafts:
        on = _sample(speculative, temperature, prompts, top_p=top_p)
    report = _compare(on, off)
    assert report.same, f"speculation changed the distribution: {report.worst()} p = {report.p_values}"
    acc = _acceptance(drafts, {c.request_id: c for c in on}, hf_model, top_p, speculative._eos)
    assert acc.drafts >= 100 and acc.accepted > 0
    assert abs(acc.z) < 4.5, f"{acc}: accepted {acc.accepted} vs exact {acc.expected:.1f} (z = {acc.z:.2f})"
    diffs = _same_context_logprobs(on, off)
    print(  # the figures docs/speculation.md quotes (pytest -s)
        f"T={temperature} top_p={top_p}: {acc.drafts} drafts, accepted {acc.accepted} tokens vs exact "
        f"{acc.expected:.1f} +- {math.sqrt(acc.variance):.1f} (z {acc.z:.2f}); {len(diffs)} same-context "
        f"logprobs, max |diff| {max(diffs, default=0.0):.1e}; p_min corrected {report.p_min_corrected:.2f}"
    )
    assert len(diffs) >= 200 and max(diffs) <= 1e-5, (len(diffs), max(diffs))


def test_a_batch_of_greedy_and_sampled_requests_is_verified_exactly(
    plain: Any, speculative: Any, prompts: list[Prompt]
) -> None:
    """Drafts on greedy and sampled requests in one batch (a greedy request's drafts are checked
    against the batch's processed logits too): every greedy response equals plain greedy
    decoding's, the sampled ones pass the distribution check."""
    from rollpacker.rollout.driver import generate

    greedy_off = _sample(plain, 0.0, prompts, per_prompt=1)
    sampled_off = _plain_sample(plain, 1.0, prompts)
    reqs = _requests(0.0, prompts, 1) + _requests(1.0, prompts, PER_PROMPT, first=1)
    with _recording(speculative) as drafts:
        mixed = generate(speculative, reqs)
    assert {d.temperature > 0 for d in drafts} == {False, True}, "drafts on both kinds of request"
    greedy_on, sampled_on = mixed[: len(prompts)], mixed[len(prompts) :]
    assert [c.token_ids for c in greedy_on] == [c.token_ids for c in greedy_off]
    report = _compare(sampled_on, sampled_off)
    assert report.same, f"the mixed batch changed the distribution: {report.worst()} p = {report.p_values}"


_OPEN: list[Any] = []


@pytest.fixture(scope="module", autouse=True)
def _close_engines_at_the_end() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def test_the_check_rejects_a_lower_temperature(plain: Any, prompts: list[Prompt]) -> None:
    """Power on a planted bias: temperature 0.8 against 1.0, both without speculation (0.9 went
    undetected once in 4 suite runs at alpha 1e-3: the engine's one random stream varies with what
    the module ran before)."""
    cold = _sample(plain, 0.8, prompts)
    warm = _plain_sample(plain, 1.0, prompts)
    report = _compare(cold, warm)
    assert not report.same, report.p_values


def test_the_check_accepts_two_samples_of_the_same_engine(plain: Any, prompts: list[Prompt]) -> None:
    """No false alarm: two independent samples without speculation are the same distribution."""
    a = _plain_sample(plain, 1.0, prompts)
    b = _sample(plain, 1.0, prompts)
    report = _compare(a, b)
    assert report.same, report.p_values


def test_drafts_and_acceptance_reach_the_step_stats(speculative: Any, prompts: list[Prompt]) -> None:
    from rollpacker.core.types import EngineStepStats

    steps: list[EngineStepStats] = []
    sampling = SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0)
    for j in range(4):
        speculative.add_request(
            GenerationRequest(request_id(10**5, prompts[0].prompt_id, j), prompts[0], j, sampling)
        )
    while speculative.has_unfinished():
        steps.append(speculative.step()[1])
    drafted = sum(s.spec_draft_tokens for s in steps)
    accepted = sum(s.spec_accepted_tokens for s in steps)
    assert drafted > 0 and 0 < accepted <= drafted
    assert sum(s.spec_draft_s for s in steps) > 0


def test_a_drafting_failure_decodes_the_step_plainly(
    plain: Any, speculative: Any, prompts: list[Prompt], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("planted drafting bug")

    errors0 = _stats(speculative).errors
    monkeypatch.setattr(DraftStore, "draft", broken)
    on = _sample(speculative, 0.0, prompts[:4], per_prompt=2)
    monkeypatch.undo()
    off = _sample(plain, 0.0, prompts[:4], per_prompt=2)
    assert [c.token_ids for c in on] == [c.token_ids for c in off]  # nothing lost, nothing changed
    assert _stats(speculative).errors > errors0


def test_the_proposer_reads_its_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollpacker.core.drafts import StepCurve
    from rollpacker.engines import speculation

    cfg = SpeculationConfig(enabled=True, max_draft_tokens=3, sources=("ngram",))
    curve = StepCurve((1, 128), (0.002, 0.01))
    monkeypatch.setenv(speculation.ENV, speculation.speculation_env(cfg, curve))
    got, got_curve = speculation._load_env()
    assert got == cfg and got_curve == curve
    assert json.loads(speculation.speculation_env(cfg, None))["config"]["sources"] == ["ngram"]


def test_remembered_history_drafts_a_new_group_of_its_prompt(
    plain: Any, speculative: Any, unseen_prompt: Prompt
) -> None:
    from rollpacker.core.drafts import DraftSource

    p = unseen_prompt
    (earlier,) = _sample(plain, 0.0, [p], per_prompt=1)
    assert plain.remember_drafts({p.prompt_id: [earlier.token_ids]}) == 0  # no proposer: nothing taken
    assert speculative.remember_drafts({p.prompt_id: [earlier.token_ids]}) == 1
    proposer = speculative._proposer
    from_history = proposer.store.drafted[DraftSource.HISTORY]
    before = _stats(speculative)
    (again,) = _sample(speculative, 0.0, [p], per_prompt=1)
    after = _stats(speculative)
    assert again.token_ids == earlier.token_ids  # greedy: the same response
    assert proposer.store.drafted[DraftSource.HISTORY] > from_history  # drafted from the history
    drafted = after.drafted_tokens - before.drafted_tokens
    # its own earlier response: nearly every draft right (the last may run past the end)
    assert drafted > 0 and (after.accepted_tokens - before.accepted_tokens) / drafted > 0.75
    assert speculative.forget_drafts() >= 1 and proposer.store.history_size(p.prompt_id) == 0
    assert plain.forget_drafts() == 0
