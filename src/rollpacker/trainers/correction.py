"""Rollout correction and the engine/trainer mismatch sums, on the trainer's tensors.

The formulas and the roles of the logprobs are in ``rollpacker.core.fidelity``. With the per-token
log weight ``d_t = old_t - b_t`` (0 on padding), a response of ``n`` tokens:

    token:     log w_t = d_t
    sequence:  log w_t = sum_s d_s                      (every token of the response)
    geometric: log w_t = (1 / n) * sum_s d_s
    truncate:  w = min(exp(log w), upper)                                    (TIS)
    mask:      w = exp(log w) if lower <= exp(log w) <= upper else 0          (MIS)
    rejection: w = 0 on every token of a response whose geometric ratio leaves [reject_lower, reject_upper]

``LEVELS`` and ``MODES`` are the registries (``get_level`` / ``get_mode`` name the known ones on a
miss). Everything here runs without gradient: the weight is a constant factor of the token's loss.

Invariants:
- ``LEVELS`` holds exactly ``core.fidelity.CORRECTION_LEVELS`` less ``none``, ``MODES`` exactly
  ``CORRECTION_MODES``;
- a weight depends only on its own response's tokens (so chunking never changes it);
- the returned sums have exactly the keys of ``core.fidelity.sum_keys()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rollpacker.core.errors import ConfigError
from rollpacker.core.fidelity import BUCKET_EDGES, OUT_OF_RANGE, RolloutCorrectionConfig

Level = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (d [B, R], mask) -> log w, [B, R] or [B, 1]
Mode = Callable[[torch.Tensor, RolloutCorrectionConfig], tuple[torch.Tensor, torch.Tensor]]  # w, changed


def _token(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return d


def _sequence(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return d.sum(1, keepdim=True)


def _geometric(d: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return d.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)


def _truncate(w: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return w.clamp(max=cfg.upper), w > cfg.upper


def _mask(w: torch.Tensor, cfg: RolloutCorrectionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    out = (w < cfg.lower) | (w > cfg.upper)
    return torch.where(out, torch.zeros_like(w), w), out


LEVELS: dict[str, Level] = {"token": _token, "sequence": _sequence, "geometric": _geometric}
MODES: dict[str, Mode] = {"truncate": _truncate, "mask": _mask}


def get_level(name: str) -> Level:
    if name not in LEVELS:
        raise ConfigError(f"unknown correction level {name!r}; known: none, {', '.join(LEVELS)}")
    return LEVELS[name]


def get_mode(name: str) -> Mode:
    if name not in MODES:
        raise ConfigError(f"unknown correction mode {name!r}; known: {', '.join(MODES)}")
    return MODES[name]


@torch.no_grad()
def correction_weights(
    cfg: RolloutCorrectionConfig,
    old: torch.Tensor,
    behaviour: torch.Tensor,
    mask: torch.Tensor,
    raw_token: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token weight [B, R] (0 on padding) and the counts ``cor_truncated`` (tokens),
    ``cor_masked`` (tokens at weight 0), ``cor_rejected`` (responses). ``raw_token``: with
    ``level: none``, the uncorrected token weight ``exp(old - b)`` (decoupled PPO's) instead of 1."""
    d = (old - behaviour) * mask
    zero = torch.zeros((), dtype=old.dtype, device=old.device)
    changed = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.level == "none":
        w = torch.exp(d) if raw_token else torch.ones_like(d)
        truncated = zero
    else:
        w, changed = get_mode(cfg.mode)(torch.exp(get_level(cfg.level)(d, mask)).expand_as(d), cfg)
        changed = changed & (mask > 0)
        truncated = changed.sum().to(old.dtype) if cfg.mode == "truncate" else zero
    rejected = zero
    if cfg.rejects:
        geo = torch.exp(_geometric(d, mask))  # [B, 1]
        out = geo < cfg.reject_lower
        if cfg.reject_upper:
            out = out | (geo > cfg.reject_upper)
        w = torch.where(out, torch.zeros_like(w), w)
        rejected = out.sum().to(old.dtype)
    w = w * mask
    masked = ((w == 0) & (mask > 0)).sum().to(old.dtype)
    return w, {"cor_truncated": truncated, "cor_masked": masked, "cor_rejected": rejected}


@torch.no_grad()
def mismatch_sums(old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``mm_*`` sums of ``core.fidelity.sum_keys()`` over a padded [B, R] micro-batch."""
    d = (old - behaviour) * mask
    a = d.abs()
    r = torch.exp(d)
    lengths = mask.sum(1)
    geo = torch.exp(d.sum(1) / lengths.clamp(min=1))
    lo, hi = OUT_OF_RANGE
    out = {
        "mm_tokens": mask.sum(),
        "mm_abs": a.sum(),
        "mm_abs_max": a.max() if a.numel() else torch.zeros((), dtype=d.dtype),
        "mm_kl": ((r - 1 - d) * mask).sum(),  # k3 of KL(rollout || trainer), tokens from the rollout
        "mm_out": (((r < lo) | (r > hi)) & (mask > 0)).sum().to(d.dtype),
        "mm_seqs": (lengths > 0).sum().to(d.dtype),
        "mm_seq_w": (geo * (lengths > 0)).sum(),
        "mm_seq_w2": (geo * geo * (lengths > 0)).sum(),
    }
    pos = torch.arange(d.shape[1], device=d.device)[None, :].expand_as(d)
    for kind, x in (("pos", pos), ("len", lengths[:, None].expand_as(d))):
        for k, lo_e in enumerate(BUCKET_EDGES):
            hi_e = BUCKET_EDGES[k + 1] if k + 1 < len(BUCKET_EDGES) else float("inf")
            sel = mask * ((x >= lo_e) & (x < hi_e)).to(d.dtype)
            out[f"mm_{kind}{k}_a"] = (a * sel).sum()
            out[f"mm_{kind}{k}_n"] = sel.sum()
    return out
