"""The round SortedRL and partial rollout run on, over their rollout buffer (its entries and their
JSON: ``core.policies.entries``).

A buffered policy keeps prompts (and, in its partial modes, their unfinished and finished
responses) between steps in a ``RolloutBuffer``: the controller state's ``partial_cache``, so a
restart never loses a cached response. Each step a ``BufferedRound`` launches the buffered
prompts, resuming every cached partial response after its tokens, and optionally supplements
new prompts to keep ``in_flight`` requests running; it ends as soon as ``P0`` prompts have ``R0``
finished responses each (early termination / interruption) and aborts everything still running.
What it did not train goes back to the buffer: with ``keep_partial`` the interrupted responses
keep their tokens, logprobs and per-token policy versions, and finished responses of prompts that
are not complete yet are kept too; without it (on-policy) only the prompt goes back.

Invariants (tests/core/test_buffered_policies.py):
- exactly ``P0`` groups of exactly ``R0`` responses per step, each response sampled for its prompt;
- a resumed response's tokens keep the logprobs and versions they were sampled with: the trained
  response is the cached prefix followed by what the engine added, token for token;
- every launched prompt is trained or back in the buffer, never both, never neither;
- without ``keep_partial`` every trained token was sampled in this round (no older policy);
- a group's responses are listed in the update in ascending mean length (selective batching);
- ``due`` prompts (the partial policy's staleness bound) are never interrupted: the round ends only
  when the first ``P0`` of them are complete, and they take the update's first slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from rollpacker.core.errors import PolicyError
from rollpacker.core.policies.base import Round, SamplingFactory
from rollpacker.core.policies.entries import BufferEntry, CachedSample
from rollpacker.core.types import (
    Actions,
    Completion,
    FinishReason,
    GenerationRequest,
    Group,
    Prompt,
    RoundResult,
    StepPlan,
    request_id,
)


@dataclass
class _Progress:
    prompt: Prompt
    entry: BufferEntry
    live: set[str]
    finished: list[Completion]
    complete: bool = False


class BufferedRound(Round):
    """One step of a buffered policy (see the module docstring)."""

    def __init__(
        self,
        plan: StepPlan,
        entries: Sequence[tuple[Prompt, BufferEntry]],
        sampling: SamplingFactory,
        namespace: str = "",
        keep_partial: bool = False,
        supplement: Sequence[Prompt] = (),
        in_flight: int = 0,
        due: Sequence[str] = (),
    ) -> None:
        if len(entries) + len(supplement) < plan.target_prompts:
            raise PolicyError(
                f"step {plan.step}: {len(entries)} buffered and {len(supplement)} new prompts cannot "
                f"fill {plan.target_prompts} groups"
            )
        self.plan = plan
        self._entries = list(entries)
        self._sampling = sampling
        self._namespace = namespace
        self._keep = keep_partial
        self._pool = list(supplement)
        self.supplemented = 0  # prompts of the pool launched (a prefix of it)
        self._in_flight = in_flight
        self._progress: dict[str, _Progress] = {}  # in launch order
        self._ranks: dict[str, int] | None = None
        self._owner: dict[str, str] = {}
        self._complete: set[str] = set()  # prompts with R0 finished responses
        self._selected: list[str] = []  # complete prompts in the update, in the order they completed
        # Due prompts must finish in this step (the partial policy's staleness bound): never
        # interrupted, trained first. The update takes the first P0 of them and fills the rest of
        # its P0 slots with other prompts in completion order.
        self._due = list(due)[: plan.target_prompts]
        self._due_all = set(due)
        self._quota = plan.target_prompts - len(self._due)
        self._taken = 0  # non-due prompts selected
        self._handed_out = 0
        self._cached: list[Completion] = []
        self._discarded: list[Completion] = []
        self._started = False

    # -- launching --------------------------------------------------------------------------------
    def _launch(self, prompt: Prompt, entry: BufferEntry) -> list[GenerationRequest]:
        r0 = self.plan.target_responses
        prog = _Progress(prompt, entry, set(), [])
        self._progress[prompt.prompt_id] = prog
        for s in entry.finished:
            prog.finished.append(s.as_completion(prompt.prompt_id))
        reqs: list[GenerationRequest] = []
        used = {s.sample_index for s in entry.samples}
        resumed = list(entry.unfinished)
        fresh = (j for j in range(10**6) if j not in used)
        while len(prog.finished) + len(resumed) + len(reqs) < r0:
            j = next(fresh)
            reqs.append(self._request(prompt, j, None))
        for s in resumed:
            spec = self._sampling(prompt, s.sample_index)
            if len(s.token_ids) >= spec.max_tokens:  # it was cut exactly at its length limit
                done = dataclasses.replace(s, finish_reason=FinishReason.LENGTH)
                prog.finished.append(done.as_completion(prompt.prompt_id))
                continue
            reqs.append(self._request(prompt, s.sample_index, s))
        for r in reqs:
            prog.live.add(r.request_id)
            self._owner[r.request_id] = prompt.prompt_id
        return reqs

    def _request(self, prompt: Prompt, j: int, resume: CachedSample | None) -> GenerationRequest:
        rid = request_id(self.plan.step, prompt.prompt_id, j, namespace=self._namespace)
        spec = self._sampling(prompt, j)
        if resume is None:
            return GenerationRequest(request_id=rid, prompt=prompt, sample_index=j, sampling=spec)
        return GenerationRequest(
            request_id=rid,
            prompt=prompt,
            sample_index=j,
            sampling=dataclasses.replace(spec, max_tokens=spec.max_tokens - len(resume.token_ids)),
            prefix_token_ids=resume.token_ids,
            prefix_logprobs=resume.logprobs,
            prefix_versions=resume.versions,
        )

    def _supplement(self) -> list[GenerationRequest]:
        out: list[GenerationRequest] = []
        # only while the update still has free slots: a prompt launched after them could only
        # complete into the buffer (the round may run on for due prompts alone)
        while (
            not self.done
            and self._taken < self._quota
            and self._live() < self._in_flight
            and self.supplemented < len(self._pool)
        ):
            p = self._pool[self.supplemented]
            self.supplemented += 1
            out.extend(self._launch(p, BufferEntry(p.prompt_id, self.plan.step)))
            self._check_complete(p.prompt_id)
        return out

    def _rank(self, pid: str) -> int:
        """Launch order (``_progress`` keeps insertion order)."""
        if self._ranks is None or len(self._ranks) != len(self._progress):
            self._ranks = {p: i for i, p in enumerate(self._progress)}
        return self._ranks[pid]

    def _live(self) -> int:
        return len(self._owner)

    def start(self) -> Actions:
        if self._started:
            raise PolicyError(f"step {self.plan.step}: round started twice")
        self._started = True
        reqs: list[GenerationRequest] = []
        launched = [(p, e, self._launch(p, e)) for p, e in self._entries]
        # Prompts complete from the cache are ready trajectories: shortest first (selective batching).
        ready = sorted(
            (p.prompt_id for p, _, _ in launched if self._ready(p.prompt_id)),
            key=lambda pid: (_mean_len(self._progress[pid].finished), self._rank(pid)),
        )
        for pid in ready:
            self._check_complete(pid)
        for _, _, rs in launched:
            reqs.extend(rs)
        if self.done:  # the cache alone filled the update: launch nothing, keep what waits
            for r in reqs:
                del self._owner[r.request_id]
                self._progress[r.prompt.prompt_id].live.discard(r.request_id)
            for p, e, _ in launched:
                if p.prompt_id not in self._selected:
                    self._cached.extend(s.as_completion(p.prompt_id) for s in e.unfinished)
            return Actions()
        reqs.extend(self._supplement())
        return Actions(submit=tuple(reqs))

    # -- observing --------------------------------------------------------------------------------
    def _ready(self, pid: str) -> bool:
        return len(self._progress[pid].finished) >= self.plan.target_responses

    def _check_complete(self, pid: str) -> bool:
        """Mark ``pid`` complete if it is; True when that puts it in the update."""
        prog = self._progress[pid]
        if prog.complete or self.done or not self._ready(pid):
            return False
        prog.complete = True
        self._complete.add(pid)
        if pid in self._due:
            self._selected.append(pid)
            return True
        if pid not in self._due_all and self._taken < self._quota:
            self._taken += 1
            self._selected.append(pid)
            return True
        return False  # complete, but the update is full: it waits in the buffer

    def observe(self, completion: Completion) -> Actions:
        pid = self._owner.pop(completion.request_id, None)
        if pid is None:
            raise PolicyError(
                f"step {self.plan.step}: completion for unknown or finished request {completion.request_id!r}"
            )
        prog = self._progress[pid]
        prog.live.discard(completion.request_id)
        if not completion.finish_reason.is_natural:
            # interrupted: its tokens are resumed next step (partial modes) or thrown away
            if self._keep and completion.num_tokens > 0:
                self._cached.append(completion)
            else:
                self._discarded.append(completion)
            return Actions()
        prog.finished.append(completion)
        if self._check_complete(pid) and self.done:
            rest = tuple(sorted(self._owner))
            return Actions(abort=rest)  # interruption: the update batch is full
        if self.done:
            return Actions()
        return Actions(submit=tuple(self._supplement()))

    @property
    def done(self) -> bool:
        return len(self._selected) >= self.plan.target_prompts

    def take_completed(self) -> tuple[Group, ...]:
        new = self._selected[self._handed_out :]
        self._handed_out = len(self._selected)
        return tuple(self._group(pid) for pid in new)

    def _group(self, pid: str) -> Group:
        prog = self._progress[pid]
        return Group(prompt=prog.prompt, responses=tuple(prog.finished[: self.plan.target_responses]))

    def result(self) -> RoundResult:
        if not self.done:
            raise PolicyError(
                f"step {self.plan.step}: result asked for before the round is done "
                f"({len(self._selected)}/{self.plan.target_prompts} prompts of the update complete)"
            )
        if self._owner:
            raise PolicyError(
                f"step {self.plan.step}: {len(self._owner)} requests still running; the runtime must "
                "apply every abort before asking for the result"
            )
        groups = sorted(
            (self._group(pid) for pid in self._selected),
            key=lambda g: (_mean_len(g.responses), self._rank(g.prompt.prompt_id)),
        )
        trained = set(self._selected)
        deferred = tuple(prog.prompt for pid, prog in self._progress.items() if pid not in trained)
        cached = list(self._cached)
        discarded = list(self._discarded)
        for p in deferred:
            for c in self._progress[p.prompt_id].finished:
                if self._keep:
                    cached.append(c)
                elif c.num_tokens > c.resumed_tokens:
                    discarded.append(c)
        if not self._keep:
            cached = []
        return RoundResult(
            plan=self.plan,
            groups=tuple(groups),
            deferred=deferred,
            discarded=tuple(discarded),
            cached=tuple(cached),
        )


def _mean_len(cs: Sequence[Completion]) -> float:
    return sum(c.num_tokens for c in cs) / len(cs) if cs else 0.0
