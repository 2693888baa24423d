"""The megatron-core backend: a gang of Ray actors (one per rank, in a placement group) behind the
trainer port (``rollpacker.trainers.base.Trainer``).

``MegatronTrainer`` is what the trainer service and the stream trainer drive; it is the gang's only
driver. It checks the layout against the model before any process starts (``Qwen2Layout``:
architecture, TP dividing heads and KV heads, PP dividing the layers), reserves ``tp * pp * dp``
bundles, starts one ``RankWorker`` actor per bundle and joins them into one torch.distributed world
(gloo on CPU, NCCL on GPU).

Stream training across DP replicas: the stream trainer keeps every replica busy at once, one
dispatch thread per replica calling ``accumulate_on(replica, group)`` (it hands each group, all
samples of one prompt, to the replica with the fewest tokens still to compute,
``trainers/stream.py``); ``accumulate`` spreads a chunk's groups over the replicas with the fewest
tokens so far this step and runs them together. Every TP rank and PP stage of a replica gets the
same samples, in the same order; no DP communication happens until ``finish_step``, which computes the
batch's denominator ``D`` from every accumulated length (``core/stream_math.py``) and has every rank
reduce once, scale by ``1 / D`` and step. The update is therefore the monolithic one whichever
replica got which group, in whatever order.

Weights out (``weight_buckets``): per pipeline stage, buckets of at most ``bucket_mb`` of full
tensors, TP-gathered on the stage's (tp 0, dp 0) rank and converted to Hugging Face names. With
``train.weight_sync: collective`` (``push_weights``) that rank broadcasts each of its stage's
buckets straight to the engines' workers as it is gathered, on its own device: one sender per
stage, the stages side by side, each worker receiving every stage.

Failure: a rank that dies (``RayActorError``) fails the call with a ``TrainerError`` naming the
rank, and marks the gang ``broken``; the trainer service then rebuilds the gang from the last
checkpoint on the next attempt (``TrainerService._begin``).

Invariants:
- a bad layout or an unsupported model is refused before any actor starts;
- ``accumulate`` never changes weights (only gradient buffers of the receiving replica);
- every group of a step lands on exactly one DP replica; ``finish_step`` needs all ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rollpacker.core.advantages import TrainSample, get_advantage_estimator
from rollpacker.core.config import StoreConfig, TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.core.fidelity import merge_sums, sum_keys
from rollpacker.core.memory import MemoryPlan, check_fits
from rollpacker.core.placement import rank_bundle
from rollpacker.core.stream_math import LossNorm, denominator
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines.weight_transfer import PushReport
from rollpacker.store.base import ObjectStore
from rollpacker.trainers.base import AccumStats, TrainStats, zero_update
from rollpacker.trainers.megatron.convert import Qwen2Layout
from rollpacker.trainers.megatron.source import StoreSource
from rollpacker.trainers.torch_trainer import _TOKENIZER_FILES, merged_fidelity, with_old_logprobs

CHECKPOINT_VERSION = 1


def check_layout(
    model: str | Path | StoreSource, cfg: TrainerConfig, longest_tokens: int | None = None
) -> Qwen2Layout:
    """The model's layout, after refusing (by name) what the gang could not run: a split the model
    does not allow, or, on GPUs, a plan whose ranks would not fit ``train.megatron.gpu_memory_gib``
    (``core/memory.py``) with sequences of ``longest_tokens`` (prompt + response; default: one
    micro-batch, ``train.tokens_per_micro_batch``)."""
    mcfg = cfg.megatron
    src = model if isinstance(model, StoreSource) else StoreSource.local(model)
    if not src.exists("config.json"):
        raise TrainerError(f"model {src.uri} has no config.json: pass a Hugging Face model")
    lay = Qwen2Layout.from_config(src.read_json("config.json"), where=src.uri)
    lay.check_parallel(mcfg.tp, mcfg.pp)
    if mcfg.gpus_per_rank > 0:  # CPU ranks share the host's memory: nothing to size per device
        plan = MemoryPlan.of(mcfg, longest_tokens or cfg.tokens_per_micro_batch, cfg.tokens_per_micro_batch)
        check_fits(lay.shape, plan)
    return lay


class MegatronTrainer:
    """The trainer port on a megatron-core gang (TP x PP x DP ranks, one Ray actor each)."""

    def __init__(
        self,
        model: str | Path | StoreSource,
        cfg: TrainerConfig,
        temperature: float = 1.0,
        ref_model_dir: str | Path | None = None,
        longest_tokens: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise TrainerError(
                f"temperature = {temperature}: policy-gradient training needs sampled responses"
            )
        self.cfg, self.mcfg = cfg, cfg.megatron
        # the ranks read the weights from the store, each on its own node (source.py); a local
        # directory (tests, one machine) is read as a file store
        self.source = (model if isinstance(model, StoreSource) else StoreSource.local(model)).model()
        self.layout = check_layout(self.source, cfg, longest_tokens)  # before any process starts
        self.model_dir = _meta_dir(self.source)  # this driver's copy of config and tokenizer files
        self.estimator = get_advantage_estimator(cfg.advantage_estimator)
        if self.estimator.scope.name == "BATCH":
            raise TrainerError(
                f"train.advantage {self.estimator.name!r} needs batch-scope returns, which the megatron "
                "backend does not compute yet: use train.backend: torch"
            )
        self.norm = LossNorm(cfg.loss_norm)
        if self.norm is LossNorm.CONSTANT and cfg.loss_budget_tokens < 1:
            raise TrainerError(
                "train.loss_norm: constant needs train.loss_budget_tokens >= 1 (the generation budget; "
                "an experiment config sets it from rollout.max_tokens)"
            )
        self.temperature = float(temperature)
        # this (driver) process's generators, seeded and checkpointed as the torch backend does: an
        # in-process rollout engine samples from them, so a resumed run samples what an
        # uninterrupted one would
        torch.manual_seed(cfg.seed)
        self.policy_version = 0
        self.optimizer_steps = 0
        self.broken = ""
        self._saved: tuple[int, dict[str, Any]] | None = None  # the weights save_checkpoint gathered
        # the step's sums: the stream trainer accumulates from a thread per replica
        self._lock = threading.Lock()
        self._pg: Any = None
        self.actors: list[Any] = []
        self.nodes: list[str] = []  # each rank's node address, once the gang has started
        try:
            self._start()
        except BaseException:  # a rank that failed to start: no actor or bundle is left holding resources
            self.close()
            raise
        self._reset_accum()

    # -- the gang -----------------------------------------------------------------------------------
    def _start(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rollpacker.trainers.megatron.worker import RankSpec, RankWorker

        m = self.mcfg
        n = m.ranks
        if not ray.is_initialized():  # outside a cluster (tests, the inline runner): a local Ray
            _local_ray(max(n * m.cpus_per_rank, os.cpu_count() or 1))
        bundle = rank_bundle(m)  # its GPUs count against the training group (core/placement.py)
        self._pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=300)
        except Exception as e:
            self.close()
            raise TrainerError(
                f"the megatron gang needs {n} bundles of {bundle} (train.megatron: tp {m.tp} x pp {m.pp} x "
                f"dp {m.data_parallel}); Ray could not place them in 300 s: {e}"
            ) from e

        def where(i: int) -> Any:
            return PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)

        addr, port = ray.get(_rendezvous.options(scheduling_strategy=where(0), num_cpus=0).remote())
        spec = RankSpec(
            model=self.source,
            train=self.cfg,
            tp=m.tp,
            pp=m.pp,
            dp=m.data_parallel,
            temperature=self.temperature,
            master_addr=addr,
            master_port=port,
            optimizer=m.optimizer,
            distributed_optimizer=m.distributed_optimizer,
            use_cuda=m.gpus_per_rank > 0,
            threads=max(1, int(m.cpus_per_rank)),
            dtype=m.dtype,
            recompute=m.recompute,
            attention=m.attention,
        )
        actor = ray.remote(RankWorker)
        self.actors = [
            actor.options(
                scheduling_strategy=where(i), num_cpus=m.cpus_per_rank, num_gpus=m.gpus_per_rank or None
            ).remote(spec, i)
            for i in range(n)
        ]
        coords = self._get([a.coords.remote() for a in self.actors], "start")
        self.coords: list[tuple[int, int, int]] = coords  # (tp, pp, dp) of each rank
        self.nodes = self._get([a.node.remote() for a in self.actors], "start")
        self.dp = m.data_parallel
        self.pp = m.pp

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        import ray

        if self.broken:
            raise TrainerError(f"the megatron gang is broken ({self.broken}): rebuild it from a checkpoint")
        try:
            return list(ray.get(refs))
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            # a rank that died fails its peers' collectives too (gloo: "connection closed by peer"):
            # whichever error came first, a dead rank breaks the gang
            dead = self._dead_ranks()
            if not dead and not isinstance(e, ray.exceptions.RayActorError):
                raise TrainerError(f"megatron gang: {what} failed on a rank: {_tail(e)}") from e
            lost = ", ".join(
                f"rank {i} on node {self.nodes[i] if i < len(self.nodes) else '?'}" for i in dead
            )
            self.broken = f"{lost or 'a rank'} died during {what}"
            raise TrainerError(
                f"megatron gang: {self.broken}; the step fails and the gang is rebuilt from the last "
                f"checkpoint on the next attempt ({e.__class__.__name__}: {_tail(e)})"
            ) from e

    def _dead_ranks(self, timeout_s: float = 30.0) -> list[int]:
        """The ranks whose actor is dead (a rank that does not answer within ``timeout_s`` counts)."""
        import ray

        refs = [a.coords.remote() for a in self.actors]
        dead = []
        for i, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout_s)
            except Exception:
                dead.append(i)
        return dead

    def _ranks(self, *, dp: int | None = None, pp: int | None = None, tp: int | None = None) -> list[int]:
        return [
            i
            for i, (t, p, d) in enumerate(self.coords)
            if (dp is None or d == dp) and (pp is None or p == pp) and (tp is None or t == tp)
        ]

    def _head(self, dp: int, pp: int | None = None) -> int:
        """The rank whose answer counts: (tp 0, the last stage, or ``pp``, replica ``dp``)."""
        return self._ranks(dp=dp, pp=self.pp - 1 if pp is None else pp, tp=0)[0]

    def _all(self, method: str, *args: Any) -> list[Any]:
        return self._get([getattr(a, method).remote(*args) for a in self.actors], method)

    # -- the trainer port ----------------------------------------------------------------------------
    def _reset_accum(self) -> None:
        self._lengths: list[int] = []
        self._tokens = [0] * self.mcfg.data_parallel
        self._acc: dict[str, float] = defaultdict(float)
        if self.actors and not self.broken:
            self._all("reset_accum")

    @property
    def pending_samples(self) -> int:
        return len(self._lengths)

    def _place(self, samples: Sequence[TrainSample]) -> list[list[TrainSample]]:
        """Groups (by prompt) onto DP replicas, each to the one with the fewest tokens so far."""
        groups: dict[str, list[TrainSample]] = defaultdict(list)
        for s in samples:
            groups[s.prompt_id].append(s)
        out: list[list[TrainSample]] = [[] for _ in range(self.dp)]
        for g in sorted(groups.values(), key=lambda g: -sum(len(s.prompt_ids) + s.num_tokens for s in g)):
            with self._lock:
                d = min(range(self.dp), key=lambda r: (self._tokens[r], r))
                self._tokens[d] += sum(len(s.prompt_ids) + s.num_tokens for s in g)
            out[d].extend(g)
        return out

    @property
    def replicas(self) -> int:
        return self.dp

    def accumulate(self, samples: Sequence[TrainSample]) -> AccumStats:
        """The chunk's groups spread over the replicas by tokens (``_place``), all at once."""
        return self._accumulate(self._place(samples), time.perf_counter())

    def accumulate_on(self, replica: int, samples: Sequence[TrainSample]) -> AccumStats:
        """The chunk on DP replica ``replica`` alone (its TP and PP ranks); the stream trainer calls
        this from one thread per replica at once, so every replica computes at the same time."""
        t0 = time.perf_counter()
        if not 0 <= replica < self.dp:
            raise TrainerError(f"accumulate_on replica {replica}: the gang has replicas 0..{self.dp - 1}")
        parts: list[list[TrainSample]] = [[] for _ in range(self.dp)]
        parts[replica] = list(samples)
        with self._lock:
            self._tokens[replica] += sum(len(s.prompt_ids) + s.num_tokens for s in samples)
        return self._accumulate(parts, t0)

    def _accumulate(self, parts: list[list[TrainSample]], t0: float) -> AccumStats:
        """``parts[d]`` on replica ``d``'s ranks, waited for together; the heads' sums recorded."""
        refs, heads = [], []
        for d, part in enumerate(parts):
            if not part:
                continue
            for i in self._ranks(dp=d):
                refs.append(self.actors[i].accumulate.remote(part))
                if i == self._head(d):
                    heads.append(len(refs) - 1)
        got = self._get(refs, "accumulate")
        samples = [s for part in parts for s in part]
        dt = time.perf_counter() - t0
        loss_sum = 0.0
        with self._lock:  # one thread per replica records here
            for h in heads:
                self._acc = defaultdict(
                    float, merge_sums(self._acc, {k: v for k, v in got[h].items() if k != "seconds"})
                )
                loss_sum += got[h]["loss_sum"]
            self._lengths.extend(s.num_tokens for s in samples)
            self._acc["seconds"] += dt
        return AccumStats(len(samples), sum(s.num_tokens for s in samples), loss_sum, dt)

    def finish_step(self) -> TrainStats:
        t0 = time.perf_counter()
        if not self._lengths:  # overlong filtering removed the whole batch: base.zero_update
            self.policy_version += 1
            self._reset_accum()
            return zero_update(self.policy_version, time.perf_counter() - t0)
        d = denominator(self.norm, self._lengths, self.cfg.loss_budget_tokens)
        out = self._all("finish_step", float(d))[0]
        self.optimizer_steps += 1
        self.policy_version += 1
        self._saved = None
        n_tok = sum(self._lengths)
        a = self._acc
        stats = TrainStats(
            samples=len(self._lengths),
            tokens=n_tok,
            loss=a["loss_sum"] / d,
            grad_norm=out["grad_norm"],
            clip_frac=a["clipped"] / n_tok,
            ratio_mean=a["ratio_sum"] / n_tok,
            kl=a["kl_sum"] / n_tok,
            policy_version=self.policy_version,
            seconds=a["seconds"] + time.perf_counter() - t0,
            behav_weight=a["bw_sum"] / n_tok,
            fidelity={k: a[k] for k in sum_keys()},
        )
        self._reset_accum()
        return stats

    def train_batch(self, samples: Sequence[TrainSample]) -> TrainStats:
        """Monolithic path: ``mini_batches`` optimizer steps over contiguous slices."""
        if not samples:
            raise TrainerError("train_batch got no samples")
        k = min(self.cfg.mini_batches, len(samples))
        if k > 1:  # pi_old is the weights before the first step, for every mini-batch
            samples = with_old_logprobs(samples, self.logprobs(samples))
        bounds = [round(i * len(samples) / k) for i in range(k + 1)]
        steps = []
        for a, b in itertools.pairwise(bounds):
            self.accumulate(samples[a:b])
            steps.append(self.finish_step())
        tok = sum(s.tokens for s in steps)
        return TrainStats(
            samples=sum(s.samples for s in steps),
            tokens=tok,
            loss=sum(s.loss for s in steps) / len(steps),
            grad_norm=sum(s.grad_norm for s in steps) / len(steps),
            clip_frac=sum(s.clip_frac * s.tokens for s in steps) / tok,
            ratio_mean=sum(s.ratio_mean * s.tokens for s in steps) / tok,
            kl=sum(s.kl * s.tokens for s in steps) / tok,
            policy_version=self.policy_version,
            seconds=sum(s.seconds for s in steps),
            optimizer_steps=len(steps),
            behav_weight=sum(s.behav_weight * s.tokens for s in steps) / tok,
            fidelity=merged_fidelity(steps),
        )

    def logprobs(self, samples: Sequence[TrainSample]) -> list[list[float]]:
        """Contiguous slices per DP replica (input order kept)."""
        items = list(samples)
        bounds = [round(i * len(items) / self.dp) for i in range(self.dp + 1)]
        refs, heads = [], []
        for d in range(self.dp):
            part = items[bounds[d] : bounds[d + 1]]
            if not part:
                continue
            for i in self._ranks(dp=d):
                refs.append(self.actors[i].logprobs.remote(part))
                if i == self._head(d):
                    heads.append(len(refs) - 1)
        got = self._get(refs, "logprobs")
        return [lp for h in heads for lp in got[h]]

    def grads_hf(self) -> dict[str, Any]:
        """The reduced, ``1 / D``-scaled gradient in HF names, without a step (exactness checks).
        Drops the accumulated gradients."""
        d = denominator(self.norm, self._lengths, self.cfg.loss_budget_tokens)
        got = self._all("grads_hf", float(d))
        out: dict[str, Any] = {}
        for p in range(self.pp):
            out.update(got[self._head(0, p)])
        self._reset_accum()
        return out

    # -- weights out -------------------------------------------------------------------------------
    def weight_buckets(self) -> Iterator[dict[str, Any]]:
        """HF-named full tensors, stage by stage, in buckets of at most ``bucket_mb`` (a tensor
        larger than that comes alone)."""
        limit = int(self.mcfg.bucket_mb * 2**20)
        for p in range(self.pp):
            ranks = self._ranks(pp=p, dp=0)
            head = self._head(0, p)
            plan = self._get([self.actors[head].bucket_plan.remote(limit)], "bucket_plan")[0]
            for names in plan:
                got = self._get([self.actors[i].export_bucket.remote(names) for i in ranks], "weights")
                yield got[ranks.index(head)]

    def weights(self, tied_head: bool = True) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) pairs, ``lm_head.weight`` included when tied (vLLM on CPU needs it)
        unless ``tied_head`` is False. Right after ``save_checkpoint`` the set it gathered is
        handed out (once) instead of gathering again: the trainer service saves, then pushes."""
        skip = "lm_head.weight" if self.layout.tied and not tied_head else None
        cached, self._saved = self._saved, None
        if cached is not None and cached[0] == self.policy_version:
            yield from ((n, t) for n, t in cached[1].items() if n != skip)
            return
        for bucket in self.weight_buckets():
            yield from ((n, t) for n, t in bucket.items() if n != skip)

    # -- the collective weight push (train.weight_sync: collective) ----------------------------------
    def _senders(self) -> list[Any]:
        """One sender per pipeline stage: its (tp 0, dp 0) rank, which holds the stage's gathered
        tensors; sender ``p`` is rank ``p`` of the weight-transfer group."""
        return [self.actors[self._head(0, p)] for p in range(self.pp)]

    @property
    def weight_senders(self) -> int:
        """The weight-transfer group's sending ranks (``TransferGroup.senders``): one per stage."""
        return self.pp

    def weight_sender_address(self) -> tuple[str, int]:
        """Where the first stage's sender hosts the weight-transfer group's rendezvous."""
        got = self._get([self._senders()[0].weight_sender_address.remote()], "weight_sender_address")[0]
        address, port = got
        return str(address), int(port)

    def open_weight_group(self, group: TransferGroup) -> None:
        """Every stage's sender joins ``group`` (stage ``p`` as rank ``p``); returns once the
        engines' workers have joined too."""
        if group.senders != self.pp:
            raise TrainerError(
                f"weight transfer group with {group.senders} sender(s) for a gang of {self.pp} pipeline "
                "stage(s): open it with senders = train.megatron.pp"
            )
        refs = [a.open_weight_group.remote(group.to_json(), p) for p, a in enumerate(self._senders())]
        self._get(refs, "open_weight_group")

    def push_weights(self, bucket_bytes: int) -> PushReport:
        """Every rank exports bucket by bucket (TP gathers, on the ranks' devices); each stage's
        sender broadcasts its stage's buckets to the engines' workers as they are gathered, the
        stages side by side: no copy of the weights passes through this driver or Ray's object
        store. Returns the stages' reports summed (seconds: the slowest stage)."""
        got = self._all("push_weights", int(bucket_bytes))
        where = "weight push report"
        reports = [PushReport.from_json(got[self.actors.index(a)], where=where) for a in self._senders()]
        return PushReport(
            buckets=sum(r.buckets for r in reports),
            tensors=sum(r.tensors for r in reports),
            payload_bytes=sum(r.payload_bytes for r in reports),
            header_bytes=sum(r.header_bytes for r in reports),
            copied_bytes=sum(r.copied_bytes for r in reports),
            seconds=max(r.seconds for r in reports),
        )

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, path: Path) -> Path:
        """``store_checkpoint`` into a directory of this machine (a file store at its parent),
        written to a sibling and renamed. The directory must be on a filesystem every rank sees
        (one node, or a shared volume); across nodes use the object store (``store_checkpoint``)."""
        from rollpacker.store.local import FileStore

        path = Path(path).resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".tmp-", dir=path.parent))
        try:
            tmp.rmdir()  # the store writes it
            self.store_checkpoint(
                FileStore(path.parent), StoreConfig(endpoint=f"file://{path.parent}"), tmp.name
            )
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return path

    def store_checkpoint(self, store: ObjectStore, store_cfg: StoreConfig, key: str) -> str:
        """The checkpoint ``save_checkpoint`` writes, streamed to ``key`` in the store instead of
        staged on a local disk: every rank uploads its own ``dist/`` shard files from a scratch
        directory of its own (``RankWorker.store_checkpoint``), and this driver writes ``model/``
        one safetensors file per weight bucket (``bucket_mb``), each deleted once uploaded;
        ``trainer.json`` goes last. Returns the checkpoint's URI."""
        from safetensors.torch import save_file

        if self.pending_samples:
            raise TrainerError("checkpoint with streamed gradients pending: finish_step first")
        key = key.strip("/")
        self._all("store_checkpoint", store_cfg, f"{key}/dist")
        gathered: dict[str, Any] = {}
        index: dict[str, str] = {}
        with tempfile.TemporaryDirectory(prefix="rollpacker-hf-") as tmp:
            for i, bucket in enumerate(self.weight_buckets()):
                gathered.update(bucket)
                part = {
                    n: t.contiguous()
                    for n, t in bucket.items()
                    if n != "lm_head.weight" or not self.layout.tied
                }
                if not part:
                    continue
                d = Path(tmp) / f"bucket-{i}"
                d.mkdir()
                name = f"model-{i:05d}.safetensors"
                save_file(part, str(d / name), metadata={"format": "pt"})
                store.upload_dir(d, f"{key}/model")
                shutil.rmtree(d)
                index.update(dict.fromkeys(part, name))
            meta_dir = Path(tmp) / "meta"
            (meta_dir / "model").mkdir(parents=True)
            index_doc = {"metadata": {}, "weight_map": dict(sorted(index.items()))}
            (meta_dir / "model" / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=1))
            for f in ("config.json", "generation_config.json", *_TOKENIZER_FILES):
                if (self.model_dir / f).is_file():
                    shutil.copy2(self.model_dir / f, meta_dir / "model" / f)
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, meta_dir / "rng.pt")
            store.upload_dir(meta_dir, key)
            store.put_bytes(
                f"{key}/trainer.json", json.dumps(self._meta(), indent=2).encode(), "application/json"
            )
        self._saved = (self.policy_version, gathered)
        return store.uri(f"{key}/")

    def _meta(self) -> dict[str, Any]:
        return {
            "version": CHECKPOINT_VERSION,
            "backend": "megatron",
            "policy_version": self.policy_version,
            "optimizer_steps": self.optimizer_steps,
            "layout": {"tp": self.mcfg.tp, "pp": self.mcfg.pp, "dp": self.dp},
        }

    def load_checkpoint(self, path: Path) -> None:
        """``restore`` from a directory of this machine (read as a file store)."""
        self.restore(StoreSource.local(path))

    def restore(self, src: StoreSource) -> None:
        """Weights and optimizer state from the checkpoint at ``src`` in the store: its ``dist/``
        (resharded to this gang's layout), or, for a torch-backend checkpoint, its HF weights.
        Every rank fetches what it reads on its own node; this driver reads only ``trainer.json``
        and the RNG state."""
        if not src.exists("trainer.json"):
            raise TrainerError(f"{src.uri} is not a trainer checkpoint (no trainer.json)")
        meta = src.read_json("trainer.json")
        if meta.get("backend") != "megatron" or not src.exists("dist/.metadata"):
            self._all("load_source", src.model())  # the torch backend's checkpoint: weights only
        else:
            self._all(
                "load_checkpoint",
                src.child("dist"),
                int(meta["policy_version"]),
                int(meta["optimizer_steps"]),
            )
        if src.exists("rng.pt"):
            rng = src.read_torch("rng.pt")
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
        self.policy_version = int(meta["policy_version"])
        self.optimizer_steps = int(meta["optimizer_steps"])
        self._saved = None
        self._reset_accum()

    def close(self) -> None:
        import ray

        for a in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(a)
        self.actors = []
        shutil.rmtree(self.model_dir, ignore_errors=True)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
            self._pg = None


def _meta_dir(src: StoreSource) -> Path:
    """A directory of this driver holding the model's config and tokenizer files (what a
    checkpoint and an export copy beside the weights), read from the store."""
    out = Path(tempfile.mkdtemp(prefix="rollpacker-meta-"))
    for f in ("config.json", "generation_config.json", *_TOKENIZER_FILES):
        if src.exists(f):
            (out / f).write_bytes(src.read_bytes(f))
    return out


def _local_ray(num_cpus: float, attempts: int = 3) -> None:
    """Start a local Ray head for the gang. Ray gives its raylet a fixed 30 s to register, which a
    loaded 2-core machine can miss: retried ``attempts`` times before the error is raised."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    for i in range(attempts):
        try:
            # "local": a new head of its own, never a cluster `ray start` left on this machine
            # (ray.init() with no address attaches to the last one and then refuses num_cpus)
            ray.init(
                address="local",
                num_cpus=num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
            )
            return
        except Exception as e:
            ray.shutdown()
            if i == attempts - 1 or "timed out during startup" not in str(e):
                raise TrainerError(f"could not start a local Ray for the megatron gang: {e}") from e


def _tail(e: BaseException, n: int = 600) -> str:
    """The end of a remote error (its cause is last)."""
    text = str(e).strip()
    return text if len(text) <= n else "..." + text[-n:]


def _rendezvous_impl() -> tuple[str, int]:
    """The address and a free port on the node of rank 0's bundle."""
    import socket

    import ray

    addr = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return addr, port


def _remote_rendezvous() -> Any:
    import ray

    return ray.remote(_rendezvous_impl)


class _Lazy:
    """``ray.remote`` applied on first use (ray is imported lazily)."""

    def __init__(self) -> None:
        self._fn: Any = None

    def options(self, **kw: Any) -> Any:
        if self._fn is None:
            self._fn = _remote_rendezvous()
        return self._fn.options(**kw)


_rendezvous = _Lazy()
