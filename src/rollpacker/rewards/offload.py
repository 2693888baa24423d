"""Layer-wise pipelined offload of a HF decoder LM (Qwen2): the colocated judge's memory saver.

RollPacker (§4.3) colocates the judge LLM with the actor and keeps most of the judge's layers in
host memory, streaming their weights to the device layer by layer in step with the computation.
``OffloadedCausalLM`` does this for a ``Qwen2ForCausalLM`` (any HF model whose decoder layers are
``model.model.layers`` and whose weights are named ``model.layers.<i>.*``):

- the embeddings, final norm and head (``fixed``) and the first ``k`` decoder layers stay
  resident on the compute device;
- every layer's weights also live in a **host store**: on CUDA, pinned host tensors; on CPU the
  model's safetensors file **memory-mapped** (file-backed pages, not the process's anonymous
  memory), so "device" (the compute set) and "host" are distinct on a CPU too;
- layers ``k..L-1`` are replaced by stand-ins that, when the HF forward reaches them, run one of
  ``n_buffers`` reusable **layer buffers** (decoder layers of the same shape) after its weights
  were copied in from the host store. ``PIPELINED``: the copy of offloaded layer ``j`` into buffer
  ``(j - k) % n_buffers`` is issued as soon as that buffer's previous layer has been computed, so
  with two buffers the copy of layer ``i + 1`` overlaps the compute of layer ``i`` (CUDA: a side
  ``torch.cuda.Stream`` with events and pinned host memory; CPU: one copy thread). ``NAIVE``:
  copy, then compute, one layer after another on the compute stream / thread.

The HF forward itself (masks, rotary embeddings, the layers' code) is unchanged: the stand-ins
only decide which module holds the weights, so the offloaded logits equal the resident model's.

Invariants:
- numerics: for any ``k`` and mode, the logits equal those of the resident model loaded from the
  same directory (same ops on the same values; the tests check ``<= 1e-5``, observed 0.0);
- a buffer is overwritten only after the compute of the layer it held has finished, and a layer
  is computed only after its copy has finished (CPU: futures; CUDA: events on both streams);
- device-resident weight bytes (the compute set: fixed + resident layers + buffers, measured by
  walking its tensors at every layer boundary) are ``fixed + (k + min(n_buffers, L - k)) *
  layer_bytes``; the offloaded layers' own modules are dropped, so nothing else holds them;
- one forward at a time (not thread-safe); ``set_resident_layers`` between forwards moves layers
  between the resident set and the host store; ``close()`` is idempotent and joins the copy thread.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import json
import mmap
import os
import re
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollpacker.core.errors import ConfigError
from rollpacker.core.judge_plan import choose_resident_layers, resident_weight_bytes, stream_buffers
from rollpacker.tasks.tiny_model import TinyModelSpec, build_tiny_model

if TYPE_CHECKING:
    import torch

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


class OffloadMode(enum.Enum):
    PIPELINED = "pipelined"  # copy of layer i+1 overlaps compute of layer i
    NAIVE = "naive"  # copy, then compute, layer after layer


@dataclass(frozen=True)
class OffloadStats:
    """Counters since the last ``reset_stats`` (times are CPU-side wall seconds)."""

    forwards: int
    layers_streamed: int
    peak_resident_weight_bytes: int  # measured: the compute set's weight bytes, sampled per layer
    copy_s: float  # time spent copying weights into buffers (copy thread, or inline in NAIVE)
    wait_s: float  # time the compute thread waited for a copy to finish (PIPELINED)
    peak_cuda_allocated_bytes: int | None  # torch.cuda.max_memory_allocated on CUDA, else None


# --- host store -----------------------------------------------------------------------------------


def _mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a memory-mapped safetensors file (private, copy-on-write mapping)."""
    import torch

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + n
    out: dict[str, torch.Tensor] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta["dtype"] not in _DTYPES:
            raise ConfigError(
                f"{path}: tensor {name!r} has dtype {meta['dtype']}; the offload supports {_DTYPES}"
            )
        dtype = getattr(torch, _DTYPES[meta["dtype"]])
        begin, end = meta["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        shape = tuple(meta["shape"])
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        out[name] = torch.frombuffer(mm, dtype=dtype, count=count, offset=base + begin).view(shape)
    return out


class HostLayerStore:
    """Every decoder layer's weights in host memory, by layer index and name within the layer.

    ``pin=False``: views of the memory-mapped safetensors files (nothing is copied; pages are read
    from the page cache when a layer is streamed). ``pin=True``: page-locked copies in ``dtype``
    (the device's), so CUDA copies can be asynchronous. ``others`` holds the remaining tensors
    (embeddings, norm, head) as views of the mapped files: they are copied once into the resident
    model.
    """

    def __init__(self, model_dir: Path, num_layers: int, pin: bool = False, dtype: str = "float32") -> None:
        import torch

        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ConfigError(
                f"{model_dir}: no *.safetensors file; save the judge with safe_serialization=True"
            )
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
        self.others: dict[str, torch.Tensor] = {}
        for f in files:
            for name, t in _mmap_safetensors(f).items():
                m = _LAYER_KEY.match(name)
                if m is None or int(m.group(1)) >= num_layers:
                    self.others[name] = t
                    continue
                if pin:  # in the device's dtype: the asynchronous copy is then a plain copy
                    t = torch.empty(t.shape, dtype=_torch_dtype(dtype), pin_memory=True).copy_(t)
                self.layers[int(m.group(1))][m.group(2)] = t
        missing = [i for i, d in enumerate(self.layers) if not d]
        if missing:
            raise ConfigError(
                f"{model_dir}: no weights for decoder layers {missing}; is it a Qwen2-style model?"
            )

    def layer_bytes(self, index: int) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers[index].values())


# --- the stand-in for an offloaded layer ----------------------------------------------------------


def _streamed_layer_class() -> type:
    import torch

    class StreamedLayer(torch.nn.Module):
        """Holds no weights: runs the buffer that the runner has loaded with layer ``index``."""

        _runner: OffloadedCausalLM

        def __init__(self, runner: OffloadedCausalLM, index: int, attention_type: str | None) -> None:
            super().__init__()
            object.__setattr__(self, "_runner", runner)  # not a submodule: its tensors are not ours
            self.layer_index = index
            if attention_type is not None:
                self.attention_type = attention_type

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            layer = self._runner._enter(self.layer_index)
            out = layer(*args, **kwargs)
            self._runner._exit(self.layer_index)
            return out

    return StreamedLayer


# --- the runner ------------------------------------------------------------------------------------


def _compute_device(device: str) -> torch.device:
    """``device`` as a torch device; a ``ConfigError`` unless it is the CPU or an available GPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available here; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {device!r}: the offload runs on 'cpu' or 'cuda'")
    return dev


def _torch_dtype(name: str) -> torch.dtype:
    """``torch.float32`` for ``"float32"`` (the judge's dtypes: float32, bfloat16, float16)."""
    import torch

    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"judge dtype {name!r}: use float32, bfloat16 or float16")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def _meta_model(config: Any, dtype: str = "float32") -> Any:
    """The model built on the meta device, in eval mode without grads: the offloaded layers never
    get memory of their own, the resident part is copied from the memory-mapped file into the
    compute device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    model.eval()
    model.requires_grad_(False)
    return model


class OffloadedCausalLM:
    """A HF causal LM whose layers ``k..L-1`` are streamed from host memory (see the module docstring).

    ``model`` is the wrapped ``Qwen2ForCausalLM``: call it (or ``model.model``) as usual.
    """

    def __init__(
        self,
        model_dir: Path | str,
        resident_layers: int,
        *,
        n_buffers: int = 2,
        mode: OffloadMode = OffloadMode.PIPELINED,
        device: str = "cpu",
        track_memory: bool = True,
        dtype: str = "float32",
    ) -> None:
        import torch

        if n_buffers < 1:
            raise ConfigError(f"n_buffers = {n_buffers}: must be >= 1 (2 for double buffering)")
        self.device = _compute_device(device)
        self.model_dir = Path(model_dir)
        self.mode = mode
        self.n_buffers = n_buffers
        self.track_memory = track_memory
        self._cuda = self.device.type == "cuda"
        config = self._read_config(resident_layers)
        self.host = HostLayerStore(self.model_dir, self.num_layers, pin=self._cuda, dtype=dtype)
        model = _meta_model(config, dtype)
        layers = model.model.layers
        self._adopt_layers(layers)
        # one layer's bytes on the device, in the model's dtype (the file's may differ)
        self.layer_bytes = sum(t.numel() * t.element_size() for t in self._skeleton.state_dict().values())
        self.resident_layers = resident_layers
        for j in range(resident_layers, self.num_layers):
            layers[j] = self._standins[j]  # offloaded: a stand-in, no weights
        with torch.inference_mode(False):
            model.to_empty(device=self.device)
            self._load_fixed_and_resident(model)
        self.model = model
        self.fixed_bytes = sum(
            p.numel() * p.element_size() for n, p in self.model.named_parameters() if ".layers." not in n
        )
        self._init_streaming()

    # -- construction helpers --------------------------------------------------------------------

    def _read_config(self, resident_layers: int) -> Any:
        """The model directory's HF config; sets ``num_layers`` and checks ``resident_layers``."""
        from transformers import AutoConfig

        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(f"{self.model_dir}: no config.json; pass a HF model directory")
        config = AutoConfig.from_pretrained(str(self.model_dir))
        self.num_layers = int(config.num_hidden_layers)
        if not 0 <= resident_layers <= self.num_layers:
            raise ConfigError(f"resident_layers = {resident_layers}: must be in [0, {self.num_layers}]")
        return config

    def _adopt_layers(self, layers: Any) -> None:
        """Record each layer's attributes and a shape-only skeleton, check the host store holds
        every layer's weights under the model's names, and make the stand-ins."""
        # per-layer attributes a shared buffer must take on (sliding window layers differ)
        self._layer_attrs = [
            {"layer_idx": j, "sliding_window": getattr(layers[j].self_attn, "sliding_window", None)}
            for j in range(self.num_layers)
        ]
        self._skeleton = copy.deepcopy(layers[0])  # on meta: shape only; buffers are made from it
        want = set(self._skeleton.state_dict())
        for j in range(self.num_layers):
            if set(self.host.layers[j]) != want:
                raise ConfigError(
                    f"{self.model_dir}: layer {j}'s weights in the safetensors file "
                    f"({sorted(self.host.layers[j])}) do not match the model's ({sorted(want)})"
                )
        streamed = _streamed_layer_class()
        self._standins = [
            streamed(self, j, getattr(layers[j], "attention_type", None)) for j in range(self.num_layers)
        ]

    def _init_streaming(self) -> None:
        """The layer buffers, the copy machinery (thread or CUDA stream and events), the forward
        hooks and the counters."""
        import torch

        self._slots: list[torch.nn.Module] = []
        self._resize_slots()
        self._executor: ThreadPoolExecutor | None = None
        self._copy_futs: dict[int, Future[float]] = {}
        if self._cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
        self._copied: list[Any] = []
        self._computed: list[Any] = []
        self._computed_live: list[bool] = []
        self._make_events()
        self.model.model.register_forward_pre_hook(lambda mod, args: self._begin())
        self.model.model.register_forward_hook(lambda mod, args, out: self._end())
        self._closed = False
        self._forwards = self._streamed = self._peak_bytes = 0
        self._copy_s = self._wait_s = 0.0
        self.reset_stats()

    def _load_fixed_and_resident(self, model: Any) -> None:
        """Fill the resident part of a ``to_empty`` model from the host store; rebuild its rotary buffers."""
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        for name, dst in model.state_dict(keep_vars=True).items():
            m = _LAYER_KEY.match(name)
            if m is not None:
                src = self.host.layers[int(m.group(1))][m.group(2)]
            elif name in self.host.others:
                src = self.host.others[name]
            elif name == "lm_head.weight" and tied:
                continue  # the same tensor as the embeddings
            else:
                raise ConfigError(f"{self.model_dir}: no weights for {name!r} in the safetensors file(s)")
            dst.data.copy_(src)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        rotary = model.model.rotary_emb  # non-persistent buffers: computed as from_pretrained does
        model.model.rotary_emb = type(rotary)(config=model.config).to(self.device)

    @classmethod
    def from_budget(
        cls,
        model_dir: Path | str,
        budget_bytes: int,
        seq_len: int,
        batch: int,
        *,
        kv_bytes_per_token: int | None = None,
        n_buffers: int = 2,
        mode: OffloadMode = OffloadMode.PIPELINED,
        device: str = "cpu",
    ) -> OffloadedCausalLM:
        """An offloaded model with ``k`` chosen by ``choose_resident_layers`` for this budget and shape."""
        runner = cls(model_dir, 0, n_buffers=n_buffers, mode=mode, device=device)
        runner.set_resident_layers(runner.plan(budget_bytes, seq_len, batch, kv_bytes_per_token))
        return runner

    def kv_bytes_per_token(self) -> int:
        """An estimate of one token's live activation bytes inside one decoder layer (no grad)."""
        c = self.model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_dim = c.num_key_value_heads * head_dim
        return 4 * (4 * c.hidden_size + 2 * kv_dim + 3 * c.intermediate_size + 2 * head_dim)

    def plan(self, budget_bytes: int, seq_len: int, batch: int, kv_bytes_per_token: int | None = None) -> int:
        """``choose_resident_layers`` for this model's measured sizes."""
        return choose_resident_layers(
            budget_bytes,
            self.layer_bytes,
            self.fixed_bytes,
            self.kv_bytes_per_token() if kv_bytes_per_token is None else kv_bytes_per_token,
            seq_len,
            batch,
            self.n_buffers,
            num_layers=self.num_layers,
        )

    def expected_weight_bytes(self, resident_layers: int | None = None) -> int:
        k = self.resident_layers if resident_layers is None else resident_layers
        return resident_weight_bytes(k, self.num_layers, self.layer_bytes, self.fixed_bytes, self.n_buffers)

    def _new_layer(self) -> torch.nn.Module:
        import torch

        with torch.inference_mode(False):
            layer = copy.deepcopy(self._skeleton).to_empty(device=self.device)
            layer.eval()
            layer.requires_grad_(False)
        return layer

    def _resize_slots(self) -> None:
        want = stream_buffers(self.resident_layers, self.num_layers, self.n_buffers)
        while len(self._slots) > want:
            self._slots.pop()
        while len(self._slots) < want:
            self._slots.append(self._new_layer())

    def _make_events(self) -> None:
        import torch

        if not self._cuda:
            return
        n = len(self._slots)
        self._copied = [torch.cuda.Event() for _ in range(n)]
        self._computed = [torch.cuda.Event() for _ in range(n)]
        self._computed_live = [False] * n

    def set_resident_layers(self, resident_layers: int) -> None:
        """Make layers ``0..k-1`` resident and stream the rest (between forwards)."""
        import torch

        if not 0 <= resident_layers <= self.num_layers:
            raise ConfigError(f"resident_layers = {resident_layers}: must be in [0, {self.num_layers}]")
        if resident_layers == self.resident_layers:
            return
        self._drain()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        layers = self.model.model.layers
        for j in range(self.num_layers):
            was, now = j < self.resident_layers, j < resident_layers
            if now and not was:
                layer = self._new_layer()
                self._load(layer, j, non_blocking=False)
                layers[j] = layer
            elif was and not now:
                layers[j] = self._standins[j]
        self.resident_layers = resident_layers
        self._resize_slots()
        self._make_events()

    # -- the per-layer protocol (called by the HF forward through the hooks and stand-ins) --------

    def _slot_index(self, j: int) -> int:
        return (j - self.resident_layers) % len(self._slots)

    def _load(self, layer: torch.nn.Module, j: int, non_blocking: bool) -> None:
        """Copy layer ``j``'s weights from the host store into ``layer``'s tensors."""
        src = self.host.layers[j]
        for name, dst in layer.state_dict(keep_vars=True).items():
            dst.data.copy_(src[name], non_blocking=non_blocking)
        for attr, value in self._layer_attrs[j].items():
            if hasattr(layer.self_attn, attr):
                setattr(layer.self_attn, attr, value)

    def _copy_layer(self, j: int, slot: int) -> float:
        """Copy layer ``j`` into buffer ``slot``; returns the seconds it took (CPU side)."""
        t0 = time.perf_counter()
        self._load(self._slots[slot], j, non_blocking=self._cuda)
        return time.perf_counter() - t0

    def _issue_copy(self, j: int) -> None:
        """PIPELINED: start copying layer ``j`` into its buffer, which must be free by now."""
        import torch

        s = self._slot_index(j)
        if self._cuda:
            with torch.cuda.stream(self._copy_stream):
                if self._computed_live[s]:
                    self._copy_stream.wait_event(self._computed[s])
                self._copy_s += self._copy_layer(j, s)
                self._copied[s].record(self._copy_stream)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="judge-offload-copy")
        self._copy_futs[j] = self._executor.submit(self._copy_layer, j, s)

    def _wait_copied(self, j: int) -> None:
        import torch

        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(self._copied[self._slot_index(j)])
            return
        t0 = time.perf_counter()
        fut = self._copy_futs.pop(j, None)
        if fut is None:
            raise RuntimeError(f"offload: layer {j} was never scheduled for copying (internal error)")
        self._copy_s += fut.result()
        self._wait_s += time.perf_counter() - t0

    def _drain(self) -> None:
        """Wait for copies still in flight (after a failed forward), ignoring their errors."""
        futs, self._copy_futs = list(self._copy_futs.values()), {}
        for f in futs:
            with contextlib.suppress(Exception):  # the forward that scheduled it already failed
                f.result()

    def _begin(self) -> None:
        if self._closed:
            raise RuntimeError("OffloadedCausalLM is closed; load a new one to score more")
        self._drain()
        self._forwards += 1
        if self.mode is OffloadMode.PIPELINED and self._slots:
            first = self.resident_layers
            for j in range(first, min(self.num_layers, first + len(self._slots))):
                self._issue_copy(j)
        self._sample_memory()

    def _enter(self, j: int) -> torch.nn.Module:
        s = self._slot_index(j)
        if self.mode is OffloadMode.PIPELINED:
            self._wait_copied(j)
        else:  # NAIVE: copy now (on CUDA: queued on the compute stream, so before the compute)
            self._copy_s += self._copy_layer(j, s)
        self._streamed += 1
        layer = self._slots[s]
        for attr, value in self._layer_attrs[j].items():
            if hasattr(layer.self_attn, attr):
                setattr(layer.self_attn, attr, value)
        self._sample_memory()
        return layer

    def _exit(self, j: int) -> None:
        import torch

        if self.mode is not OffloadMode.PIPELINED:
            return
        if self._cuda:
            s = self._slot_index(j)
            self._computed[s].record(torch.cuda.current_stream(self.device))
            self._computed_live[s] = True
        nxt = j + len(self._slots)
        if nxt < self.num_layers:
            self._issue_copy(nxt)

    def _end(self) -> None:
        self._sample_memory()

    # -- measurement -------------------------------------------------------------------------------

    def _compute_set(self) -> Iterator[torch.Tensor]:
        yield from self.model.parameters()
        for slot in self._slots:
            yield from slot.parameters()

    def device_weight_bytes(self) -> int:
        """Bytes of the distinct weight storages the compute set holds on the compute device now."""
        seen: dict[int, int] = {}
        for t in self._compute_set():
            if t.device.type != self.device.type:
                continue
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def _sample_memory(self) -> None:
        if self.track_memory:
            self._peak_bytes = max(self._peak_bytes, self.device_weight_bytes())

    def reset_stats(self) -> None:
        import torch

        self._forwards = 0
        self._streamed = 0
        self._copy_s = 0.0
        self._wait_s = 0.0
        self._peak_bytes = self.device_weight_bytes() if self.track_memory else 0
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def stats(self) -> OffloadStats:
        import torch

        return OffloadStats(
            forwards=self._forwards,
            layers_streamed=self._streamed,
            peak_resident_weight_bytes=self._peak_bytes,
            copy_s=self._copy_s,
            wait_s=self._wait_s,
            peak_cuda_allocated_bytes=int(torch.cuda.max_memory_allocated(self.device))
            if self._cuda
            else None,
        )

    def close(self) -> None:
        """Wait for copies in flight, stop the copy thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def __enter__(self) -> OffloadedCausalLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_resident(model_dir: Path | str, device: str = "cpu", dtype: str = "float32") -> Any:
    """The plain (non-offloaded) model from ``model_dir``: the reference the offload must equal."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=_torch_dtype(dtype))
    model.eval()
    model.requires_grad_(False)
    return model.to(device)


def all_weight_bytes(model: Any) -> int:
    """Bytes of a plain model's distinct weight storages (the resident judge's weight memory)."""
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(seen.values())


# --- micro-benchmark -------------------------------------------------------------------------------

BENCH_SPEC = TinyModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536)


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _rss_probe(args: dict[str, Any]) -> dict[str, int]:
    """In a fresh process: the anonymous RSS that building the judge and one forward add.

    The resident judge is built by the same loader with every layer resident, so the figures
    differ only by what is resident. Prints JSON; used by ``bench_offload(measure_rss=True)``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    ids = torch.randint(3, 200, (args["batch"], args["seq_len"]))
    with torch.device("meta"):  # import the modeling code before the baseline: it is not the judge
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args["model_dir"]))
    base = _rss_anon_bytes()
    k = args["num_layers"] if args["mode"] == "resident" else args["k"]
    mode = OffloadMode.NAIVE if args["mode"] == "naive" else OffloadMode.PIPELINED
    with OffloadedCausalLM(args["model_dir"], k, n_buffers=args["n_buffers"], mode=mode) as runner:
        with torch.no_grad():
            runner.model.model(input_ids=ids, use_cache=False)
        out = {"rss_anon_added_bytes": _rss_anon_bytes() - base}
    print(json.dumps(out))
    return out


def _rss_in_subprocess(**args: Any) -> int:
    code = (
        "import json, sys\nfrom rollpacker.rewards import offload as o\no._rss_probe(json.loads(sys.argv[1]))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(args, default=str)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return int(json.loads(proc.stdout.strip().splitlines()[-1])["rss_anon_added_bytes"])


def bench_offload(
    spec: TinyModelSpec | str = BENCH_SPEC,
    *,
    batch: int = 1,
    seq_len: int = 64,
    resident_layers: int | None = None,
    n_buffers: int = 2,
    repeats: int = 5,
    device: str = "cpu",
    threads: int | None = 1,
    measure_rss: bool = False,
    cache_dir: Path | None = None,
) -> dict[str, Any]:
    """Time one forward of the resident model, NAIVE offload (1 buffer) and PIPELINED offload.

    The three run round-robin (``repeats`` rounds after one warm-up round; the median is
    reported), so a machine whose speed drifts affects them alike. ``threads`` sets torch's
    intra-op threads for the run (CPU; ``None`` keeps the current setting). Returns ``{"config":
    ..., "resident" | "naive" | "pipelined": {"time_s", "peak_resident_weight_bytes",
    "expected_weight_bytes", "max_abs_diff", "copy_s_per_forward", "wait_s_per_forward",
    ["peak_cuda_allocated_bytes"], ["rss_anon_added_bytes"]}}``. ``resident_layers`` defaults to
    a quarter of the layers.
    """
    import torch

    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _bench(
            spec, batch, seq_len, resident_layers, n_buffers, repeats, device, measure_rss, cache_dir
        )
    finally:
        torch.set_num_threads(old_threads)


def _bench(
    spec: TinyModelSpec | str,
    batch: int,
    seq_len: int,
    resident_layers: int | None,
    n_buffers: int,
    repeats: int,
    device: str,
    measure_rss: bool,
    cache_dir: Path | None,
) -> dict[str, Any]:
    import torch

    cuda = device.startswith("cuda")
    model_dir = build_tiny_model(spec, cache_dir=cache_dir)
    resident = load_resident(model_dir, device)
    num_layers = int(resident.config.num_hidden_layers)
    k = num_layers // 4 if resident_layers is None else resident_layers
    ids = torch.randint(3, 200, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    runners = {
        "naive": OffloadedCausalLM(model_dir, k, n_buffers=1, mode=OffloadMode.NAIVE, device=device),
        "pipelined": OffloadedCausalLM(model_dir, k, n_buffers=n_buffers, device=device),
    }
    models: dict[str, Any] = {"resident": resident, **{n: r.model for n, r in runners.items()}}

    def forward(model: Any) -> torch.Tensor:
        return _forward(model, ids, cuda)

    outs, peaks = _warm_up(models, runners, forward)
    times = _time_round_robin(models, forward, repeats)
    report: dict[str, Any] = {
        "config": {
            "model_dir": str(model_dir),
            "num_layers": num_layers,
            "resident_layers": k,
            "n_buffers": n_buffers,
            "batch": batch,
            "seq_len": seq_len,
            "repeats": repeats,
            "device": device,
            "torch_threads": torch.get_num_threads(),
        },
        "resident": {
            "time_s": statistics.median(times["resident"]),
            "peak_resident_weight_bytes": all_weight_bytes(resident),
            "max_abs_diff": 0.0,
        },
    }
    for name, runner in runners.items():
        report[name] = _offload_row(runner, times[name], peaks[name], outs[name] - outs["resident"])
        runner.close()
    del models, runners, resident
    if cuda:  # device memory of each alone: a fresh build, one forward, the allocator's peak
        _cuda_peaks(report, forward, model_dir, k, n_buffers, device)
    if measure_rss:
        _rss_rows(report, model_dir, num_layers, k, n_buffers, batch, seq_len)
    return report


def _rss_rows(
    report: dict[str, Any], model_dir: Path, num_layers: int, k: int, n_buffers: int, batch: int, seq_len: int
) -> None:
    """Add each mode's ``rss_anon_added_bytes``, each measured in a fresh process."""
    for name, buffers in (("resident", n_buffers), ("naive", 1), ("pipelined", n_buffers)):
        report[name]["rss_anon_added_bytes"] = _rss_in_subprocess(
            mode=name,
            model_dir=str(model_dir),
            num_layers=num_layers,
            k=k,
            n_buffers=buffers,
            batch=batch,
            seq_len=seq_len,
        )


def _forward(model: Any, ids: torch.Tensor, cuda: bool) -> torch.Tensor:
    """One forward of the decoder on ``ids`` (waits for the device on CUDA): its last hidden state."""
    import torch

    with torch.no_grad():
        out = model.model(input_ids=ids, use_cache=False).last_hidden_state
    if cuda:
        torch.cuda.synchronize()
    return out


def _warm_up(
    models: dict[str, Any],
    runners: dict[str, OffloadedCausalLM],
    forward: Callable[[Any], torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """One warm-up round: each model's output (CPU, float) and each runner's peak resident weight
    bytes; then memory tracking is switched off (the walk would add to the timings)."""
    outs = {name: forward(m).float().cpu() for name, m in models.items()}
    peaks = {name: r.stats().peak_resident_weight_bytes for name, r in runners.items()}
    for r in runners.values():
        r.track_memory = False  # measured in the warm-up round; the walk would add to the timings
        r.reset_stats()
    return outs, peaks


def _time_round_robin(
    models: dict[str, Any], forward: Callable[[Any], torch.Tensor], repeats: int
) -> dict[str, list[float]]:
    """Seconds of each model's forward, ``repeats`` rounds taking the models in turn."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, m in models.items():
            t0 = time.perf_counter()
            forward(m)
            times[name].append(time.perf_counter() - t0)
    return times


def _offload_row(
    runner: OffloadedCausalLM, times: list[float], peak: int, diff: torch.Tensor
) -> dict[str, Any]:
    """One offload mode's report: ``diff`` is its output minus the resident model's."""
    st = runner.stats()
    return {
        "time_s": statistics.median(times),
        "peak_resident_weight_bytes": peak,
        "expected_weight_bytes": runner.expected_weight_bytes(),
        "layer_bytes": runner.layer_bytes,
        "fixed_bytes": runner.fixed_bytes,
        "max_abs_diff": float(diff.abs().max()),
        "copy_s_per_forward": st.copy_s / max(1, st.forwards),
        "wait_s_per_forward": st.wait_s / max(1, st.forwards),
    }


def _cuda_peaks(
    report: dict[str, Any],
    forward: Callable[[Any], torch.Tensor],
    model_dir: Path,
    k: int,
    n_buffers: int,
    device: str,
) -> None:
    """Add each mode's ``peak_cuda_allocated_bytes``: a fresh build alone, one forward, the
    allocator's peak."""
    import torch

    for name in ("resident", "naive", "pipelined"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        if name == "resident":
            forward(load_resident(model_dir, device))
        else:
            mode = OffloadMode.NAIVE if name == "naive" else OffloadMode.PIPELINED
            buffers = 1 if name == "naive" else n_buffers
            with OffloadedCausalLM(model_dir, k, n_buffers=buffers, mode=mode, device=device) as r:
                forward(r.model)
        report[name]["peak_cuda_allocated_bytes"] = int(torch.cuda.max_memory_allocated())


if __name__ == "__main__":  # pragma: no cover - a convenience: python -m rollpacker.rewards.offload
    print(json.dumps(bench_offload(measure_rss="--rss" in sys.argv), indent=2))
