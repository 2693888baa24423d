"""The trainer service: the torch policy, its optimizer, and the stream trainer.

Rewarded groups arrive during rollout (``submit``, from the reward services) and their gradients
accumulate at once; the training stage calls ``finish``, which waits for every group the round
produced, takes the one deferred optimizer step, writes the checkpoint to the object store under
an attempt-unique prefix, and pushes the new weights into the rollout engine in place:
through the object store (one Ray call) or, with ``train.weight_sync: collective``, by a
broadcast over a process group with the engine's workers (``engines/weight_transfer.py``; a push
that cannot run that way goes through the object store instead).

Checkpoint cadence (``checkpoint.every``): a checkpoint is written after every N-th step and the
last one. A step between checkpoints names its weights with its checkpoint key but writes nothing
(``TrainReport.stored`` False): they live in this trainer and, pushed, in the engine. ``holds``
tells the plan stage whether they are still here; when they are not (a rank died, the service was
rebuilt, an update ran ahead of the state), the plan rolls the arm back to the last stored
checkpoint (``stages/plan.py``). The megatron backend streams its checkpoint: every rank uploads
its own shard files and the Hugging Face weights go up one bucket at a time, so no disk holds the
whole checkpoint (``MegatronTrainer.store_checkpoint``).

In the one-off pipeline (``rollout.one_off``, RollPacker 6.7) the groups of step t are held, not
trained: ``finish`` writes them to the object store as the pending batch (the state points to it),
and step t+1's ``begin`` streams that batch's gradients while step t+1 rolls out with the weights
that sampled it; step t+1's update therefore trains tokens one version old.

Repurposed devices (RollPacker 4.4, Algorithm 1 lines 18-19 and 23; ``rollout.scale_down``): when
the rollout service frees engine replicas in the tail of a round it calls ``repurpose`` with their
devices, and the stream trainer computes the rest of the streamed gradients on them; ``finish``
gives them back after the deferred update (before the weight push and the next round), and
``begin`` and ``close`` do too. On this CPU a device is a core: the gradient worker runs one
intra-op thread per freed core, pinned to those cores (``StreamTrainer.place``); before any
scale-down it runs its base thread on the cores it shares with rollout (no device of its own,
``train/devices`` 0), as the paper's G_train starts empty. On a GPU node a device is a GPU index
(``CUDA_VISIBLE_DEVICES`` of the freed replica): the lease is recorded and logged the same way,
but this one-device torch trainer does not move onto it (a data-parallel trainer, e.g. the
megatron backend, would start a training replica on the freed GPUs and all-reduce its unscaled
sums at ``finish``); that path has not run on a GPU. Metrics: ``train/devices`` (devices held,
time-weighted over the step from ``begin`` to the give-back), ``train/devices_max``,
``train/threads`` (the gradient worker's threads, time-weighted), ``train/repurposed_s`` and,
when devices were lent, ``train/repurposed_at_s`` / ``train/returned_at_s`` (seconds from
``begin``): the step's device timeline.

Invariants:
- ``begin`` puts the trainer exactly at the committed state's checkpoint (weights, optimizer, RNG,
  policy version) and drops every gradient of an earlier attempt; a trainer that ran ahead of the
  committed state (the training stage died after its update) is rolled back;
- ``finish`` trains on exactly the round's groups: a missing or unexpected group is an error;
- a checkpoint URI is never rewritten: a re-run step writes under its own attempt prefix;
- a state whose weights are in no store is never restored from one: ``begin`` refuses it, naming
  the step the plan rolls back to;
- repurposed devices are held only within one attempt: ``finish``, ``begin`` and ``close`` give
  them back, and a ``repurpose`` of another attempt is ignored.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollpacker.core.advantages import TrainSample
from rollpacker.core.config import TrainerConfig
from rollpacker.core.errors import TrainerError
from rollpacker.core.fidelity import fidelity_metrics, probe_bound, probe_gap
from rollpacker.core.metrics import policy_lag
from rollpacker.core.scaledown import DeviceTimeline
from rollpacker.core.serde import MessageError
from rollpacker.core.state import ControllerState
from rollpacker.core.types import Role
from rollpacker.services.api import (
    DeviceLease,
    Pending,
    PendingBatch,
    TrainerAPI,
    TrainerBegin,
    TrainReport,
)
from rollpacker.services.base import Service, ServiceError, checkpoint_cache
from rollpacker.store.base import ObjectStore, cached_download
from rollpacker.store.state_store import StateStore

log = logging.getLogger(__name__)


class TrainerService(Service, TrainerAPI):
    def __init__(self, config_text: str, arm: str, role: Role = Role.TRAINER) -> None:
        super().__init__(config_text, arm, role)
        self.trainer: Any = None
        self.stream: Any = None
        self.checkpoint_uri = ""
        self._attempt = ""
        self._got: set[str] = set()
        self._samples = 0
        self._versions: list[tuple[int, ...]] = []  # token versions of every sample trained
        self._held: list[TrainSample] = []  # one-off: this step's samples, trained next step
        self._pending = 0  # one-off: samples of the previous step being trained now
        self._cond = threading.Condition()
        # one finish at a time, and a begin waits for an older attempt's update in flight: the
        # update is begun as the round ends (``begin_update``) and runs while the drain stages do
        self._finish_lock = threading.Lock()
        self._t0 = time.perf_counter()  # this attempt's begin: the device timeline's zero
        self._lease: tuple[str, ...] = ()  # devices repurposed from rollout, held until finish
        self._devices = DeviceTimeline()
        self._threads = DeviceTimeline(1)
        self._wt: tuple[Any, int] | None = (
            None  # the weight-transfer group (train.weight_sync: collective) and its port
        )

    def begin(self, attempt: str, state: ControllerState, base_uri: str) -> TrainerBegin:
        t0 = time.perf_counter()
        self.peers.refresh()  # a rollout service rebuilt since the last attempt is the one to push to
        with self._cond:  # an older attempt's finish still waiting for its groups gives up now
            self._attempt = attempt
            self._cond.notify_all()
        with self._finish_lock:  # ... and one already updating completes first (restored below)
            return self._begin(attempt, state, base_uri, t0)

    def _begin(self, attempt: str, state: ControllerState, base_uri: str, t0: float) -> TrainerBegin:
        from rollpacker.trainers.stream import StreamTrainer

        self._give_back()  # an attempt that died holding rollout's devices
        with self._cond:
            self._attempt = attempt
            self._got = set()
            self._samples = 0
            self._versions = []
            self._held = []
            self._pending = 0
            self._t0 = t0
            self._devices = DeviceTimeline()
            self._threads = DeviceTimeline(1)
        if self.stream is not None:
            self.stream.close()  # joins the worker: an older attempt's gradients finish or stop here
            self.stream = None
        restored = not self._holds(state.checkpoint_uri)
        if restored and state.rollback_step is not None:
            raise TrainerError(
                f"step {state.step}'s weights ({state.checkpoint_uri}) were only in the trainer's memory "
                f"(checkpoint.every = {self.cfg.checkpoint.every}) and this trainer no longer holds them: "
                f"re-run the step from its plan, which rolls the arm back to step {state.rollback_step}"
            )
        if restored:
            self._restore(state.checkpoint_uri, base_uri)
        if self.trainer.policy_version != state.policy_version:
            raise TrainerError(
                f"checkpoint {state.checkpoint_uri} holds policy version {self.trainer.policy_version}, "
                f"the state says {state.policy_version}: the state document and its checkpoint disagree"
            )
        self.trainer._reset_accum()
        self.stream = StreamTrainer(self.trainer, stream=self.cfg.train.stream)
        if self.cfg.rollout.one_off and state.pending_batch_uri:
            pending = load_batch(self.store(), state.pending_batch_uri)
            self._pending = len(pending)
            self._versions = [s.versions for s in pending]
            self.stream.submit(pending)  # its gradients run while this step rolls out
        return TrainerBegin(time.perf_counter() - t0, restored, self._pending)

    def _restore(self, checkpoint_uri: str, base_uri: str) -> None:
        """The trainer at ``checkpoint_uri`` (weights, optimizer, RNG, policy version)."""
        from rollpacker.trainers.torch_trainer import TorchTrainer, train_placement

        cfg = self.cfg
        if cfg.train.backend == "megatron":  # the ranks read the store themselves: nothing downloaded here
            self._restore_megatron(checkpoint_uri)
            self.checkpoint_uri = checkpoint_uri
            return
        ck = cached_download(self.store(), checkpoint_uri, checkpoint_cache())
        base = cached_download(self.store(), base_uri, checkpoint_cache())
        device, dtype = train_placement(cfg.train, cfg.gpu_declarations)  # train.device, train.dtype
        self.trainer = TorchTrainer(
            ck / "model" if (ck / "model").is_dir() else ck,
            dataclasses.replace(cfg.train, seed=cfg.seed + cfg.train.seed),
            temperature=cfg.rollout.temperature,
            dtype=dtype,
            device=device,
            ref_model_dir=base / "model" if (base / "model").is_dir() else base,
        )
        if (ck / "trainer.json").is_file():
            self.trainer.load_checkpoint(ck)
        self.checkpoint_uri = checkpoint_uri

    def _restore_megatron(self, checkpoint_uri: str) -> None:
        """The megatron gang at the checkpoint ``checkpoint_uri``: the running gang reloads it
        (dist_checkpointing, resharded to this layout); a broken gang (a rank died), none, or a
        restart from the base model (fresh optimizer state) builds the gang anew first. Neither
        this service nor the ranks are handed a path: each rank fetches its part from the store
        on its own node (``trainers/megatron/source.py``), so no filesystem is shared."""
        from rollpacker.trainers.megatron.gang import MegatronTrainer
        from rollpacker.trainers.megatron.source import StoreSource

        cfg = self.cfg
        src = StoreSource(cfg.store, checkpoint_uri)
        base = not src.exists("trainer.json")
        if self.trainer is not None and (base or getattr(self.trainer, "broken", "")):
            self.trainer.close()
            self.trainer = None
        if self.trainer is None:
            # the weight-transfer group's senders were the old gang's ranks: the new gang opens
            # its own at the next push (else its senders, in no group, would be asked to send)
            self._wt = None
            self.trainer = MegatronTrainer(
                src.model(),
                dataclasses.replace(cfg.train, seed=cfg.seed + cfg.train.seed),
                temperature=cfg.rollout.temperature,
                longest_tokens=cfg.engine.max_model_len,  # prompt + response: the memory preflight
            )
            if base:
                return  # the base model: the gang was built from it
        self.trainer.restore(src)

    def holds(self, checkpoint_uri: str) -> bool:
        """False, too, while an older attempt's ``finish`` is still in flight (waiting for groups
        that may never come, or updating): its weights are about to run ahead, or may."""
        if not self._finish_lock.acquire(blocking=False):
            return False
        try:
            return self._holds(checkpoint_uri)
        finally:
            self._finish_lock.release()

    def _holds(self, checkpoint_uri: str) -> bool:
        broken = bool(getattr(self.trainer, "broken", ""))  # a megatron gang that lost a rank
        return self.trainer is not None and not broken and self.checkpoint_uri == checkpoint_uri

    def submit(self, attempt: str, prompt_id: str, samples: tuple[TrainSample, ...]) -> None:
        with self._cond:
            if attempt != self._attempt:
                return  # a late group of an older attempt
            if prompt_id in self._got:
                raise TrainerError(f"group {prompt_id!r} submitted twice in attempt {attempt}")
            self._got.add(prompt_id)
            self._samples += len(samples)
            if self.cfg.rollout.one_off:
                self._held.extend(samples)
            else:
                self._versions.extend(s.versions for s in samples)
                self.stream.submit(list(samples))
            self._cond.notify_all()

    def repurpose(self, attempt: str, devices: tuple[str, ...]) -> DeviceLease:
        """Compute the streamed gradients on ``devices`` (rollout freed them) until ``finish``."""
        with self._cond:
            now = time.perf_counter() - self._t0
            if attempt != self._attempt or self.stream is None or not devices:
                return DeviceLease((), 0, now)  # a late call of an older attempt
            held = tuple(sorted(set(self._lease) | set(devices)))
            threads = self.stream.place(_cores(held))
            self._lease = held
            self._devices = self._devices.at(now, len(held))
            self._threads = self._threads.at(now, threads)
            return DeviceLease(held, threads, now)

    def _give_back(self) -> None:
        """The repurposed devices back to rollout: the gradient worker on its base placement."""
        with self._cond:
            if not self._lease:
                return
            now = time.perf_counter() - self._t0
            threads = self.stream.place(None) if self.stream is not None else 1
            self._lease = ()
            self._devices = self._devices.at(now, 0)
            self._threads = self._threads.at(now, threads)

    def _device_metrics(self) -> dict[str, float]:
        """The step's device timeline (call after ``_give_back``): ``train/devices`` and friends."""
        end = time.perf_counter() - self._t0
        dev, thr = self._devices, self._threads
        out = {
            "train/devices": dev.mean(end),
            "train/devices_max": float(dev.peak()),
            "train/threads": thr.mean(end),
            "train/repurposed_s": dev.held_s(end),
        }
        lent = [t for t, n in dev.changes if n > 0]
        if lent:
            out["train/repurposed_at_s"] = lent[0]
            out["train/returned_at_s"] = next((t for t, n in dev.changes if n == 0 and t >= lent[0]), end)
        return out

    def begin_update(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> Pending[TrainReport]:
        keys = checkpoint_key, batch_key
        return self._run_ahead(
            "update", attempt, TrainReport, lambda: self.finish(attempt, step, expected, *keys)
        )

    def finish(
        self, attempt: str, step: int, expected: tuple[str, ...], checkpoint_key: str, batch_key: str
    ) -> TrainReport:
        """The step's one optimizer update on exactly ``expected`` groups (one-off: on the previous
        step's, and ``expected`` are stored at ``batch_key`` for the next); checkpoint; weight push."""
        t0 = time.perf_counter()
        want = set(expected)
        with self._finish_lock:
            self._whole_node(attempt)
            try:
                return self._finish(attempt, step, want, (checkpoint_key, batch_key), t0)
            finally:
                self._whole_node_back()

    def _whole_node(self, attempt: str) -> None:
        """The round is over when ``finish`` is called: the gradients still to compute (the last,
        longest groups and any backlog) run on every core of this process, not on the one thread
        that shared the cores with the engine during rollout."""
        cores = _cores(tuple(str(c) for c in os.sched_getaffinity(0))) if _HAS_AFFINITY else None
        with self._cond:
            if attempt != self._attempt or self.stream is None or not self.cfg.train.stream or not cores:
                return
            threads = self.stream.place(cores)
            self._threads = self._threads.at(time.perf_counter() - self._t0, threads)

    def _whole_node_back(self) -> None:
        with self._cond:
            if self.stream is not None and not self._lease and self.stream.placement is not None:
                threads = self.stream.place(None)
                self._threads = self._threads.at(time.perf_counter() - self._t0, threads)

    def _finish(
        self, attempt: str, step: int, want: set[str], keys: tuple[str, str], t0: float
    ) -> TrainReport:
        checkpoint_key, batch_key = keys
        timeout_s = self.cfg.services.call_timeout_s
        with self._cond:
            if not self._attempt:
                raise TrainerError(
                    f"finish of attempt {attempt}, but this trainer was rebuilt since the attempt began "
                    "(the one that held its gradients died); re-run the step from its plan"
                )
            if attempt != self._attempt:
                raise TrainerError(f"finish of attempt {attempt}, but the trainer is on {self._attempt}")
            ok = self._cond.wait_for(lambda: attempt != self._attempt or want <= self._got, timeout=timeout_s)
            if attempt != self._attempt:
                raise TrainerError(f"finish of attempt {attempt}: superseded by attempt {self._attempt}")
            if not ok:
                raise TrainerError(
                    f"{len(want - self._got)} groups never reached the trainer in {timeout_s} s"
                )
            if self._got != want:
                raise TrainerError(
                    f"step {step}: trained groups {sorted(self._got - want)} are not the round's"
                )
            samples = self._samples
        wait_s = time.perf_counter() - t0
        pending_uri = ""
        if self.cfg.rollout.one_off:
            if not batch_key:
                raise TrainerError("one-off pipeline: finish needs the key to store the step's batch at")
            pending_uri = save_batch(self.store(), batch_key, self._held)
            samples = self._pending
            if not self._pending:  # the first step: nothing rolled out before it, no update
                self._give_back()
                held = {
                    "train/wait_s": wait_s,
                    "train/held_samples": float(len(self._held)),
                    **self._device_metrics(),
                }
                return TrainReport(self.checkpoint_uri, self.trainer.policy_version, 0, pending_uri, held)
        ck = self.cfg.checkpoint
        export_key = StateStore(self.store(), self.cfg.experiment, self.arm).export_prefix(step, attempt)
        keys = (checkpoint_key, export_key if ck.export_due(step) else "")
        return self._update(samples, wait_s, keys, pending_uri, ck.due(step, self.cfg.steps))

    def _push_weights(self, uri: str, weights: dict[str, Any]) -> None:
        """The new weights into the rollout engine. A rollout service that died since the last push
        (its handle is then dropped) is looked up again once: the rebuilt one takes them, or, with
        no engine yet, loads the checkpoint at its next sync."""
        try:
            self.peers.rollout().load_weights(self.trainer.policy_version, uri, weights)
        except ServiceError as e:
            if "died" not in str(e):
                raise
            log.warning("trainer: %s; pushing the weights to the rebuilt rollout service", e)
            self.peers.rollout().load_weights(self.trainer.policy_version, uri, weights)

    def _probe_sync(self) -> dict[str, float]:
        """The weight-sync probe: the engine's logprobs on the probe prompts against the trainer's
        on the same tokens; ``sync/probe_logprob_gap``, or a ``TrainerError`` naming the gap when
        it passes the bound the two precisions set (core/fidelity.py). Nothing when off or when no
        engine is up."""
        pc = self.cfg.train.sync_probe
        if not pc.enabled:
            return {}
        t0 = time.perf_counter()
        got = self.peers.rollout().probe(pc.prompts, pc.max_tokens)
        if not got.response_ids:
            return {}
        samples = [
            TrainSample(f"probe/{i}", f"probe/{i}", p, r, lp, 0.0, 0.0)
            for i, (p, r, lp) in enumerate(zip(got.prompt_ids, got.response_ids, got.logprobs, strict=True))
        ]
        gap = probe_gap(self.trainer.logprobs(samples), [list(lp) for lp in got.logprobs])
        engine_dtype, train_dtype = self.cfg.engine.dtype, _train_dtype(self.cfg.train)
        bound = probe_bound(pc, engine_dtype, train_dtype)
        pushed = self.trainer.policy_version
        if not gap <= bound or got.policy_version != pushed:
            raise TrainerError(
                f"weight-sync probe failed after pushing policy version {pushed}: "
                f"sync/probe_logprob_gap = {gap:.3g} (mean |trainer - engine| logprob over "
                f"{sum(len(r) for r in got.response_ids)} probe tokens), bound {bound:.3g} "
                f"({engine_dtype} engine, {train_dtype} trainer), engine at version {got.policy_version}: "
                "the engine serves other weights than the trainer's (a stale or half-loaded weight push). "
                "The step fails before any rollout on them; check the push (weights/sync_s, the rollout "
                "service's log) or raise train.sync_probe.bound if the precisions differ more"
            )
        return {"sync/probe_logprob_gap": gap, "sync/probe_s": time.perf_counter() - t0}

    def _push_collective(self, uri: str) -> int | None:
        """The new weights broadcast to the engine's workers (``train.weight_sync: collective``;
        ``engines/weight_transfer.py``) over the group set up at the first push, and again whenever
        the engine is not in it (a rebuilt rollout service or engine); the bytes each worker
        received, or None when the push could not run: the caller then pushes through the object
        store, and the next push sets a group up anew."""
        from rollpacker.engines import weight_transfer as wt

        rollout = self.peers.rollout()
        # not a `with`: its exit would wait for the engine's receive, which a failed send leaves
        # blocked in the group until the group's timeout (600 s); the group is let go first instead
        ex = ThreadPoolExecutor(max_workers=1)
        error = ""
        try:
            peer = rollout.weight_peer(self._wt[1] if self._wt is not None else 0)
            if self._wt is None or not peer.joined:
                self._wt = self._open_transfer(peer.workers)
            got = ex.submit(rollout.receive_weights, self.trainer.policy_version, uri)
            if self._wt[0] is None:  # the megatron gang: each stage's (tp 0, dp 0) rank sends
                sent = self.trainer.push_weights(_bucket_bytes(self.cfg))
            else:
                named = self.trainer.weights(tied_head=False)  # no engine loads a tied head
                sent = wt.send(self._wt[0], named, _bucket_bytes(self.cfg), self.trainer.device)
            push = got.result(timeout=self.cfg.services.call_timeout_s)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"  # the text only: the traceback's frames hold the group
        finally:
            ex.shutdown(wait=False)
        if error:
            # the last reference to this end of the group: its connections close as it goes, and the
            # engine's receive fails within a second instead of at the group's timeout (gloo's
            # abort() and shutdown() close nothing: measured, the peer still waited 20 s later)
            self._wt = None
            log.warning(
                "trainer: the collective weight push failed (%s); pushing through the object store", error
            )
            return None
        if push.payload_bytes != sent.payload_bytes:
            raise TrainerError(
                f"collective weight push: sent {sent.payload_bytes} bytes, the engine received "
                f"{push.payload_bytes}"
            )
        return int(sent.payload_bytes)

    def _open_transfer(self, workers: int) -> tuple[Any, int]:
        """A new weight-transfer group with the engines' ``workers``: this trainer is its rank 0, or
        (the megatron gang) the gang's sending ranks are, one per pipeline stage, and the group's
        handles stay there (None)."""
        from rollpacker.core.weight_sync import TransferGroup
        from rollpacker.engines import weight_transfer as wt

        gang = self.cfg.train.backend == "megatron"  # the senders are ranks of the gang, not this process
        senders = 1
        if gang:  # one sender per pipeline stage
            address, port = self.trainer.weight_sender_address()
            backend = "nccl" if self.cfg.train.megatron.gpus_per_rank > 0 else "gloo"
            senders = int(self.trainer.weight_senders)
        else:
            address = _node_address()
            port = wt.free_port(address)
            backend = "nccl" if self.trainer.device.type == "cuda" else "gloo"
        group = TransferGroup(address, port, workers + senders, senders, backend, senders=senders)
        with ThreadPoolExecutor(max_workers=1) as ex:
            joined = ex.submit(self.peers.rollout().init_weight_transfer, group)
            pg = self.trainer.open_weight_group(group) if gang else wt.open_group(group, 0)
            joined.result(timeout=group.timeout_s)
        return pg, group.port

    def _update(
        self, samples: int, wait_s: float, keys: tuple[str, str], pending_uri: str, store: bool
    ) -> TrainReport:
        """The deferred optimizer step, the checkpoint in the store (``store``: a checkpoint is due;
        otherwise the checkpoint key only names the weights in memory), the weight push, and the
        Hugging Face export when the export key is given."""
        checkpoint_key, export_key = keys
        lag = policy_lag(self._versions, self.trainer.policy_version)
        # the trainer leaves its checkpoint now: should anything fail before the new one is stored,
        # the next begin restores the committed one instead of trusting the weights in memory
        self.checkpoint_uri = ""
        try:
            report = self.stream.finish()
        finally:
            self._give_back()  # before the checkpoint and the weight push: the next round's devices
        devices = self._device_metrics()
        t_ck = time.perf_counter()
        uri = self._store_checkpoint(checkpoint_key) if store else self.store().uri(checkpoint_key)
        ckpt_s = time.perf_counter() - t_ck
        self.checkpoint_uri = uri
        t_gather = time.perf_counter()
        collective = self.cfg.train.weight_sync == "collective"
        # the object-store path's copy (megatron: gathered in buckets), also what an export writes
        weights = None if collective else {n: t.detach().clone() for n, t in self.trainer.weights()}
        if export_key:
            # a copy (tied tensors share storage, which safetensors refuses), only when an export is due
            exported = weights or {n: t.detach().clone() for n, t in self.trainer.weights()}
            export_weights(self.store(), export_key, exported, self.trainer.model_dir)
        t_sync = time.perf_counter()
        pushed = self._push_collective(uri) if collective else None
        if pushed is None:  # the object-store path (the configured one, or the fallback)
            if weights is None:
                weights = {n: t.detach().clone() for n, t in self.trainer.weights()}
            self._push_weights(uri, weights)
            pushed = sum(t.numel() * t.element_size() for t in weights.values())
            del weights
        sync_s = time.perf_counter() - t_sync
        probe = self._probe_sync()  # before any rollout on the pushed weights
        gather_s = t_sync - t_gather
        st = report.stats
        return TrainReport(
            checkpoint_uri=uri,
            policy_version=self.trainer.policy_version,
            samples=samples,
            pending_batch_uri=pending_uri,
            stored=store,
            metrics={
                **lag.logged("train"),
                "train/behav_weight": st.behav_weight,
                "train/time_s": report.finish_s,
                "train/wait_s": wait_s,
                "train/overlap_s": report.overlap_s,
                "train/streamed_samples": float(report.streamed_samples),
                "train/loss": st.loss,
                "train/grad_norm": st.grad_norm,
                "train/clip_frac": st.clip_frac,
                "train/ratio_mean": st.ratio_mean,
                "train/kl": st.kl,
                **fidelity_metrics(st.fidelity),  # mismatch/*, correction/* (core/fidelity.py)
                "train/checkpoint_s": ckpt_s,
                "train/checkpoint_stored": float(store),
                "weights/sync_s": sync_s,
                "sync/weights_s": gather_s + sync_s,  # gather (TP/PP shards to HF names) + push
                **probe,
                "sync/weights_bytes": float(pushed),  # moved per push (per engine worker)
                "sync/collective": float(self._wt is not None),
                **devices,
            },
        )

    def _store_checkpoint(self, key: str) -> str:
        """The trainer's checkpoint at ``key`` in the store. A backend that streams its shards
        (megatron: every rank uploads its own) writes no local copy of the whole checkpoint."""
        streams = getattr(self.trainer, "store_checkpoint", None)
        if streams is not None:
            return str(streams(self.store(), self.cfg.store, key))
        with tempfile.TemporaryDirectory(prefix="rollpacker-ckpt-") as tmp:
            ck = self.trainer.save_checkpoint(Path(tmp) / "ckpt")
            return self.store().upload_dir(ck, key)

    def close(self) -> None:
        self._give_back()
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.trainer is not None and hasattr(self.trainer, "close"):  # the megatron gang's actors
            self.trainer.close()


_HAS_AFFINITY = hasattr(os, "sched_getaffinity")


def _train_dtype(cfg: TrainerConfig) -> str:
    """The dtype the trainer computes logprobs in (the megatron gang's, or the torch backend's)."""
    return cfg.megatron.dtype if cfg.backend == "megatron" else cfg.dtype


def _node_address() -> str:
    """This node's address, as the engine's workers reach it (Ray's view; loopback outside Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except ImportError:
        pass
    return "127.0.0.1"


def _bucket_bytes(cfg: Any) -> int:
    """The push's bucket size: ``train.megatron.bucket_mb`` (the same bound as the gang's export)."""
    return int(cfg.train.megatron.bucket_mb * 2**20)


def _cores(devices: tuple[str, ...]) -> frozenset[int] | None:
    """The CPU cores among ``devices`` this process may run on; None (no move) on a GPU node or
    when none is usable (the lease is still recorded)."""
    if os.environ.get("ROLLPACKER_VLLM_DEVICE", "cpu") != "cpu":
        return None  # GPU indices: see the module docstring
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cores = frozenset(int(d) for d in devices if d.isdigit() and int(d) in allowed)
    return cores or None


EXPORT_FILE_BYTES = 2 * 2**30  # one safetensors file of an export: written, uploaded, deleted


def export_weights(store: ObjectStore, key: str, weights: dict[str, Any], model_dir: Path) -> str:
    """The Hugging Face model at ``key`` (``checkpoint.export_every``): the weights in files of at
    most ``EXPORT_FILE_BYTES`` (a larger tensor comes alone), each uploaded and deleted before the
    next is written, an index, and the model's config and tokenizer files. Returns the URI."""
    import json
    import shutil

    from safetensors.torch import save_file

    from rollpacker.trainers.torch_trainer import _TOKENIZER_FILES

    parts: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in weights.items():
        n = t.numel() * t.element_size()
        if parts[-1] and size + n > EXPORT_FILE_BYTES:
            parts.append({})
            size = 0
        parts[-1][name] = t.contiguous()
        size += n
    index: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rollpacker-export-") as tmp:
        for i, part in enumerate(parts):
            d = Path(tmp) / f"part-{i}"
            d.mkdir()
            name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
            save_file(part, str(d / name), metadata={"format": "pt"})
            store.upload_dir(d, key)
            shutil.rmtree(d)
            index.update(dict.fromkeys(part, name))
        meta = Path(tmp) / "meta"
        meta.mkdir()
        (meta / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        for f in ("config.json", "generation_config.json", *_TOKENIZER_FILES):
            if (Path(model_dir) / f).is_file():
                shutil.copy2(Path(model_dir) / f, meta / f)
        return store.upload_dir(meta, key)


def save_batch(store: ObjectStore, key: str, samples: list[TrainSample]) -> str:
    """Write rewarded samples (the one-off pipeline's pending batch); returns the URI."""
    return store.put_bytes(key, PendingBatch(tuple(samples)).to_json().encode(), "application/json")


def load_batch(store: ObjectStore, uri: str) -> list[TrainSample]:
    """The samples ``save_batch`` wrote; a malformed document is refused by name."""
    try:
        batch = PendingBatch.from_json(store.get_bytes(store.key_of(uri)).decode(), where=uri)
    except MessageError as e:
        raise TrainerError(f"not a pending batch written by the trainer service: {e}") from e
    return list(batch.samples)
