"""GRPO / PPO-clip trainer on plain torch, with the stream trainer's deferred, exact update.

Per response token ``t`` of sample ``i`` (advantage ``A_i``, current logprob ``p`` under
``logits / temperature``, old logprob ``old``, engine logprob ``b``; ``rollpacker.core.fidelity``
says which plays which role), ``l_pg`` is the ``train.objective``'s per-token loss, found through
the registry in ``rollpacker.trainers.objectives`` (each file holds its formula):

    ratio = exp(p - old)
    l_pg  = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i)      (objectives/ppo.py)

times the importance weight ``w`` of ``train.correction`` (``trainers/correction.py``: a function
of ``old - b``, detached; 1 when off, and decoupled PPO's raw ``exp(old - b)`` when off with
``decoupled_ppo``). ``old`` is the trainer's own logprob under the weights the update starts from:
every streamed gradient is computed before the one update, so it is the detached ``p`` of the same
forward; the monolithic path with several mini-batches takes every sample's ``old`` before its
first optimizer step (``TrainSample.old_logprobs``). Then, with ``q`` the reference logprob:

    l_kl  = exp(q - p) - (q - p) - 1          (k3 estimator, q = reference logprob; kl_coef > 0)
    l     = w * l_pg + kl_coef * l_kl

and the loss is ``(1 / D) * sum_i sum_t w_i * l`` (``rollpacker.core.stream_math``). ``A`` is
per token where the advantage estimator gives per-token advantages (``train.advantage:
reinforce_pp``: ``batch_advantages`` normalizes them over the whole batch before any gradient;
``returns`` computes each group's part, the KL in the reward, as groups arrive). ``accumulate``
backpropagates the unnormalized sum of each chunk; ``finish_step`` divides the summed gradient by
the batch's ``D``, clips the global norm, and takes one AdamW step.

Invariants:
- ``accumulate`` never touches weights or optimizer state (only ``.grad``);
- the gradient after ``reduce_grads`` is the monolithic batch's gradient for any chunking and
  order (tests/trainers/test_stream_exactness.py: <= 1e-6 relative in float64, <= 1e-5 float32);
- a checkpoint restores weights, optimizer moments, RNG state and ``policy_version`` exactly;
- a step's mismatch sums (``TrainStats.fidelity``) are the merge of its chunks' sums.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.advantages import (
    ReturnStats,
    Scope,
    TrainSample,
    get_advantage_estimator,
    normalized,
    token_returns,
)
from rollpacker.core.config import TrainerConfig
from rollpacker.core.devices import resolve_device
from rollpacker.core.errors import TrainerError
from rollpacker.core.fidelity import merge_sums, sum_keys
from rollpacker.core.stream_math import LossNorm, denominator, token_weight
from rollpacker.engines.weight_transfer import tied_aliases
from rollpacker.trainers.base import AccumStats, TrainStats, zero_update
from rollpacker.trainers.correction import correction_weights, mismatch_sums
from rollpacker.trainers.objectives import PgInputs, get_objective

CHECKPOINT_VERSION = 1
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def visible_gpus() -> int:
    """GPUs this process sees (torch's count; 0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def train_placement(cfg: TrainerConfig, declared: tuple[str, ...] = ()) -> tuple[str, torch.dtype]:
    """The torch device and dtype ``train.device`` / ``train.dtype`` give in this process:
    ``auto`` is ``cuda`` where a GPU is visible; ``auto`` finding none on a config that declares
    GPUs (``declared``: ``ExperimentConfig.gpu_declarations``) is refused, an explicit ``cpu`` obeyed."""
    device = resolve_device(cfg.device, visible_gpus(), name="train.device", declared=declared)
    dtype: torch.dtype = getattr(torch, cfg.dtype)
    return device, dtype


class TorchTrainer:
    """A causal LM (Hugging Face format) trained with GRPO on one torch device."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: TrainerConfig,
        temperature: float = 1.0,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        ref_model_dir: str | Path | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if temperature <= 0:
            raise TrainerError(
                f"temperature = {temperature}: policy-gradient training needs sampled responses "
                "(temperature > 0); greedy rollouts have no behaviour distribution"
            )
        self.cfg = cfg
        self.temperature = float(temperature)
        self.norm = LossNorm(cfg.loss_norm)
        if self.norm is LossNorm.CONSTANT and cfg.loss_budget_tokens < 1:
            raise TrainerError(
                "train.loss_norm: constant needs train.loss_budget_tokens >= 1 (the generation budget; "
                "an experiment config sets it from rollout.max_tokens)"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise TrainerError(
                f"model directory {self.model_dir} has no config.json: pass a Hugging Face model "
                "directory (`rollpacker model build` or a warm-up output)"
            )
        torch.manual_seed(cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype).to(self.device)
        self.model.train()
        self.ref_model = None
        if cfg.kl_coef > 0 or cfg.reward_kl_coef > 0:
            ref_dir = Path(ref_model_dir or self.model_dir)
            self.ref_model = AutoModelForCausalLM.from_pretrained(str(ref_dir), dtype=dtype).to(self.device)
            self.ref_model.eval()
            self.ref_model.requires_grad_(False)
        self.opt = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
        )
        self.pad_id = int(self.model.config.pad_token_id or self.model.config.eos_token_id or 0)
        self.policy_version = 0
        self.optimizer_steps = 0
        # ``auto`` is resolved per arm (ExperimentConfig.for_arm); unresolved, it trains with ppo
        self.objective = get_objective("ppo" if cfg.objective == "auto" else cfg.objective)
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        self._lock = threading.Lock()
        self._reset_accum()

    # -- accumulation ---------------------------------------------------------------------------
    def _reset_accum(self) -> None:
        self._acc_lengths: list[int] = []
        self._acc_loss = 0.0
        self._acc_clipped = 0.0
        self._acc_ratio = 0.0
        self._acc_kl = 0.0
        self._acc_bw = 0.0
        self._acc_fid: dict[str, float] = {}
        self._acc_seconds = 0.0
        self.model.zero_grad(set_to_none=True)

    @property
    def pending_samples(self) -> int:
        return len(self._acc_lengths)

    @property
    def replicas(self) -> int:
        """One model on one device: a single replica."""
        return 1

    def accumulate_on(self, replica: int, samples: Sequence[TrainSample]) -> AccumStats:
        if replica != 0:
            raise TrainerError(f"accumulate_on replica {replica}: the torch backend has one replica (0)")
        return self.accumulate(samples)

    def accumulate(self, samples: Sequence[TrainSample]) -> AccumStats:
        """Add the gradient of the chunk's unnormalized loss sum (no weight change)."""
        t0 = time.perf_counter()
        loss_sum = 0.0
        tokens = 0
        if self.estimator.scope is Scope.BATCH and any(not s.token_advantages for s in samples):
            raise TrainerError(
                f"advantage {self.estimator.name!r} needs the whole batch: give accumulate the samples "
                "of batch_advantages (StreamTrainer and train_batch do)"
            )
        with self._lock:
            for mb in _micro_batches(samples, self.cfg.tokens_per_micro_batch):
                out = self._loss_sum(mb)
                out["loss_sum"].backward()
                loss_sum += float(out["loss_sum"].detach())
                self._acc_clipped += float(out["clipped"])
                self._acc_ratio += float(out["ratio_sum"])
                self._acc_kl += float(out["kl_sum"])
                self._acc_bw += float(out["bw_sum"])
                self._acc_fid = merge_sums(self._acc_fid, {k: float(out[k]) for k in sum_keys()})
                tokens += sum(s.num_tokens for s in mb)
            self._acc_lengths.extend(s.num_tokens for s in samples)
            self._acc_loss += loss_sum
            dt = time.perf_counter() - t0
            self._acc_seconds += dt
        return AccumStats(samples=len(samples), tokens=tokens, loss_sum=loss_sum, seconds=dt)

    def reduce_grads(self) -> tuple[int, float]:
        """Scale the accumulated gradient by ``1 / D(batch)`` and clip; return (D, grad norm)."""
        if not self._acc_lengths:
            raise TrainerError("finish_step with no accumulated samples: accumulate a batch first")
        d = denominator(self.norm, self._acc_lengths, self.cfg.loss_budget_tokens)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(d)
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return d, float(norm)

    def finish_step(self) -> TrainStats:
        """The deferred update: normalize, clip, one optimizer step; with no sample accumulated
        (overlong filtering removed the whole batch) an exact zero update (``base.zero_update``)."""
        with self._lock:
            t0 = time.perf_counter()
            if not self._acc_lengths:
                self.policy_version += 1
                self._reset_accum()
                return zero_update(self.policy_version, time.perf_counter() - t0)
            d, grad_norm = self.reduce_grads()
            self.opt.step()
            self.optimizer_steps += 1
            self.policy_version += 1
            n_tok = sum(self._acc_lengths)
            stats = TrainStats(
                samples=len(self._acc_lengths),
                tokens=n_tok,
                loss=self._acc_loss / d,
                grad_norm=grad_norm,
                clip_frac=self._acc_clipped / n_tok,
                ratio_mean=self._acc_ratio / n_tok,
                kl=self._acc_kl / n_tok,
                policy_version=self.policy_version,
                seconds=self._acc_seconds + time.perf_counter() - t0,
                behav_weight=self._acc_bw / n_tok,
                fidelity=dict(self._acc_fid),
            )
            self._reset_accum()
        return stats

    def train_batch(self, samples: Sequence[TrainSample]) -> TrainStats:
        """Monolithic path: ``mini_batches`` optimizer steps, each over a contiguous slice."""
        if not samples:
            raise TrainerError("train_batch got no samples")
        if self.pending_samples:
            raise TrainerError("train_batch while streamed gradients are pending: finish_step first")
        if self.estimator.scope is Scope.BATCH:
            returns = self.returns(samples)
            samples = self.batch_advantages(samples, returns, ReturnStats.of(returns))
        k = min(self.cfg.mini_batches, len(samples))
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        if k > 1:  # pi_old is the weights before the first step, for every mini-batch
            samples = with_old_logprobs(samples, self.logprobs(samples))
        steps = []
        for a, b in itertools.pairwise(bounds):
            self.accumulate(samples[a:b])
            steps.append(self.finish_step())
        n = len(steps)
        return TrainStats(
            samples=sum(s.samples for s in steps),
            tokens=sum(s.tokens for s in steps),
            loss=sum(s.loss for s in steps) / n,
            grad_norm=sum(s.grad_norm for s in steps) / n,
            clip_frac=sum(s.clip_frac * s.tokens for s in steps) / sum(s.tokens for s in steps),
            ratio_mean=sum(s.ratio_mean * s.tokens for s in steps) / sum(s.tokens for s in steps),
            kl=sum(s.kl * s.tokens for s in steps) / sum(s.tokens for s in steps),
            policy_version=self.policy_version,
            seconds=sum(s.seconds for s in steps),
            optimizer_steps=n,
            behav_weight=sum(s.behav_weight * s.tokens for s in steps) / sum(s.tokens for s in steps),
            fidelity=merged_fidelity(steps),
        )

    # -- batch-scope advantages (REINFORCE++: core/advantages.py) -------------------------------
    def returns(self, samples: Sequence[TrainSample]) -> list[tuple[float, ...]]:
        """Each sample's token returns ``G_t`` (the KL in the reward needs the reference model);
        independent of the rest of the batch, so the stream trainer computes them per group."""
        beta = self.cfg.reward_kl_coef
        if beta > 0 and self.ref_model is not None:
            with self._lock:
                refs = self.logprobs(samples, model=self.ref_model)
        else:
            refs = [list(s.behaviour_logprobs) for s in samples]
        kind = self.cfg.kl_estimator
        return [
            token_returns(s.reward, s.behaviour_logprobs, q, beta, kind)
            for s, q in zip(samples, refs, strict=True)
        ]

    def batch_advantages(
        self, samples: Sequence[TrainSample], returns: Sequence[Sequence[float]], stats: ReturnStats
    ) -> list[TrainSample]:
        """The samples with per-token advantages normalized by the whole batch's ``stats``."""
        return [
            dataclasses.replace(s, token_advantages=normalized(g, stats))
            for s, g in zip(samples, returns, strict=True)
        ]

    # -- the loss ---------------------------------------------------------------------------------
    def _forward_logprobs(self, model: Any, mb: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs of each response token, [B, R] padded, and the response mask."""
        ids, attn, resp_mask, targets, starts = _pad(mb, self.pad_id, self.device)
        logits = model(input_ids=ids, attention_mask=attn).logits
        width = resp_mask.shape[1]
        # logits at position k predict token k+1: response token j sits at start+j
        idx = starts[:, None] - 1 + torch.arange(width, device=self.device)[None, :]
        idx = idx.clamp(0, logits.shape[1] - 1)  # padded tail positions are masked out
        sel = torch.gather(logits, 1, idx[:, :, None].expand(-1, -1, logits.shape[-1]))
        logp = torch.log_softmax(sel.to(torch.promote_types(sel.dtype, torch.float32)) / self.temperature, -1)
        tok_logp = torch.gather(logp, 2, targets[:, :, None]).squeeze(2)
        resp_mask = resp_mask.to(tok_logp.dtype)
        return tok_logp * resp_mask, resp_mask

    def _loss_sum(self, mb: Sequence[TrainSample]) -> dict[str, torch.Tensor]:
        logp, mask = self._forward_logprobs(self.model, mb)
        width = mask.shape[1]
        behaviour = torch.tensor(
            [list(s.behaviour_logprobs) + [0.0] * (width - s.num_tokens) for s in mb],
            dtype=logp.dtype,
            device=self.device,
        )
        adv = torch.tensor(
            [list(s.advantages) + [0.0] * (width - s.num_tokens) for s in mb],
            dtype=logp.dtype,
            device=self.device,
        )
        w = torch.tensor(
            [token_weight(self.norm, s.num_tokens) for s in mb], dtype=logp.dtype, device=self.device
        )[:, None]
        old = _old_logprobs(mb, logp, width)
        terms = self.objective.per_token(
            PgInputs(logp, old, adv, mask, self.cfg.clip_eps_low, self.cfg.clip_eps_high)
        )
        bw, counts = correction_weights(
            self.cfg.correction, old, behaviour, mask, raw_token=self.objective.behaviour_weighted
        )
        pg, ratio, clipped_ratio = terms.loss * bw, terms.ratio, terms.clipped_ratio
        per_tok = pg
        kl = torch.zeros_like(pg)
        if self.ref_model is not None and self.cfg.kl_coef > 0:
            with torch.no_grad():
                ref_logp, _ = self._forward_logprobs(self.ref_model, mb)
            delta = ref_logp - logp
            kl = torch.exp(delta) - delta - 1
            per_tok = pg + self.cfg.kl_coef * kl
        loss_sum = (per_tok * w * mask).sum()
        with torch.no_grad():
            clipped = ((ratio != clipped_ratio) & (mask > 0)).sum()
            ratio_sum = (ratio * mask).sum()
            kl_sum = (kl * mask).sum()
            bw_sum = (bw * mask).sum()
        return {
            "loss_sum": loss_sum,
            "clipped": clipped,
            "ratio_sum": ratio_sum,
            "kl_sum": kl_sum,
            "bw_sum": bw_sum,
            **mismatch_sums(old, behaviour, mask),
            **counts,
        }

    @torch.no_grad()
    def logprobs(self, samples: Sequence[TrainSample], model: Any = None) -> list[list[float]]:
        """The trainer's logprobs of each sample's response tokens under the current weights (or
        under ``model``, e.g. the reference)."""
        out: list[list[float]] = []
        for mb in _micro_batches(samples, self.cfg.tokens_per_micro_batch, keep_order=True):
            logp, _ = self._forward_logprobs(self.model if model is None else model, mb)
            out.extend(logp[i, : s.num_tokens].tolist() for i, s in enumerate(mb))
        return out

    # -- weights and checkpoints ----------------------------------------------------------------
    def weights(self, tied_head: bool = True) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) pairs for ``RolloutEngine.load_weights``.

        ``lm_head.weight`` is included even when tied to the embedding: vLLM on CPU keeps a
        separately packed copy of the output projection, and a reload without it leaves the engine
        sampling from the old head (tests/trainers/test_weight_sync.py catches this). The
        collective push (``tied_head=False``) leaves it out: its workers load the embedding and
        rebuild that copy from it (``engines/weight_transfer.py``), and the head's bytes would
        cross the wire for nothing (27 % of Qwen2.5-0.5B's, 15 % of 1.5B's).
        """
        skip = frozenset() if tied_head else tied_aliases(self.model)
        yield from ((name, t.detach()) for name, t in self.model.state_dict().items() if name not in skip)

    def save_checkpoint(self, path: Path) -> Path:
        """Write model (HF format, loadable by vLLM) + optimizer + RNG + meta, atomically."""
        path = Path(path)
        if self.pending_samples:
            raise TrainerError("checkpoint with streamed gradients pending: finish_step first")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        try:
            self.model.save_pretrained(str(tmp / "model"), safe_serialization=True)
            for f in _TOKENIZER_FILES:
                if (self.model_dir / f).is_file():
                    shutil.copy2(self.model_dir / f, tmp / "model" / f)
            torch.save(self.opt.state_dict(), tmp / "optimizer.pt")
            rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            torch.save(rng, tmp / "rng.pt")
            meta = {
                "version": CHECKPOINT_VERSION,
                "policy_version": self.policy_version,
                "optimizer_steps": self.optimizer_steps,
                "config": dataclasses.asdict(self.cfg),
            }
            (tmp / "trainer.json").write_text(json.dumps(meta, indent=2))
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    def load_checkpoint(self, path: Path) -> None:
        from safetensors.torch import load_file

        path = Path(path)
        meta_f = path / "trainer.json"
        if not meta_f.is_file():
            raise TrainerError(
                f"{path} is not a trainer checkpoint (no trainer.json): pass a directory written by "
                "save_checkpoint"
            )
        meta = json.loads(meta_f.read_text())
        if meta.get("version") != CHECKPOINT_VERSION:
            raise TrainerError(
                f"{path}: checkpoint version {meta.get('version')}, expected {CHECKPOINT_VERSION}"
            )
        state: dict[str, torch.Tensor] = {}
        for f in sorted((path / "model").glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if m != "lm_head.weight"]
        if missing or unexpected:
            raise TrainerError(
                f"{path}: checkpoint does not match the model (missing {missing[:3]}, unexpected "
                f"{unexpected[:3]}); was it written for another model shape?"
            )
        self.opt.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
        rng = torch.load(path / "rng.pt", weights_only=False)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)
        random.setstate(rng["python"])
        self.policy_version = int(meta["policy_version"])
        self.optimizer_steps = int(meta["optimizer_steps"])
        self._reset_accum()


def _old_logprobs(mb: Sequence[TrainSample], logp: torch.Tensor, width: int) -> torch.Tensor:
    """``pi_old`` [B, R]: the samples' ``old_logprobs`` (taken before the first of several
    mini-batch steps) or, without them, the detached logprobs of this forward (one update)."""
    if not any(s.old_logprobs for s in mb):
        return logp.detach()
    if not all(s.old_logprobs for s in mb):
        raise TrainerError("a micro-batch mixes samples with and without old logprobs: set them on all")
    rows = [list(s.old_logprobs) + [0.0] * (width - s.num_tokens) for s in mb]
    return torch.tensor(rows, dtype=logp.dtype, device=logp.device)


def with_old_logprobs(samples: Sequence[TrainSample], old: Sequence[Sequence[float]]) -> list[TrainSample]:
    """The samples carrying ``pi_old`` (the logprobs before the first mini-batch step)."""
    return [dataclasses.replace(s, old_logprobs=tuple(q)) for s, q in zip(samples, old, strict=True)]


def merged_fidelity(steps: Sequence[TrainStats]) -> dict[str, float]:
    """The mismatch sums of several optimizer steps' samples, as one batch's."""
    out: dict[str, float] = {}
    for st in steps:
        out = merge_sums(out, st.fidelity)
    return out


def _micro_batches(
    samples: Sequence[TrainSample], budget: int, keep_order: bool = False
) -> list[list[TrainSample]]:
    """Cut into micro-batches whose padded size stays within ``budget`` tokens (sorted by length
    unless ``keep_order``, which keeps input order for callers that zip results back)."""
    items = list(samples) if keep_order else sorted(samples, key=lambda s: len(s.prompt_ids) + s.num_tokens)
    out: list[list[TrainSample]] = []
    cur: list[TrainSample] = []
    longest = 0
    for s in items:
        n = len(s.prompt_ids) + s.num_tokens
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            out.append(cur)
            cur, longest = [], 0
        cur.append(s)
        longest = max(longest, n)
    if cur:
        out.append(cur)
    return out


def _pad(
    mb: Sequence[TrainSample], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(s.prompt_ids) + s.num_tokens for s in mb)
    rwidth = max(s.num_tokens for s in mb)
    ids = torch.full((len(mb), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(mb), width), dtype=torch.long)
    resp_mask = torch.zeros((len(mb), rwidth), dtype=torch.float64)
    targets = torch.zeros((len(mb), rwidth), dtype=torch.long)
    starts = torch.zeros(len(mb), dtype=torch.long)
    for i, s in enumerate(mb):
        seq = list(s.prompt_ids) + list(s.response_ids)
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        resp_mask[i, : s.num_tokens] = 1
        targets[i, : s.num_tokens] = torch.tensor(s.response_ids)
        starts[i] = len(s.prompt_ids)
    return ids.to(device), attn.to(device), resp_mask.to(device), targets.to(device), starts.to(device)
