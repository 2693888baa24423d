"""GSPO, Group Sequence Policy Optimization (Qwen, 2025; ``train.objective: gspo``).

The importance ratio is the sequence's, length-normalized (the geometric mean of its token ratios),
and clipping acts on whole sequences. For response ``i`` of ``|y_i|`` tokens (current logprob
``p``, old logprob ``old`` under the weights the update starts from, advantage ``A_i``):

    s_i  = exp( (1 / |y_i|) * sum_t (p_t - old_t) )
    l_i  = -min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i)

Written per token in the GSPO-token form, ``s_{i,t} = sg[s_i] * exp(p_t - sg[p_t])`` (``sg``: no
gradient) with ``l_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})``: its value at every
token is ``l_i`` and, under ``train.loss_norm: seq_mean`` (``w = 1 / |y_i|``), its gradient is
GSPO's, ``d l_i / d p_t = (d l_i / d s_i) * s_i / |y_i|``; it also takes per-token advantages.
With ``token_mean`` each sequence's loss is weighted by its length. GSPO's clip range is narrow
(the paper: ``eps_low = 3e-4``, ``eps_high = 4e-4``, as the ``gspo`` arm of ``bench learning``
sets them).
"""

from __future__ import annotations

import torch

from rollpacker.trainers.objectives.base import Objective, PgInputs, PgTerms, clipped


def per_token(x: PgInputs) -> PgTerms:
    lengths = x.mask.sum(1, keepdim=True).clamp(min=1)
    log_s = ((x.logp - x.old) * x.mask).sum(1, keepdim=True) / lengths  # [B, 1]
    return clipped(x, torch.exp(log_s.detach() + x.logp - x.logp.detach()))  # value s_i at every token


OBJECTIVE = Objective("gspo", per_token)
