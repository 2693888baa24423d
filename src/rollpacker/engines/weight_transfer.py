"""Weights pushed by collectives: the trainer broadcasts its weights to the vLLM engine's workers
over a process group between them (NCCL on GPUs, gloo on CPU), through vLLM's weight-transfer API.

vLLM 0.32 has a supported mechanism for RL weight updates: an engine started with
``weight_transfer_config`` builds a ``WeightTransferEngine`` in every worker, and the client drives
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` on all workers by ``collective_rpc`` (its offline ``RLOfflineMixin`` and
the online RL routes do the same). Backends register in ``WeightTransferEngineFactory``. This module
registers one more, ``rollpacker``, in every worker process (``vllm_transfer_ext``, the engine's
``worker_extension_cls``, registers it on import), because vLLM's own ``nccl`` backend needs vLLM
in the trainer process (its rendezvous is vLLM's ``StatelessProcessGroup`` and ``PyNccl``), runs on
CUDA only, and checks nothing on arrival. Ours is plain ``torch.distributed`` on both sides:

- the group: rank 0 (the first sender, a trainer process) hosts a ``TCPStore``; there is one
  sender per pipeline stage of the trainer (ranks ``0 .. senders - 1``, each sending its own
  stage's tensors), and every engine that serves (each replica of each started layout, for
  engines in layouts) joins with its workers as ranks ``rank_offset + worker rank``
  (``core.weight_sync.TransferGroup``). Each sender broadcasts over a process group of its own
  with every worker (``TransferGroup.sender_group``), so stages send side by side; a worker
  receives the stages' streams one after another. The groups are ``ProcessGroupNCCL`` for CUDA
  tensors and ``ProcessGroupGloo`` for CPU ones, outside any default process group (a megatron
  rank keeps its own world);
- a push is a stream of buckets of at most ``bucket_bytes``: each bucket's ``BucketHeader`` (names,
  dtypes, shapes, digest) is broadcast, then each tensor, straight from the trainer's parameter
  (no packing copy); the worker allocates the bucket, receives it, recomputes the digest and loads
  it before the next bucket arrives, so it never holds more than a bucket in flight: on CUDA with
  an unquantized model straight into the parameters (``model.load_weights``: the receive buffer
  and one copy, the two full-model copies of a push); on CPU (unquantized) the layers whose
  parameters keep the checkpoint layout (norms, embeddings, the LM head: ``keeps_checkpoint_layout``)
  straight into them too, and the linear layers, whose weights vLLM's CPU backend repacks,
  through vLLM's layerwise reload, which loads them in checkpoint layout and re-runs the post-load
  processing (``start_partial_reload``; the embeddings' packed GEMM copy is then rebuilt,
  ``reprocess``); a quantized model takes the layerwise reload for every layer
  (``loads_in_place``). A tied head's second name is not loaded (``tied_aliases``);
- a digest that disagrees fails the push naming the bucket; the worker drains the rest of the
  stream without loading it, so both sides stay aligned, and the engine must then be reloaded
  from the checkpoint (the object-store path) before it samples again;
- consistency: the push runs between rounds under the rollout service's round lock (no request is
  in flight, none is sampled on half-loaded weights), and the prefix cache is dropped after it.

The digest is two integer sums over each tensor's bytes read as integers (all of them, and every
other word), combined in tensor order modulo a prime: exact and order-independent on any device,
so the sender and a worker on another GPU agree bit for bit; it moves two scalars to the host per
tensor, never the tensor.

Invariants (tests/engines/test_weight_transfer.py):
- a push loads exactly the sent tensors, bit for bit, bucket by bucket, from every stage's sender;
- a corrupted bucket is refused by index and nothing after it is loaded; the stream stays aligned;
- the sender makes no copy of a contiguous tensor; a worker allocates one bucket at a time.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.core.errors import EngineError
from rollpacker.core.serde import Message
from rollpacker.core.weight_sync import BucketHeader, TensorSpec, TransferGroup

log = logging.getLogger(__name__)
BACKEND = "rollpacker"  # the name registered in vLLM's WeightTransferEngineFactory
EXTENSION = "rollpacker.engines.vllm_transfer_ext.PushReportExtension"  # the worker_extension_cls
_PRIME = (1 << 61) - 1
_WORDS = {8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


@dataclass(frozen=True)
class PushReport(Message):
    """One side's account of a push."""

    buckets: int
    tensors: int
    payload_bytes: int  # the tensors' bytes moved over the group
    header_bytes: int
    copied_bytes: int  # bytes this side copied to send or allocated to receive
    seconds: float
    error: str = ""  # a worker's digest mismatch (the push was drained, not loaded past it)


def free_port(address: str) -> int:
    """A free TCP port on ``address`` (the sender's rendezvous store)."""
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def open_group(group: TransferGroup, rank: int) -> Any:
    """This process's member of ``group`` (rank 0 hosts the rendezvous store): a sender's own
    group (``send``), or for an engine worker its member of every sender's group, in stage order
    (a tuple; ``receive``)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=group.timeout_s)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        group.address,
        group.port,
        group.world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )

    def member(sender: int) -> Any:
        prefix, local, size = group.sender_group(sender, rank)
        prefixed = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        if group.backend == "nccl":  # on this process's current CUDA device
            return dist.ProcessGroupNCCL(prefixed, local, size, dist.ProcessGroupNCCL.Options())
        return dist.ProcessGroupGloo(prefixed, local, size, timeout)

    if rank < group.senders:
        return member(rank)
    return tuple(member(s) for s in range(group.senders))


def _broadcast(pg: Any, t: Any, root: int = 0) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()


def _words(t: Any) -> Any:
    import torch

    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.view(getattr(torch, _WORDS[t.element_size()])).reshape(-1)


def digest(tensors: Sequence[Any]) -> tuple[int, int]:
    """The bucket digest: exact integer sums over the tensors' words, in tensor order."""
    import torch

    a = b = 0
    for i, t in enumerate(tensors, 1):
        w = _words(t if t.is_contiguous() else t.contiguous())
        whole = int(w.sum(dtype=torch.int64)) % _PRIME
        alt = int(w[::2].sum(dtype=torch.int64)) % _PRIME
        a = (a + i * whole) % _PRIME
        b = (b * 1_000_003 + alt + w.numel()) % _PRIME
    return a, b


def _spec(name: str, t: Any) -> TensorSpec:
    return TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(int(x) for x in t.shape))


def buckets(named: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Consecutive tensors in buckets of at most ``bucket_bytes`` (a larger tensor comes alone)."""
    out: list[tuple[str, Any]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if out and size + n > bucket_bytes:
            yield out
            out, size = [], 0
        out.append((name, t))
        size += n
    if out:
        yield out


def _send_header(pg: Any, header: BucketHeader, device: Any) -> int:
    import torch

    raw = header.to_json().encode()
    _broadcast(pg, torch.tensor([len(raw)], dtype=torch.int64, device=device))
    _broadcast(pg, torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device))
    return len(raw) + 8


def _recv_header(pg: Any, device: Any) -> tuple[BucketHeader, int]:
    import torch

    n = torch.zeros(1, dtype=torch.int64, device=device)
    _broadcast(pg, n)
    raw = torch.empty(int(n.item()), dtype=torch.uint8, device=device)
    _broadcast(pg, raw)
    return BucketHeader.from_json(
        bytes(raw.cpu().tolist()).decode(), where="weight push header"
    ), raw.numel() + 8


def send(pg: Any, named: Iterable[tuple[str, Any]], bucket_bytes: int, device: Any) -> PushReport:
    """Broadcast ``named`` (rank 0) to every other rank of ``pg``, bucket by bucket; returns what
    moved. A tensor is sent from its own storage (a non-contiguous one is copied first)."""
    t0 = time.perf_counter()
    n_b = n_t = payload = head = copied = 0
    for i, bucket in enumerate(buckets(named, bucket_bytes)):
        tensors = []
        for _, t in bucket:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
                copied += t.numel() * t.element_size()
            tensors.append(t)
        header = BucketHeader(
            i, tuple(_spec(n, t) for (n, _), t in zip(bucket, tensors, strict=True)), digest(tensors)
        )
        head += _send_header(pg, header, device)
        for t in tensors:
            _broadcast(pg, t)
        n_b, n_t, payload = n_b + 1, n_t + len(tensors), payload + header.bucket_bytes
    head += _send_header(pg, BucketHeader(n_b, (), (0, 0), end=True), device)
    return PushReport(n_b, n_t, payload, head, copied, time.perf_counter() - t0)


def receive(pg: Any, device: Any, load: Callable[[list[tuple[str, Any]]], Any]) -> PushReport:
    """Receive a push: from rank 0 of ``pg``, or of each group of a sequence of them (one per
    pipeline stage's sender, in stage order; what ``open_group`` gives a worker). Each bucket is
    allocated, received, checked against its digest and handed to ``load`` before the next one.
    After a mismatch the rest is received and dropped (no sender ever waits on a worker that
    stopped listening) and the report names the bucket."""
    t0 = time.perf_counter()
    groups = list(pg) if isinstance(pg, (list, tuple)) else [pg]
    n_b = n_t = payload = head = 0
    error = ""
    for stage, group in enumerate(groups):
        where = f"stage {stage}'s " if len(groups) > 1 else ""
        for got, header, nh in _stream(group, device):
            head += nh
            if header is None:
                continue
            payload += header.bucket_bytes
            n_b, n_t = n_b + 1, n_t + len(got)
            if error:
                continue
            if digest(got) != header.digest:
                error = (
                    f"{where}bucket {header.index} ({len(got)} tensors, first {header.tensors[0].name}): "
                    f"digest {digest(got)} != sent {header.digest}; {where}buckets 0..{header.index - 1} "
                    "were loaded, nothing after"
                )
                continue
            load([(s.name, t) for s, t in zip(header.tensors, got, strict=True)])
            del got
    return PushReport(n_b, n_t, payload, head, payload, time.perf_counter() - t0, error)


def _stream(pg: Any, device: Any) -> Iterator[tuple[list[Any], BucketHeader | None, int]]:
    """One sender's buckets as they arrive: (tensors, header, header bytes); the closing header
    comes as (``[]``, None, its bytes)."""
    import torch

    while True:
        header, nh = _recv_header(pg, device)
        if header.end:
            yield [], None, nh
            return
        got = []
        for s in header.tensors:
            t = torch.empty(s.shape, dtype=getattr(torch, s.dtype), device=device)
            _broadcast(pg, t)
            got.append(t)
        yield got, header, nh


def keeping(load: Callable[[list[tuple[str, Any]]], Any], directory: str) -> Callable[[list[Any]], Any]:
    """``load``, with each bucket also written to ``directory`` (one safetensors file per bucket,
    on the host; the files of an earlier push are removed first): the copy a layout started later
    loads (``read_kept``; ``engines/layout_push.py``). A bucket that cannot be written (a full
    disk) removes the copy and stops keeping, but never stops the push: the engine still loads
    every bucket, and a layout started later fails naming the missing copy."""
    from safetensors.torch import save_file

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)

    def drop() -> None:
        for old in (*root.glob("bucket-*.safetensors"), *root.glob("bucket-*.tmp")):
            old.unlink(missing_ok=True)

    drop()
    count = [0]  # buckets written; -1 once keeping failed

    def load_and_keep(bucket: list[tuple[str, Any]]) -> Any:
        if count[0] >= 0:
            tmp = root / f"bucket-{count[0]:05d}.tmp"
            try:
                save_file({n: t.detach().to("cpu").contiguous() for n, t in bucket}, str(tmp))
                tmp.replace(root / f"bucket-{count[0]:05d}.safetensors")
                count[0] += 1
            except OSError as e:
                log.warning("keeping the pushed weights in %s failed (%s): the copy is dropped", root, e)
                drop()
                count[0] = -1
        return load(bucket)

    return load_and_keep


def read_kept(directory: str) -> list[tuple[str, Any]]:
    """The tensors ``keeping`` wrote, in the order they were pushed."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("bucket-*.safetensors"))
    if not files:
        raise EngineError(f"no pushed weights kept in {directory}")
    return [x for f in files for x in load_file(str(f)).items()]


def loads_in_place(device_type: str, quantization: str | None) -> bool:
    """Whether a worker loads each bucket straight into its parameters (``model.load_weights``:
    one copy) rather than through vLLM's layerwise reload. On CUDA an unquantized model keeps its
    parameters in checkpoint layout, so the direct load is exact (as verl and slime load them); on
    CPU vLLM repacks linear weights for its GEMM kernels after loading, and a quantized model's
    are processed too: the reload restores those layouts and re-runs the processing."""
    return device_type == "cuda" and not quantization


def keeps_checkpoint_layout(layer: Any) -> bool:
    """Whether an unquantized model's layer keeps its parameters in checkpoint layout through
    vLLM's post-load processing, so a push can load them in place (one copy) instead of through
    the layerwise reload (which loads into a re-created layer and copies the result back): a layer
    with parameters of its own and no quantization method (norms), or an embedding / LM head,
    whose processing on CPU packs a copy for its GEMM and keeps ``weight`` (it is then processed
    again, ``reprocess``). Linear layers (whose weight the CPU processing replaces by a packed one)
    and attention layers (processed at the reload's end) take the layerwise path."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    if not any(p is not None for p in layer._parameters.values()) or is_deferred_attention_layer(layer):
        return False
    method = getattr(layer, "quant_method", None)
    return method is None or isinstance(method, UnquantizedEmbeddingMethod)


def start_partial_reload(model: Any) -> list[Any]:
    """vLLM's layerwise reload (``initialize_layerwise_reload``) for the layers that need it; the
    others (``keeps_checkpoint_layout``) keep their parameters and original weight loaders, so
    ``model.load_weights`` writes their tensors straight into them. The in-place layers, for
    ``reprocess`` once the push is loaded."""
    from vllm.model_executor.model_loader.reload.layerwise import (
        get_layerwise_info,
        initialize_online_processing,
    )
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

    # as initialize_layerwise_reload does, for the layers that need it only
    model._original_do_torchao_reload = getattr(model, "_do_torchao_reload", False)
    model._do_torchao_reload = False
    in_place: list[Any] = []
    for layer in model.modules():
        if keeps_checkpoint_layout(layer):
            in_place.append(layer)
            continue
        info = get_layerwise_info(layer)
        if info.can_load():
            continue
        info.kernel_tensors = get_layer_params_buffers(layer)
        info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
        restore_layer_on_meta(layer, info)
        initialize_online_processing(layer)
    return in_place


def tied_aliases(model: Any) -> frozenset[str]:
    """The parameter names that are another name of a parameter the model already lists (a tied
    LM head: ``lm_head.weight`` is ``model.embed_tokens.weight``). A push loaded in place skips
    them: vLLM's loader skips a tied alias and refuses a load call that holds it without the
    parameter it is tied to, and the buckets of a push are separate calls."""
    every = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return frozenset(every - {n for n, _ in model.named_parameters()})


def without(names: frozenset[str], load: Callable[[list[tuple[str, Any]]], Any]) -> Callable[..., Any]:
    """``load`` of a bucket without the tensors named in ``names``."""

    def filtered(bucket: list[tuple[str, Any]]) -> Any:
        kept = [(n, t) for n, t in bucket if n not in names]
        return load(kept) if kept else None

    return filtered


def bucket_loader(model: Any, straight: bool) -> Callable[[list[tuple[str, Any]]], Any]:
    """How a worker loads a bucket: ``model.load_weights``; where tensors go straight into the
    live parameters (``straight``: CUDA's in-place load, CPU's norms and embeddings) without a
    tied head's second name, which vLLM's loader refuses in a call that lacks the embedding it is
    tied to (the head and the embedding are in different buckets of any model over a bucket)."""
    load: Callable[[list[tuple[str, Any]]], Any] = model.load_weights
    return without(tied_aliases(model), load) if straight else load


def reprocess(layers: Iterable[Any]) -> None:
    """Re-run the post-load processing of layers loaded in place whose processing derives state
    from their weights (an embedding or LM head's packed GEMM copy on CPU)."""
    for layer in layers:
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)


def worker_rank(parallel_config: Any) -> int:
    """A vLLM worker's rank among all the engine's workers (every DP replica, TP x PP each)."""
    dp = int(getattr(parallel_config, "data_parallel_index", 0) or 0)
    return dp * int(parallel_config.world_size) + int(parallel_config.rank)


def check_report(report: PushReport, what: str) -> PushReport:
    if report.error:
        raise EngineError(
            f"{what}: {report.error}. The engine now holds a mix of old and new weights: reload them from "
            "the checkpoint (train.weight_sync: object_store path) before it samples again"
        )
    return report


def vllm_engine_class() -> type:
    """The ``WeightTransferEngine`` registered as ``rollpacker`` (imports vLLM)."""
    from dataclasses import dataclass as vdataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )

    @vdataclass
    class InitInfo(WeightTransferInitInfo):
        group: str  # core.weight_sync.TransferGroup as JSON

    @vdataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        policy_version: int
        keep_dir: str = ""  # the engine's first worker also writes the push there (``keeping``)

    class CollectiveWeightEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.pg: Any = None
            self.report: PushReport | None = None
            self.in_place = False
            self.in_place_layers: list[Any] = []  # loaded straight into their parameters (CPU)

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            group = TransferGroup.from_json(init_info.group, where="weight transfer group")
            self.pg = open_group(group, group.rank_offset + worker_rank(self.parallel_config))
            self.report = None

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.in_place = loads_in_place(self.device.type, self.model_config.quantization)
            self.in_place_layers = []
            if self.in_place:
                return
            if self.model_config.quantization:
                initialize_layerwise_reload(self.model)
            else:  # norms and embeddings in place, the rest (repacked GEMM weights) layerwise
                self.in_place_layers = start_partial_reload(self.model)

        def receive_weights(self, update_info: UpdateInfo) -> None:
            if self.pg is None:
                raise EngineError("weight push before init_weight_transfer_engine")
            model: Any = self.model
            load = bucket_loader(model, self.in_place or bool(self.in_place_layers))
            if update_info.keep_dir and int(self.parallel_config.rank) == 0:
                load = keeping(load, update_info.keep_dir)
            self.report = receive(self.pg, self.device, load)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if not self.in_place:
                finalize_layerwise_reload(self.model, self.model_config)  # type: ignore[no-untyped-call]
                reprocess(self.in_place_layers)
                self.in_place_layers = []

        def shutdown(self) -> None:
            self.pg = None

    return CollectiveWeightEngine


def register() -> None:
    """Register the ``rollpacker`` backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, vllm_engine_class())
