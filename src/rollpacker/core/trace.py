"""Length traces for the replay benchmark: the file format, its validation, and seeded presets.

Format (JSON Lines, one prompt per line)::

    {"prompt_id": "p0007", "prompt_len": 37, "response_lens": [812, 95, 120, 77, 64]}

Response ``j`` of a prompt, if generated, has length ``response_lens[j]`` (clipped to the max
response length). Speculative responses use the next indices, so a prompt needs at least
``ceil(eta_r * R0)`` lengths to be replayed under tail batching.

Preset generator (seeded, documented): each prompt has a difficulty ``z_p ~ N(0, 1)``; its
median response length is ``median_len * exp(sigma_prompt * z_p)``; response ``j`` has length
``median_p * exp(sigma_response * z_pj)``, clipped to ``[min_len, max_len]``. The long tail is
per-prompt, as the papers observe (hard prompts give long responses), and the mixture is
heavy-tailed: the default preset's P75 is an order of magnitude below its max.

Invariants:
- a parsed trace has unique prompt ids, ``prompt_len >= 1`` and positive response lengths;
- every parse error names the file, the line number and the field;
- ``generate(preset, seed)`` is a pure function of its arguments.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rollpacker.core.errors import TraceError
from rollpacker.core.metrics import percentile
from rollpacker.core.types import Prompt


@dataclass(frozen=True)
class TraceRecord:
    prompt_id: str
    prompt_len: int
    response_lens: tuple[int, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "prompt_id": self.prompt_id,
                "prompt_len": self.prompt_len,
                "response_lens": list(self.response_lens),
            }
        )


@dataclass(frozen=True)
class TracePreset:
    """Parameters of the seeded trace generator (see the module docstring)."""

    num_prompts: int
    responses_per_prompt: int
    median_len: float
    sigma_prompt: float
    sigma_response: float
    max_len: int
    min_len: int = 4
    prompt_len_min: int = 16
    prompt_len_max: int = 64
    description: str = ""


PRESETS: dict[str, TracePreset] = {
    # The benchmark default: shaped like the papers' traces (P75 ~10x below the max) and scaled
    # so a full comparison runs in a few minutes on a 2-core CPU.
    "paper-cpu": TracePreset(
        num_prompts=800,
        responses_per_prompt=10,
        median_len=30,
        sigma_prompt=1.2,
        sigma_response=0.5,
        max_len=1024,
        description="per-prompt log-normal lengths, P75/max ~ 1/10, max 1024 tokens",
    ),
    # A quick smoke preset for tests and CI.
    "smoke": TracePreset(
        num_prompts=128,
        responses_per_prompt=6,
        median_len=12,
        sigma_prompt=0.9,
        sigma_response=0.4,
        max_len=128,
        description="small and fast: for tests",
    ),
    # SortedRL's workload (arXiv:2603.23414, section 2.3: "80 % of samples are generated within 3K
    # tokens, the remaining 5 % can extend up to the token limit" of 8k) scaled by 1/32 in length so
    # the real CPU engine replays it in seconds: the what-if's ``sortedrl-8k`` shape (median 1,046 ->
    # 33, the same sigmas), max 256. Seed 0 draws median 34, P80 92 (0.36 of the max; the paper's
    # 3k/8k), 5.0 % at the max. One response a prompt is trained (R0 = 1, as the paper's PPO runs);
    # the second length serves tail batching's speculative response; 1,536 prompts serve two
    # groups of 4 x 128 and the arms that draw more.
    "sortedrl-cpu": TracePreset(
        num_prompts=1536,
        responses_per_prompt=2,
        median_len=1046 / 32,
        sigma_prompt=1.15,
        sigma_response=0.5,
        max_len=256,
        description=(
            "SortedRL-like (arXiv:2603.23414 sec. 2.3) at 1/32 length: P80 ~0.36 of the max, ~5 % at 256"
        ),
    ),
}


def generate(preset: TracePreset, seed: int = 0) -> list[TraceRecord]:
    """Draw a trace from ``preset`` with ``seed``."""
    rng = random.Random(seed)
    out = []
    width = len(str(preset.num_prompts - 1))
    for i in range(preset.num_prompts):
        z_p = rng.gauss(0.0, 1.0)
        median = preset.median_len * math.exp(preset.sigma_prompt * z_p)
        lens = tuple(
            int(
                min(
                    preset.max_len,
                    max(
                        preset.min_len, round(median * math.exp(preset.sigma_response * rng.gauss(0.0, 1.0)))
                    ),
                )
            )
            for _ in range(preset.responses_per_prompt)
        )
        plen = rng.randint(preset.prompt_len_min, preset.prompt_len_max)
        out.append(TraceRecord(prompt_id=f"p{i:0{width}d}", prompt_len=plen, response_lens=lens))
    return out


def parse_lines(lines: Iterable[str], source: str = "<trace>") -> list[TraceRecord]:
    """Parse JSON Lines; blank lines and lines starting with ``#`` are skipped."""
    records: list[TraceRecord] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{source}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"prompt_id", "prompt_len", "response_lens"})
        if unknown:
            raise TraceError(
                f"{where}: unknown field(s) {unknown}; allowed: prompt_id, prompt_len, response_lens"
            )
        pid = obj.get("prompt_id")
        if not isinstance(pid, str) or not pid:
            raise TraceError(f"{where}: field 'prompt_id' must be a non-empty string, got {pid!r}")
        if pid in seen:
            raise TraceError(f"{where}: prompt_id {pid!r} already used on line {seen[pid]}")
        seen[pid] = n
        plen = obj.get("prompt_len")
        if isinstance(plen, bool) or not isinstance(plen, int) or plen < 1:
            raise TraceError(
                f"{where}: field 'prompt_len' of prompt {pid!r} must be an integer >= 1, got {plen!r}"
            )
        lens = obj.get("response_lens")
        if not isinstance(lens, list) or not lens:
            raise TraceError(
                f"{where}: field 'response_lens' of prompt {pid!r} must be a non-empty list of integers"
            )
        for j, x in enumerate(lens):
            if isinstance(x, bool) or not isinstance(x, int) or x < 1:
                raise TraceError(
                    f"{where}: response_lens[{j}] of prompt {pid!r} must be an integer >= 1, got {x!r}"
                )
        records.append(TraceRecord(prompt_id=pid, prompt_len=plen, response_lens=tuple(lens)))
    if not records:
        raise TraceError(f"{source}: the trace holds no prompts")
    return records


def check_serves(records: Sequence[TraceRecord], needed_responses: int, source: str = "<trace>") -> None:
    """Raise if a prompt has fewer response lengths than the policy may launch for it."""
    for r in records:
        if len(r.response_lens) < needed_responses:
            raise TraceError(
                f"{source}: prompt {r.prompt_id!r} has {len(r.response_lens)} response_lens but the "
                f"policy may launch {needed_responses} responses per prompt (ceil(eta_r * R0)); "
                "add lengths to the trace or lower R0 / eta_r"
            )


def to_prompts(
    records: Sequence[TraceRecord], vocab_size: int, seed: int = 0, reserved: int = 3
) -> list[Prompt]:
    """Turn trace records into prompts with seeded random token ids (ids >= ``reserved``)."""
    if vocab_size <= reserved + 1:
        raise TraceError(f"vocab_size {vocab_size} leaves no room for prompt tokens")
    out = []
    for i, r in enumerate(records):
        rng = random.Random(f"{seed}:{r.prompt_id}")
        ids = tuple(rng.randrange(reserved, vocab_size) for _ in range(r.prompt_len))
        out.append(
            Prompt(prompt_id=r.prompt_id, token_ids=ids, response_lens=r.response_lens, dataset_index=i)
        )
    return out


def length_stats(records: Sequence[TraceRecord], responses: int | None = None) -> dict[str, float]:
    """Max / P75 / median / mean over the first ``responses`` lengths of every prompt."""

    xs = [float(x) for r in records for x in r.response_lens[: responses or len(r.response_lens)]]
    return {
        "max": max(xs),
        "p75": percentile(xs, 75),
        "p50": percentile(xs, 50),
        "mean": sum(xs) / len(xs),
    }
