"""The rollout buffer's contents: the prompts a buffered policy (SortedRL, partial rollout) keeps
between steps, each with the responses cached for it, and their JSON (the controller state's
``partial_cache``, and the blob the rollout service stores for the commit).

Invariants (tests/core/test_buffered_policies.py):
- a cached sample's tokens, logprobs and per-token policy versions have the same length, and an
  aborted response is kept unfinished (no finish reason);
- a buffer entry holds each sample index at most once;
- ``buffer_from_json(buffer_to_json(b)) == b``; anything else is refused by name;
- the buffer after a round holds exactly its deferred prompts, each with the responses it cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rollpacker.core.errors import PolicyError
from rollpacker.core.types import Completion, FinishReason, RoundResult


@dataclass(frozen=True)
class CachedSample:
    """One response kept in the buffer: finished (``finish_reason`` set) or to be resumed."""

    sample_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[int, ...]  # the policy version that sampled each token
    finish_reason: FinishReason | None = None
    request_id: str = ""

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise PolicyError(
                f"cached sample {self.request_id or self.sample_index!r}: {len(self.token_ids)} tokens, "
                f"{len(self.logprobs)} logprobs and {len(self.versions)} versions must match"
            )
        if self.finish_reason is FinishReason.ABORT:
            raise PolicyError(f"cached sample {self.request_id!r}: an aborted response is kept unfinished")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def staleness(self, version: int) -> int:
        """How many versions older than ``version`` its oldest token is (0 without tokens)."""
        return version - min(self.versions) if self.versions else 0

    @classmethod
    def from_completion(cls, c: Completion) -> CachedSample:
        return cls(
            sample_index=c.sample_index,
            token_ids=c.token_ids,
            logprobs=c.logprobs,
            versions=c.token_versions,
            finish_reason=c.finish_reason if c.finish_reason.is_natural else None,
            request_id=c.request_id,
        )

    def as_completion(self, prompt_id: str) -> Completion:
        """The cached response as a completion whose tokens are all resumed (an unfinished one
        as aborted)."""
        return Completion(
            request_id=self.request_id,
            prompt_id=prompt_id,
            sample_index=self.sample_index,
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or FinishReason.ABORT,
            policy_version=max(self.versions, default=0),
            resumed_tokens=len(self.token_ids),
            prefix_versions=self.versions,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_index": self.sample_index,
            "token_ids": list(self.token_ids),
            "logprobs": list(self.logprobs),
            "versions": _rle(self.versions),
            "finish_reason": self.finish_reason.value if self.finish_reason else None,
            "request_id": self.request_id,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> CachedSample:
        if not isinstance(d, dict):
            raise PolicyError(f"{where}: a cached sample must be an object, got {type(d).__name__}")
        try:
            fr = d.get("finish_reason")
            return cls(
                sample_index=int(d["sample_index"]),
                token_ids=tuple(int(t) for t in d["token_ids"]),
                logprobs=tuple(float(x) for x in d["logprobs"]),
                versions=_unrle(d["versions"]),
                finish_reason=FinishReason(fr) if fr is not None else None,
                request_id=str(d.get("request_id", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PolicyError(f"{where}: malformed cached sample ({e!r})") from e


@dataclass(frozen=True)
class BufferEntry:
    """A prompt waiting in the buffer, with the responses kept for it."""

    prompt_id: str
    loaded_step: int  # the step it entered the buffer (SortedRL's bounded wait counts from here)
    samples: tuple[CachedSample, ...] = ()

    def __post_init__(self) -> None:
        idx = [s.sample_index for s in self.samples]
        if len(set(idx)) != len(idx):
            raise PolicyError(f"buffered prompt {self.prompt_id!r}: sample indices {idx} repeat")

    @property
    def finished(self) -> tuple[CachedSample, ...]:
        return tuple(s for s in self.samples if s.finished)

    @property
    def unfinished(self) -> tuple[CachedSample, ...]:
        return tuple(s for s in self.samples if not s.finished)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_id": self.prompt_id,
            "loaded_step": self.loaded_step,
            "samples": [s.to_dict() for s in self.samples],
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "partial_cache") -> BufferEntry:
        if not isinstance(d, dict) or "prompt_id" not in d:
            raise PolicyError(f"{where}: a buffer entry must be an object with a prompt_id")
        samples = d.get("samples", [])
        if not isinstance(samples, list):
            raise PolicyError(f"{where}: samples must be a list")
        try:
            loaded = int(d.get("loaded_step", 0))
        except (TypeError, ValueError) as e:
            raise PolicyError(f"{where}: loaded_step {d.get('loaded_step')!r} is not a step") from e
        return cls(
            prompt_id=str(d["prompt_id"]),
            loaded_step=loaded,
            samples=tuple(CachedSample.from_dict(s, f"{where}[{d['prompt_id']}]") for s in samples),
        )


def buffer_to_json(entries: Sequence[BufferEntry]) -> str:
    """The rollout buffer as the rollout service stores it for the commit (``buffer_from_json``)."""
    import json

    return json.dumps({"entries": [e.to_dict() for e in entries]})


def buffer_from_json(text: str, where: str) -> tuple[BufferEntry, ...]:
    """The buffer ``buffer_to_json`` wrote; anything else is refused by name."""
    import json

    try:
        doc = json.loads(text)
    except ValueError as e:
        raise PolicyError(
            f"{where}: not JSON ({e}): not a rollout buffer written by the rollout service"
        ) from e
    if not isinstance(doc, dict) or not isinstance(doc.get("entries"), list) or set(doc) != {"entries"}:
        raise PolicyError(f"{where}: not a rollout buffer written by the rollout service")
    return tuple(BufferEntry.from_dict(d, f"{where} entries[{i}]") for i, d in enumerate(doc["entries"]))


def buffer_from_state(cache: Iterable[BufferEntry], known: Callable[[str], bool]) -> list[BufferEntry]:
    """The buffer of a state's ``partial_cache``, checked: a prompt twice, or a prompt the task does
    not have, is an error (the state belongs to another dataset), never silently dropped."""
    out = list(cache)
    ids = [e.prompt_id for e in out]
    if len(set(ids)) != len(ids):
        raise PolicyError(f"partial_cache holds prompt {next(i for i in ids if ids.count(i) > 1)!r} twice")
    missing = [i for i in ids if not known(i)]
    if missing:
        raise PolicyError(
            f"partial_cache holds prompts {missing[:3]} that the task does not have: the state was "
            "written for another dataset; start the arm over (--fresh)"
        )
    return out


def buffer_after(result: RoundResult, entries: Sequence[BufferEntry], step: int) -> list[BufferEntry]:
    """The buffer after a committed round: its deferred prompts in launch order, each with the
    responses the round cached for it (``result.cached``)."""
    loaded = {e.prompt_id: e.loaded_step for e in entries}
    kept: dict[str, list[CachedSample]] = {}
    for c in result.cached:
        kept.setdefault(c.prompt_id, []).append(CachedSample.from_completion(c))
    out = []
    for p in result.deferred:
        samples = sorted(kept.pop(p.prompt_id, []), key=lambda s: s.sample_index)
        out.append(BufferEntry(p.prompt_id, loaded.get(p.prompt_id, step), tuple(samples)))
    if kept:
        raise PolicyError(
            f"step {step}: responses cached for prompts {sorted(kept)[:3]} that were not deferred"
        )
    return out


def _rle(xs: Sequence[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for x in xs:
        if out and out[-1][0] == x:
            out[-1][1] += 1
        else:
            out.append([x, 1])
    return out


def _unrle(runs: Any) -> tuple[int, ...]:
    out: list[int] = []
    for v, n in runs:
        if int(n) < 1:
            raise ValueError(f"run length {n} < 1")
        out.extend([int(v)] * int(n))
    return tuple(out)
