"""Rollout-trainer fidelity: which logprobs play which role, the rollout correction's config, and the
engine/trainer mismatch metrics.

Three logprobs per response token:

- ``p``: the trainer's logprob under the weights being updated (with gradient);
- ``old`` (``pi_old``): the trainer's own logprob under the weights the RL step's update starts
  from, without gradient. The PPO ratio is ``exp(p - old)`` and its clip is a trust region around
  ``pi_old``. Streamed (one deferred update) and monolithic with one mini-batch, ``old`` is the
  detached ``p`` of the same forward (no extra forward); with ``train.mini_batches > 1`` the trainer
  takes every sample's ``old`` in one forward before the first optimizer step, and every
  mini-batch's ratio is against it;
- ``b``: the rollout engine's logprob, the distribution the token was actually sampled from. It
  enters the loss only through the importance weight ``w = pi_old / pi_rollout = exp(old - b)``:
  the rollout correction below, and decoupled PPO's behaviour weight (``decoupled_ppo``: the raw
  token-level ``w`` when no correction is set, the corrected one when one is).

``w`` covers both the engine/trainer numerical mismatch (precision, kernels, batch shapes) and
staleness: tokens sampled by an older policy version (partial rollout's resumed tokens, one-off
and buffered arms) carry that version's ``b``, so ``old - b`` is the old weights' drift plus the
mismatch. ``ppo`` without a correction therefore treats stale tokens as on-policy; the off-policy
arms resolve ``train.objective: auto`` to ``decoupled_ppo``, or set a correction.

Correction (``train.correction``; off by default): ``level`` is ``token`` (``w_t``), ``sequence``
(``prod_t w_t``, one weight per response) or ``geometric`` (``exp(mean_t log w_t)``); ``mode`` is
``truncate`` (TIS: ``min(w, upper)``) or ``mask`` (MIS: ``w`` where ``lower <= w <= upper``, else
0: the token or whole response leaves the loss). ``reject_lower``/``reject_upper`` (0 = off) drop
whole responses whose geometric ratio leaves ``[reject_lower, reject_upper]``. The weight is
detached and multiplies the per-token loss; masked tokens stay in the loss's denominator (weight 0),
so every token's weight depends only on its own response and the streamed update stays the
monolithic one (``rollpacker.core.stream_math``).

Mismatch metrics (``fidelity_metrics``) come from sums over the step's trained tokens
(``FidelitySums`` keys), merged by addition (``*_max`` by maximum) across chunks, mini-batches and
ranks, so the metric does not depend on how the batch was cut.

Weight-sync probe (``train.sync_probe``): after every weight push the rollout engine samples a few
tokens on fixed probe prompts, and the trainer scores the same tokens; ``sync/probe_logprob_gap``
is the mean ``|logp_trainer - logp_engine|`` over them. Its bound is set by the two precisions
(``probe_bound``; the coarser one wins): an engine serving other weights than the trainer's (stale,
half-loaded) is off by orders of magnitude more, and the step fails naming the gap before any
rollout runs on those weights.

Invariants:
- with ``level: none`` and ``ppo``/``gspo`` the engine's logprobs do not change the gradient;
- in a single update with identical weights the PPO ratio is exactly 1 and never clips, whatever
  the engine's logprobs (tests/trainers/test_fidelity.py);
- the metrics of a batch equal the merge of its chunks' metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rollpacker.core.errors import ConfigError

CORRECTION_LEVELS = ("none", "token", "sequence", "geometric")  # rollpacker.trainers.correction
CORRECTION_MODES = ("truncate", "mask")
OUT_OF_RANGE = (0.5, 2.0)  # a token's w outside this range counts in mismatch/ratio_out_frac
# the metrics `rollpacker compare` shows, each as its mean over an arm's steps
COMPARE_KEYS = (
    "mismatch/abs_logp_mean",
    "mismatch/abs_logp_max",
    "mismatch/kl_k3",
    "mismatch/ratio_out_frac",
    "mismatch/seq_ratio_std",
    "correction/truncated_frac",
    "correction/masked_frac",
)
# token position and response length buckets of the split mismatch: [edge_k, edge_{k+1})
BUCKET_EDGES = (0, 16, 64, 256, 1024)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """``train.correction``: importance weights of the engine's samples under ``pi_old``."""

    level: str = "none"  # none | token | sequence | geometric
    mode: str = "truncate"  # truncate (TIS) | mask (MIS)
    upper: float = 2.0  # truncate: the cap C; mask: the upper bound
    lower: float = 0.5  # mask only: the lower bound
    reject_lower: float = 0.0  # drop responses whose geometric ratio is below (0 = off)
    reject_upper: float = 0.0  # ... or above (0 = off)

    def __post_init__(self) -> None:
        if self.level not in CORRECTION_LEVELS:
            raise ConfigError(
                f"train.correction.level = {self.level!r}: unknown level; known: "
                f"{', '.join(CORRECTION_LEVELS)}"
            )
        if self.mode not in CORRECTION_MODES:
            raise ConfigError(
                f"train.correction.mode = {self.mode!r}: unknown mode; known: {', '.join(CORRECTION_MODES)}"
            )
        for name in ("upper", "lower", "reject_lower", "reject_upper"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"train.correction.{name} = {v!r}: must be a finite number >= 0")
        if self.upper <= 1:
            raise ConfigError(f"train.correction.upper = {self.upper!r}: must be > 1 (e.g. 2.0)")
        if self.mode == "mask" and not 0 <= self.lower < 1:
            raise ConfigError(f"train.correction.lower = {self.lower!r}: must be in [0, 1) (e.g. 0.5)")
        if self.reject_lower >= 1:
            raise ConfigError(
                f"train.correction.reject_lower = {self.reject_lower!r}: must be < 1 (0 = off; e.g. 0.999)"
            )
        if self.reject_upper and self.reject_upper <= 1:
            raise ConfigError(
                f"train.correction.reject_upper = {self.reject_upper!r}: must be > 1 (0 = off; e.g. 1.001)"
            )

    @property
    def rejects(self) -> bool:
        return self.reject_lower > 0 or self.reject_upper > 0


# the mean |logprob gap| a healthy engine stays under, by the coarser of the two precisions: fp32
# measured ~1e-6 on this CPU (2e-3 leaves room for TF32 matmuls and other kernels on GPUs); a
# half-precision side is off by its rounding (fp16: 2^-10, bf16: 2^-7 relative) through every layer
PROBE_BOUNDS = {"float32": 2e-3, "float16": 3e-2, "bfloat16": 1.5e-1}


@dataclass(frozen=True)
class SyncProbeConfig:
    """``train.sync_probe``: the engine's logprobs checked against the trainer's after each push."""

    enabled: bool = True
    prompts: int = 4  # fixed probe prompts (the task's first training prompts)
    max_tokens: int = 8  # tokens sampled per probe prompt
    bound: float = 0.0  # the largest mean |gap| accepted; 0 = from the two precisions (PROBE_BOUNDS)

    def __post_init__(self) -> None:
        for name in ("prompts", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"train.sync_probe.{name} = {v!r}: must be an integer >= 1")
        if isinstance(self.bound, bool) or not isinstance(self.bound, (int, float)) or not self.bound >= 0:
            raise ConfigError(
                f"train.sync_probe.bound = {self.bound!r}: must be a number >= 0 (0 = from the precisions)"
            )


def probe_bound(cfg: SyncProbeConfig, engine_dtype: str, train_dtype: str) -> float:
    """The probe's bound: ``cfg.bound``, or the coarser precision's ``PROBE_BOUNDS`` entry."""
    if cfg.bound > 0:
        return cfg.bound
    for d in (engine_dtype, train_dtype):
        if d not in PROBE_BOUNDS:
            raise ConfigError(f"no probe bound for dtype {d!r}; known: {', '.join(PROBE_BOUNDS)}")
    return max(PROBE_BOUNDS[engine_dtype], PROBE_BOUNDS[train_dtype])


def probe_gap(trainer: list[list[float]], engine: list[list[float]]) -> float:
    """``sync/probe_logprob_gap``: the mean ``|trainer - engine|`` over every probe token."""
    diffs = [abs(a - b) for t, e in zip(trainer, engine, strict=True) for a, b in zip(t, e, strict=True)]
    if not diffs:
        raise ValueError("the probe has no tokens")
    return sum(diffs) / len(diffs)


def bucket_name(k: int) -> str:
    """``0_15``, ..., ``1024_up``: bucket ``k`` of ``BUCKET_EDGES``."""
    lo = BUCKET_EDGES[k]
    return f"{lo}_up" if k == len(BUCKET_EDGES) - 1 else f"{lo}_{BUCKET_EDGES[k + 1] - 1}"


def bucket_of(x: int) -> int:
    """The bucket holding position or length ``x``."""
    return max(k for k, e in enumerate(BUCKET_EDGES) if x >= e)


def sum_keys() -> tuple[str, ...]:
    """The keys of the sums the trainer accumulates (``mm_abs_max`` merges by maximum)."""
    base = ("mm_tokens", "mm_abs", "mm_abs_max", "mm_kl", "mm_out", "mm_seqs", "mm_seq_w", "mm_seq_w2")
    cor = ("cor_truncated", "cor_masked", "cor_rejected")
    split = tuple(
        f"mm_{kind}{k}_{s}" for kind in ("pos", "len") for k in range(len(BUCKET_EDGES)) for s in "an"
    )
    return (*base, *cor, *split)


def merge_sums(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, float]:
    """Two chunks' sums as one (added; ``*_max`` by maximum)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = max(out.get(k, 0.0), v) if k.endswith("_max") else out.get(k, 0.0) + v
    return out


def fidelity_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The step's ``mismatch/*`` and ``correction/*`` metrics from its sums (empty with no token)."""
    n = sums.get("mm_tokens", 0.0)
    if n <= 0:
        return {}
    seqs = sums["mm_seqs"]
    mean_w = sums["mm_seq_w"] / seqs
    out = {
        "mismatch/abs_logp_mean": sums["mm_abs"] / n,
        "mismatch/abs_logp_max": sums["mm_abs_max"],
        "mismatch/kl_k3": sums["mm_kl"] / n,
        "mismatch/ratio_out_frac": sums["mm_out"] / n,
        "mismatch/seq_ratio_std": math.sqrt(max(sums["mm_seq_w2"] / seqs - mean_w * mean_w, 0.0)),
        "correction/truncated_frac": sums.get("cor_truncated", 0.0) / n,
        "correction/masked_frac": sums.get("cor_masked", 0.0) / n,
        "correction/rejected_seqs": sums.get("cor_rejected", 0.0),
    }
    for kind in ("pos", "len"):
        for k in range(len(BUCKET_EDGES)):
            m = sums.get(f"mm_{kind}{k}_n", 0.0)
            if m > 0:
                out[f"mismatch/abs_logp_{kind}_{bucket_name(k)}"] = sums[f"mm_{kind}{k}_a"] / m
    return out
