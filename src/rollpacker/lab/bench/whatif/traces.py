"""Where a what-if trace comes from: a JSON Lines file, a preset, or an MLflow run's recorded lengths.

Besides the replay presets (``core.trace.PRESETS``) the what-if ships paper-like presets shaped
after RollPacker's workload characterisation (arXiv:2509.21009, section 2.2, figure 2a: P75 of 755 to 1.1k
tokens, the longest response 25-32x the median, up to the max length; hard prompts give long
responses, so the tail is per prompt): ``paper-8k``, ``paper-16k``, ``paper-32k``, sized for
``P0 = 128``, ``R0 = 8`` and speculation up to 1.5 (12 lengths a prompt); ``paper-32k-heavy`` has
the same median and P75 with a heavier per-prompt tail.

An MLflow run of ``rollpacker train`` logs every step's response lengths
(``lengths/step-<n>.json``: the trained responses, group by group). ``records_from_step_lengths``
cuts each step's list into groups of ``R0`` (one prompt each); a policy that launches more than
``R0`` responses a prompt replays the group's lengths again in order (response ``R0 + j`` has
response ``j``'s length). Lengths recorded under tail batching are biased short (aborted responses
are not trained): record the trace from a ``sync`` arm where possible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollpacker.core.errors import TraceError
from rollpacker.core.trace import PRESETS as REPLAY_PRESETS
from rollpacker.core.trace import TracePreset, TraceRecord, generate
from rollpacker.lab.bench.replay import load_trace


def _paper(max_len: int, sigma_prompt: float = 1.0) -> TracePreset:
    return TracePreset(
        num_prompts=1400,
        responses_per_prompt=12,
        median_len=450,
        sigma_prompt=sigma_prompt,
        sigma_response=0.5,
        max_len=max_len,
        prompt_len_min=64,
        prompt_len_max=512,
        description=(
            "paper-like (RollPacker fig. 2a): per-prompt log-normal, median 450, P75 ~1k, "
            f"max {max_len // 1024}k"
            + ("" if sigma_prompt == 1.0 else f", heavier prompt tail ({sigma_prompt})")
        ),
    )


PAPER_PRESETS: dict[str, TracePreset] = {f"paper-{k}k": _paper(k * 1024) for k in (8, 16, 32)}
# the same median and P75 (~1.1k), a heavier per-prompt tail: about one response a step of
# 128 x 8 reaches 32k, as in RollPacker's 32B/32k runs (fig. 11a), where paper-32k's rarely does
PAPER_PRESETS["paper-32k-heavy"] = _paper(32 * 1024, sigma_prompt=1.3)
# SortedRL's workload (arXiv:2603.23414): one response a prompt (PPO on DAPO-Math-17k), max 8k (section
# 4.4.1). Its length statistics (section 2.3, fig. 1c): "80 % of samples are generated within 3K
# tokens, the remaining 5 % can extend up to the token limit". A log-normal through P80 = 3k and
# P95 = 8k has median 1,046 and sigma 1.25 (sqrt(1.15^2 + 0.5^2)); seed 0 draws P80 3.2k, 6 % at 8k.
PAPER_PRESETS["sortedrl-8k"] = dataclasses.replace(
    _paper(8 * 1024, sigma_prompt=1.15),
    num_prompts=1024,
    responses_per_prompt=1,
    median_len=1046,
    description="SortedRL-like (arXiv:2603.23414 sec. 2.3): one response a prompt, P80 ~3k, ~5 % reach 8k",
)
PRESETS: dict[str, TracePreset] = {**REPLAY_PRESETS, **PAPER_PRESETS}

MLFLOW_PROMPT_LEN = 128  # prompt tokens assumed for a trace rebuilt from an MLflow run (not logged)


def records_from_step_lengths(
    docs: Sequence[Mapping[str, Any]], r0: int, prompt_len: int = MLFLOW_PROMPT_LEN, source: str = "mlflow"
) -> list[TraceRecord]:
    """A trace from per-step length documents (``{"step", "lengths"}``): one prompt per ``r0``
    consecutive lengths of a step; a step whose count is not a multiple of ``r0`` is refused."""
    if r0 < 1:
        raise TraceError(f"{source}: R0 = {r0}: must be >= 1")
    out: list[TraceRecord] = []
    for d in docs:
        lens = [int(x) for x in d.get("lengths", [])]
        step = d.get("step", "?")
        if len(lens) % r0:
            raise TraceError(
                f"{source}: step {step} logged {len(lens)} lengths, not a multiple of R0 = {r0}; pass the "
                "run's rollout.responses_per_prompt as --r0"
            )
        for g in range(len(lens) // r0):
            group = tuple(max(1, x) for x in lens[g * r0 : (g + 1) * r0])
            out.append(TraceRecord(f"s{step}-g{g}", prompt_len, group))
    if not out:
        raise TraceError(f"{source}: the run logged no response lengths (lengths/step-*.json)")
    return out


def widen(records: Sequence[TraceRecord], responses: int) -> list[TraceRecord]:
    """Every record with at least ``responses`` lengths, its own repeated in order where short."""
    return [
        r
        if len(r.response_lens) >= responses
        else TraceRecord(
            r.prompt_id,
            r.prompt_len,
            (r.response_lens * math.ceil(responses / len(r.response_lens)))[
                : max(responses, len(r.response_lens))
            ],
        )
        for r in records
    ]


def mlflow_lengths(tracking_uri: str, run_id: str) -> list[dict[str, Any]]:
    """The run's ``lengths/step-*.json`` documents, through the tracking module."""
    from rollpacker.tracking import ExperimentTracker

    # step_lengths reads the run's artifacts by id; the experiment name is not consulted
    return ExperimentTracker(tracking_uri, "rollpacker-whatif").step_lengths(run_id)


def load(
    trace: Path | None,
    preset: str,
    seed: int,
    mlflow_run: str | None = None,
    tracking_uri: str = "",
    r0: int = 4,
    responses: int = 0,
) -> tuple[list[TraceRecord], str]:
    """The trace records and where they came from: ``mlflow_run`` > ``trace`` file > ``preset``. A
    run's groups are widened to ``responses`` lengths (its own repeated) so speculation can replay."""
    if mlflow_run:
        docs = mlflow_lengths(tracking_uri, mlflow_run)
        records = records_from_step_lengths(docs, r0, source=f"mlflow run {mlflow_run}")
        return widen(records, responses), f"mlflow:{mlflow_run}"
    if trace is None and preset not in PRESETS:
        raise TraceError(f"unknown preset {preset!r}; use one of {', '.join(sorted(PRESETS))}")
    if trace is None and preset in PAPER_PRESETS:
        return generate(PAPER_PRESETS[preset], seed=seed), f"preset:{preset}"
    return load_trace(trace, preset, seed)  # the replay benchmark's file and preset reader
