"""One rank of the megatron-core gang: a GPTModel shard, its share of the batch, its optimizer shard.

The gang (``gang.py``) runs one ``RankWorker`` per process (a Ray actor) and calls the same method
on every rank of a group at once; the methods that run collectives say which group must call them
together. Per DP replica, every TP rank and PP stage gets the same samples; the loss is computed on
the last pipeline stage from vocab-parallel logits (``vocab_parallel_cross_entropy`` of the logits
divided by the temperature is ``-log p(token)``, no vocabulary gather), with the torch backend's own
per-token objective (``TorchTrainer._loss_sum`` on a view, so both backends share one formula).

Exactness: ``calculate_per_token_loss`` keeps megatron from dividing by the micro-batch count, and
with it DDP sums (not averages) gradients over DP; ``accumulate`` only adds to the gradient
buffers (``overlap_grad_reduce`` off: no communication across DP), and ``finish_step`` does the one
reduction (``finalize_model_grads``: DP reduce, tied-embedding sync across stages), scales by
``1 / D(batch)`` and steps the optimizer once.

Invariants:
- ``accumulate`` never changes weights or optimizer state;
- ``finish_step`` is the only DP collective of a step, so the streamed update does not depend on
  which replica got which group, nor in which order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import StoreConfig, TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.core.fidelity import merge_sums, sum_keys
from rollpacker.core.stream_math import LossNorm
from rollpacker.trainers.megatron.convert import Qwen2Layout, gather_tp, stage_hf_names, to_hf, to_mcore
from rollpacker.trainers.megatron.source import LazyWeights, StoreSource
from rollpacker.trainers.objectives import get_objective
from rollpacker.trainers.torch_trainer import TorchTrainer, _micro_batches, _pad


@dataclass(frozen=True)
class RankSpec:
    """What every rank of a gang is built from (the same on all ranks)."""

    model: StoreSource  # the weights every rank fetches on its own node (source.py); never a path
    train: TrainerConfig
    tp: int
    pp: int
    dp: int
    temperature: float
    master_addr: str
    master_port: int
    optimizer: str = "adam"  # adam (AdamW, as the torch backend) | sgd (exactness checks)
    distributed_optimizer: bool = True
    use_cuda: bool = False
    threads: int = 1  # torch intra-op threads of the rank (CPU)
    dtype: str = "float32"  # float32 | bfloat16 (fp32 master weights in the optimizer)
    recompute: str = "none"  # none | selective | full (train.megatron.recompute)
    attention: str = "unfused"  # unfused | sdpa (train.megatron.attention)

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


class _LossView:
    """What ``TorchTrainer._loss_sum`` reads, with the logprobs the pipeline already computed."""

    ref_model = None
    model = None  # the policy forward already ran: ``_forward_logprobs`` returns its logprobs

    def __init__(self, owner: RankWorker, logp: torch.Tensor, mask: torch.Tensor) -> None:
        self.cfg, self.norm, self.objective = owner.cfg, owner.norm, owner.objective
        self.device = logp.device
        self._logp, self._mask = logp, mask

    def _forward_logprobs(self, model: Any, mb: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        return self._logp, self._mask


class RankWorker:
    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.cfg = spec.train
        self.norm = LossNorm(self.cfg.loss_norm)
        self.objective = get_objective("ppo" if self.cfg.objective == "auto" else self.cfg.objective)
        self.layout = Qwen2Layout.from_config(spec.model.read_json("config.json"), where=spec.model.uri)
        self.layout.check_parallel(spec.tp, spec.pp)
        if self.cfg.kl_coef > 0:
            raise TrainerError("train.kl_coef > 0 is not supported by the megatron backend yet")
        self._init_distributed()
        self.model, self.optimizer = self._build()
        self.load_source(spec.model)

    # -- set-up -----------------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        from megatron.core import parallel_state as ps

        from rollpacker.trainers.megatron import cpu_shim

        s = self.spec
        cpu_shim.apply(use_cuda=s.use_cuda)
        torch.set_num_threads(max(1, s.threads))
        os.environ.setdefault("MASTER_ADDR", s.master_addr)
        os.environ.setdefault("MASTER_PORT", str(s.master_port))
        if s.use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group(
            "nccl" if s.use_cuda else "gloo",
            init_method=f"tcp://{s.master_addr}:{s.master_port}",
            rank=self.rank,
            world_size=s.world_size,
        )
        ps.initialize_model_parallel(tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp)
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(self.cfg.seed)
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first_stage = self.pp_rank == 0
        self.last_stage = self.pp_rank == s.pp - 1

    def _transformer_config(self) -> Any:
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        lay, s = self.layout, self.spec
        return TransformerConfig(
            num_layers=lay.num_layers,
            hidden_size=lay.hidden_size,
            num_attention_heads=lay.num_heads,
            num_query_groups=lay.num_kv_heads,
            kv_channels=lay.head_dim,
            ffn_hidden_size=lay.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=lay.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=True,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            use_cpu_initialization=not s.use_cuda,
            params_dtype=torch.bfloat16 if s.bf16 else torch.float32,
            bf16=s.bf16,
            tensor_model_parallel_size=s.tp,
            pipeline_model_parallel_size=s.pp,
            pipeline_dtype=torch.bfloat16 if s.bf16 else torch.float32,
            calculate_per_token_loss=True,
            variable_seq_lengths=True,
            moe_token_dispatcher_type="alltoall",  # dense model; allgather refuses variable lengths
            deallocate_pipeline_outputs=False,
            **recompute_settings(s.recompute),
        )

    def _build(self) -> tuple[Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        lay, s, c = self.layout, self.spec, self.cfg
        self.tconfig = self._transformer_config()
        model = GPTModel(
            config=self.tconfig,
            transformer_layer_spec=_layer_spec(s.attention),
            vocab_size=lay.padded_vocab(s.tp),
            max_sequence_length=lay.max_position_embeddings,
            pre_process=self.first_stage,
            post_process=self.last_stage,
            share_embeddings_and_output_weights=lay.tied,
            position_embedding_type="rope",
            rotary_base=lay.rope_theta,
            parallel_output=True,
        )
        if s.use_cuda:
            model = model.cuda()
        if s.bf16:
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(self.tconfig, model)
        ddp = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=s.distributed_optimizer,
        )
        model = DistributedDataParallel(self.tconfig, ddp, model)
        ocfg = OptimizerConfig(
            optimizer=s.optimizer,
            lr=c.lr,
            min_lr=c.lr,
            weight_decay=c.weight_decay,
            adam_beta1=c.adam_beta1,
            adam_beta2=c.adam_beta2,
            adam_eps=1e-8,
            sgd_momentum=0.0,
            clip_grad=c.grad_clip,
            use_distributed_optimizer=s.distributed_optimizer,
            params_dtype=torch.bfloat16 if s.bf16 else torch.float32,
            bf16=s.bf16,
        )
        optimizer = get_megatron_optimizer(ocfg, [model])
        from rollpacker.trainers.megatron import cpu_shim

        cpu_shim.fix_torch_adam_reload(optimizer)
        return model, optimizer

    @property
    def module(self) -> Any:
        """The GPTModel (inside DDP, and Float16Module with bf16)."""
        inner = self.model.module
        return inner.module if self.spec.bf16 else inner

    def load_source(self, src: StoreSource) -> list[str]:
        """Collective over the gang: this rank's shard of the Hugging Face model at ``src``, read
        tensor by tensor from its node's copy of its pipeline stage's tensors (``source.py``,
        ``fetch_stage``); the copy is removed once every rank has loaded. Returns the names of
        the HF tensors this rank read."""
        weights = LazyWeights(src.fetch_stage(stage_hf_names(self.layout, self.spec.pp, self.pp_rank)).path)
        try:
            self.load_hf(weights)
        finally:
            weights.close()
        torch.distributed.barrier()
        src.drop()
        return weights.reads

    def load_hf(self, hf: Mapping[str, torch.Tensor]) -> None:
        """Set this rank's shard from an HF state dict (only its stage's tensors are read), and
        the optimizer's fp32 copies."""
        s = self.spec
        sd = to_mcore(hf, self.layout, s.tp, self.tp_rank, s.pp, self.pp_rank)
        own = self.module.state_dict()
        missing = [k for k in own if k not in sd and not k.endswith("_extra_state")]
        unexpected = [k for k in sd if k not in own]
        if missing or unexpected:
            raise TrainerError(
                f"rank {self.rank}: converter mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for k, t in sd.items():
                own[k].copy_(t)
        self.optimizer.reload_model_params()
        self.policy_version = 0
        self.optimizer_steps = 0
        self.reset_accum()

    def reset_accum(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._acc = {"loss_sum": 0.0, "clipped": 0.0, "ratio_sum": 0.0, "kl_sum": 0.0, "bw_sum": 0.0}
        self._acc.update(dict.fromkeys(sum_keys(), 0.0))

    # -- forward/backward -------------------------------------------------------------------------
    def _run(self, samples: Sequence[TrainSample], forward_only: bool) -> list[dict[str, Any]]:
        """The pipeline schedule over the samples' micro-batches; the per-micro-batch outputs of the
        loss (last stage only; an empty list elsewhere)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs = _micro_batches(samples, self.cfg.tokens_per_micro_batch, keep_order=forward_only)
        if not mbs:
            return []
        device = torch.device("cuda") if self.spec.use_cuda else torch.device("cpu")
        it = iter(mbs)
        step = self._forward_step(device)
        out = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=it,
            model=[self.model],
            num_microbatches=len(mbs),
            seq_length=max(len(s.prompt_ids) + s.num_tokens for s in samples),
            micro_batch_size=max(len(mb) for mb in mbs),
            forward_only=forward_only,
        )
        return list(out) if self.last_stage else []

    def _forward_step(self, device: torch.device) -> Any:
        def step(data_iterator: Iterator[list[TrainSample]], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data_iterator)
            ids, _attn, resp_mask, targets, starts = _pad(mb, 0, device)
            b, s = ids.shape
            pos = torch.arange(s, device=device)[None, :].expand(b, s)
            causal = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), diagonal=1)
            out = model(ids, pos, causal[None, None].expand(b, 1, s, s))
            return out, lambda logits: self._loss(mb, logits, resp_mask, targets, starts)

        return step

    def _token_logprobs(
        self, logits: torch.Tensor, resp_mask: torch.Tensor, targets: torch.Tensor, starts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, R] logprobs of the response tokens from vocab-parallel logits [B, S, V/tp]."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        width = resp_mask.shape[1]
        idx = (starts[:, None] - 1 + torch.arange(width, device=logits.device)[None, :]).clamp(
            0, logits.shape[1] - 1
        )
        sel = (
            torch.gather(logits, 1, idx[:, :, None].expand(-1, -1, logits.shape[-1])).float()
            / self.temperature
        )
        part = sel.shape[-1]
        lo = self.tp_rank * part
        pad_from = self.layout.vocab_size - lo
        if pad_from < part:  # padded vocabulary rows: no probability
            col = torch.arange(part, device=sel.device)
            sel = sel.masked_fill(col >= pad_from, float("-inf"))
        tok = -vocab_parallel_cross_entropy(sel.transpose(0, 1).contiguous(), targets.t().contiguous()).t()
        mask = resp_mask.to(tok.dtype)
        return tok * mask, mask

    @property
    def temperature(self) -> float:
        return self.spec.temperature

    def _loss(
        self,
        mb: list[TrainSample],
        logits: torch.Tensor,
        resp_mask: torch.Tensor,
        targets: torch.Tensor,
        starts: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        logp, mask = self._token_logprobs(logits, resp_mask, targets, starts)
        terms = TorchTrainer._loss_sum(_LossView(self, logp, mask), mb)  # type: ignore[arg-type]
        stats = {k: float(v.detach()) for k, v in terms.items()}
        stats["logprobs"] = [logp[i, : s.num_tokens].detach().tolist() for i, s in enumerate(mb)]
        n_tok = torch.tensor(sum(s.num_tokens for s in mb), dtype=torch.int)
        return terms["loss_sum"], n_tok, stats

    # -- the trainer port, per rank ---------------------------------------------------------------
    def accumulate(self, samples: list[TrainSample]) -> dict[str, float]:
        """Collective over this rank's DP replica (its TP and PP ranks); no DP communication."""
        t0 = time.perf_counter()
        outs = self._run(samples, forward_only=False)
        got: dict[str, float] = {}
        for o in outs:
            got = merge_sums(got, {k: o[k] for k in self._acc})
        self._acc = merge_sums(self._acc, got)
        return {**got, "seconds": time.perf_counter() - t0}

    def logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Collective over the DP replica; the logprobs on the last stage ([] elsewhere)."""
        with torch.no_grad():
            outs = self._run(samples, forward_only=True)
        return [lp for o in outs for lp in o["logprobs"]]

    def reduce_grads(self, denominator: float, force_all_reduce: bool = False) -> None:
        """Collective over the gang: the one DP reduction (a reduce-scatter with the distributed
        optimizer), the tied-embedding sync across stages, the 1 / D scaling."""
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model], force_all_reduce=force_all_reduce)
        self.model.scale_gradients(1.0 / denominator)

    def finish_step(self, denominator: float) -> dict[str, float]:
        """Collective over the gang: reduce, clip, one optimizer step; bumps the policy version."""
        t0 = time.perf_counter()
        self.reduce_grads(denominator)
        norm = float(self.optimizer.get_grad_norm()) if self.cfg.grad_clip <= 0 else None
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise TrainerError("the megatron optimizer skipped the step (non-finite gradients)")
        self.optimizer_steps += 1
        self.policy_version += 1
        self.reset_accum()
        return {"grad_norm": float(grad_norm if norm is None else norm), "seconds": time.perf_counter() - t0}

    def grads_hf(self, denominator: float) -> dict[str, torch.Tensor] | None:
        """Collective over the gang (exactness checks): the reduced gradient as full HF tensors on
        the (tp 0, dp 0) rank of each stage (an all-reduce even with the distributed optimizer)."""
        self.reduce_grads(denominator, force_all_reduce=True)
        local = {n: p.main_grad.detach().clone() for n, p in self.module.named_parameters()}
        return self._gather_hf(local)

    # -- weights out --------------------------------------------------------------------------------
    def _gather_hf(
        self, local: dict[str, torch.Tensor], on_device: bool = False
    ) -> dict[str, torch.Tensor] | None:
        """All-gather ``local`` over TP; the stage's HF tensors on tp rank 0 of dp rank 0 (on the
        host, or with ``on_device`` where the rank computes: the collective weight push)."""
        from megatron.core import parallel_state as ps

        group = ps.get_tensor_model_parallel_group()
        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.spec.tp)]
        for name in sorted(local):
            t = local[name].contiguous()
            parts = [torch.empty_like(t) for _ in range(self.spec.tp)]
            torch.distributed.all_gather(parts, t, group=group)
            for r, p in enumerate(parts):
                shards[r][name] = p if on_device else p.cpu()
        if self.tp_rank != 0 or self.dp_rank != 0:
            return None
        return to_hf(gather_tp(shards), self.layout, self.spec.pp, self.pp_rank)

    def bucket_plan(self, bucket_bytes: int) -> list[list[str]]:
        """This stage's megatron parameter names cut into buckets of at most ``bucket_bytes``
        (full, unsharded size; a tensor larger than the bound gets a bucket of its own)."""
        buckets: list[list[str]] = [[]]
        size = 0
        for name, t in self.module.state_dict().items():
            if name.endswith("_extra_state") or not isinstance(t, torch.Tensor):
                continue
            n = t.numel() * t.element_size() * self.spec.tp
            if buckets[-1] and size + n > bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(name)
            size += n
        return [b for b in buckets if b]

    def export_bucket(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Collective over the TP group of every DP replica of this stage: the bucket as HF tensors
        on (tp 0, dp 0)."""
        sd = self.module.state_dict()
        return self._gather_hf({n: sd[n].detach() for n in names})

    # -- checkpoints ---------------------------------------------------------------------------------
    def _sharded(self, is_loading: bool) -> dict[str, Any]:
        model_sd = self.module.sharded_state_dict()
        if self.spec.optimizer != "adam":  # plain SGD (no momentum) has no state; megatron saves Adam's only
            return {"model": model_sd}
        return {
            "model": model_sd,
            # reshardable over TP, PP and DP (the default format's flattened ranges are refused in 0.16)
            "optimizer": self.optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=_OPT_FORMAT
            ),
        }

    def store_checkpoint(self, store: StoreConfig, prefix: str) -> int:
        """Collective over the gang, streamed: this rank's part of the dist_checkpointing save
        (its shard files; rank 0 also the metadata) into a scratch directory of its own, uploaded
        to ``prefix`` in the store and deleted. No disk ever holds more than one rank's shard, and
        ranks on other nodes need no shared volume. Returns the bytes this rank uploaded."""
        from megatron.core import dist_checkpointing

        from rollpacker.store import open_store

        tmp = Path(tempfile.mkdtemp(prefix=f"rollpacker-dist-r{self.rank}-"))
        try:
            torch.distributed.barrier()
            dist_checkpointing.save(self._sharded(is_loading=False), str(tmp))
            torch.distributed.barrier()
            size = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
            if size:
                open_store(store).upload_dir(tmp, prefix)
            torch.distributed.barrier()  # every rank's files are in the store before any returns
            return size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def load_checkpoint(self, src: StoreSource, policy_version: int, optimizer_steps: int) -> None:
        """Collective over the gang: load (and reshard) model and optimizer state from the
        ``dist/`` checkpoint at ``src``, fetched once per node; the copy is removed once every
        rank has loaded."""
        from megatron.core import dist_checkpointing

        from rollpacker.trainers.megatron import cpu_shim

        if self.spec.optimizer == "adam":
            cpu_shim.init_torch_adam_state(self.optimizer)  # a gang that has not stepped yet
        state = dist_checkpointing.load(self._sharded(is_loading=True), str(src.fetch()))
        torch.distributed.barrier()
        src.drop()
        self.module.load_state_dict(state["model"], strict=False)
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
            cpu_shim.restore_torch_adam_step(self.optimizer, optimizer_steps)
        else:
            self.optimizer.reload_model_params()
        self.policy_version = policy_version
        self.optimizer_steps = optimizer_steps
        self.reset_accum()

    def coords(self) -> tuple[int, int, int]:
        return self.tp_rank, self.pp_rank, self.dp_rank

    # -- the collective weight push (train.weight_sync: collective; engines/weight_transfer.py) -----
    def weight_sender_address(self) -> tuple[str, int]:
        """This rank's node address and a free port: the sender hosts the group's rendezvous."""
        import ray

        from rollpacker.engines.weight_transfer import free_port

        address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        return address, free_port(address)

    def open_weight_group(self, group_json: str, sender: int = 0) -> None:
        """Join the weight-transfer group as the sender of this rank's pipeline stage (rank
        ``sender``: the stage's (tp 0, dp 0) rank); returns once the engines' workers have joined."""
        from rollpacker.core.weight_sync import TransferGroup
        from rollpacker.engines.weight_transfer import open_group

        if sender != self.pp_rank:
            raise TrainerError(
                f"rank {self.rank} (stage {self.pp_rank}) cannot send stage {sender}'s weights"
            )
        group = TransferGroup.from_json(group_json, where="weight transfer group")
        self._weight_pg = open_group(group, sender)

    def push_weights(self, bucket_bytes: int) -> str:
        """Collective over the TP group of every DP replica (the export, bucket by bucket, kept on
        the rank's device); the sender broadcasts each bucket to the engine's workers as it is
        gathered. Returns the sender's ``PushReport`` as JSON ("" on the other ranks): one sender
        per pipeline stage, each with its own stage's tensors under their global HF names."""
        from rollpacker.engines.weight_transfer import send

        pg = getattr(self, "_weight_pg", None)
        plan = self.bucket_plan(bucket_bytes)

        # a tied head is the embedding under another name (the last stage's copy at pp > 1): no
        # engine loads it (vLLM serves it from the embedding), so it does not cross the wire
        skip = "lm_head.weight" if self.layout.tied else None

        def gathered() -> Iterator[tuple[str, torch.Tensor]]:
            sd = self.module.state_dict()
            for names in plan:
                got = self._gather_hf({n: sd[n].detach() for n in names}, on_device=True)
                if got is not None:
                    yield from ((n, t) for n, t in got.items() if n != skip)

        if pg is None:
            for _ in gathered():  # join the export collectives
                pass
            return ""
        device = (
            torch.device("cuda", torch.cuda.current_device()) if self.spec.use_cuda else torch.device("cpu")
        )
        return send(pg, gathered(), bucket_bytes, device).to_json()

    def node(self) -> str:
        """The address of this rank's node (named when the rank is lost)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def close(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _layer_spec(attention: str) -> Any:
    """megatron-core's local layer spec; with ``sdpa`` its core attention is torch's fused kernel
    (``attention.py``) instead of the unfused ``DotProductAttention``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        from rollpacker.trainers.megatron.attention import SdpaAttention

        spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    return spec


def recompute_settings(mode: str) -> dict[str, Any]:
    """megatron-core's TransformerConfig fields for ``train.megatron.recompute``: ``selective``
    recomputes the core attention (scores, softmax, probabilities x values) in backward, so no
    layer keeps its ``[heads, seq, seq]`` probabilities; ``full`` checkpoints every layer (uniform,
    one layer per unit): a layer keeps only its input and is recomputed in backward."""
    if mode == "none":
        return {}
    if mode == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    raise TrainerError(f"train.megatron.recompute = {mode!r}: use none, selective or full")


_OPT_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
