"""The weight push, both ways, side by side on the same engine
(``python -m rollpacker.lab.bench.weight_push --out push.json``).

For each model (the ``micro`` tiny preset, and a model of Qwen2.5-0.5B's width with random
weights built from its config, nothing downloaded: by default half its depth, 12 layers, and a 32k
vocabulary, 0.21B parameters, 0.83 GB in fp32, because the object-store path holds about six copies
of the weights at once and this 24 GiB machine is shared; ``--layers 24 --vocab 151936`` is the
full shape) one in-process vLLM engine serves it and a plain
Hugging Face model holds the "trainer's" weights (fp32, CPU). Each path pushes the same weights
``repeats`` times:

- ``object_store``: what the trainer service does today, step by step: ``clone`` of every weight
  (``TrainerService._update``), through Ray's object store (``ray.put`` / ``ray.get``: the Ray call
  to the rollout service), and the engine's ``load_weights`` (a copy, then vLLM's in-place reload);
- ``collective``: ``engines/weight_transfer.py``: the trainer broadcasts bucket by bucket over a
  gloo group to the engine's worker, which loads each bucket as it arrives; a tied head is not
  sent (``weights(tied_head=False)``: the engine serves it from the embedding).

Figures per push (the median of the repeats): ``sync/weights_s`` (wall seconds from the first
byte leaving to the engine serving the new weights), ``bytes_moved`` (through the object store:
put + get; by the collective: the tensors and headers over the group), and ``copies``: the bytes
the push writes into new or existing tensors on either side, counted by a ``TorchDispatchMode``
around each side (``copy_``, ``clone``, ``_to_copy``, ``cat``, ``stack``; not into meta tensors,
which hold no bytes: vLLM's layerwise reload dry-runs each weight loader on them), plus the bytes Ray
serializes and deserializes, plus the bytes a worker receives into fresh buffers, divided by the
model's bytes. After every push the engine's parameters must equal those the first push loaded
(same weights in, same engine state out), else the run stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

COPY_OPS = ("copy_", "clone", "_to_copy", "cat", "stack")

QWEN25_05B = {  # Qwen/Qwen2.5-0.5B's config.json (shapes only)
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


class CopyCounter:
    """Bytes written by copy-like aten ops in the threads that enter it."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                out = func(*args, **(kwargs or {}))
                if func.overloadpacket.__name__ in COPY_OPS:
                    t = args[0] if func.overloadpacket.__name__ == "copy_" else out
                    # vLLM's layerwise reload runs each weight loader once on meta tensors to
                    # count the elements it loads: nothing is written there
                    n = 0 if getattr(t, "is_meta", False) else getattr(t, "nbytes", 0)
                    with counter._lock:
                        counter.bytes += int(n)
                return out

        return _Mode()


def build_05b(out: Path, layers: int, vocab: int) -> Path:
    """A model of Qwen2.5-0.5B's width (``layers`` deep, ``vocab`` tokens) with random weights and
    the micro preset's tokenizer."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rollpacker.tasks.tiny_model import build_tiny_model

    if (out / "config.json").is_file():
        return out
    tok_dir = build_tiny_model("micro")
    shape = {**QWEN25_05B, "num_hidden_layers": layers, "vocab_size": vocab}
    cfg = Qwen2Config(**{k: v for k, v in shape.items() if k != "architectures"})
    cfg.pad_token_id = cfg.eos_token_id = cfg.bos_token_id = 0
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tok_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy2(f, out / f.name)
    return out


def _engine_params(engine: Any) -> dict[str, Any]:
    got = engine._engine.collective_rpc(
        lambda w: {n: p.detach().clone() for n, p in w.model_runner.model.named_parameters()}
    )
    return dict(got[0])


def _object_store_push(engine: Any, source: Any, counter: CopyCounter) -> dict[str, float]:
    import ray

    t0 = time.perf_counter()
    with counter.mode():
        weights = {n: t.detach().clone() for n, t in source}  # TrainerService._update
        ref = ray.put(weights)  # the Ray call to the rollout service: into the object store ...
        got = ray.get(ref)  # ... and out of it in the rollout service's process
        engine.load_weights(got.items())
    dt = time.perf_counter() - t0
    size = sum(t.numel() * t.element_size() for t in weights.values())
    del weights, got, ref
    return {"seconds": dt, "bytes_moved": 2.0 * size, "serialized_bytes": 2.0 * size}


def _collective_push(
    engine: Any, pg: Any, source: Any, counter: CopyCounter, bucket_mb: float
) -> dict[str, float]:
    import torch

    from rollpacker.engines import weight_transfer as wt

    out: dict[str, Any] = {}

    def receive() -> None:
        with counter.mode():
            out["r"] = engine.receive_weights(0)

    t0 = time.perf_counter()
    th = threading.Thread(target=receive)
    th.start()
    with counter.mode():
        sent = wt.send(pg, source, int(bucket_mb * 2**20), torch.device("cpu"))
    th.join()
    dt = time.perf_counter() - t0
    (recv,) = out["r"]
    return {
        "seconds": dt,
        "bytes_moved": float(sent.payload_bytes + sent.header_bytes),
        "received_into_new_buffers": float(recv.copied_bytes),
        "buckets": float(sent.buckets),
    }


def bench_model(name: str, model_dir: Path, repeats: int, bucket_mb: float) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from rollpacker.core.config import EngineConfig
    from rollpacker.core.weight_sync import TransferGroup
    from rollpacker.engines import weight_transfer as wt
    from rollpacker.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(
        EngineConfig(model_dir=str(model_dir), max_num_seqs=4, max_model_len=256, kv_cache_gib=1)
    )
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        tied = bool(model.config.tie_word_embeddings)

        def source(tied_head: bool = True) -> list[tuple[str, Any]]:  # TorchTrainer.weights(tied_head)
            named = [(n, p) for n, p in model.named_parameters()]
            if tied and tied_head:
                named.append(("lm_head.weight", model.get_output_embeddings().weight))
            return named

        model_bytes = sum(t.numel() * t.element_size() for _, t in source())
        group = TransferGroup("127.0.0.1", wt.free_port("127.0.0.1"), 2, 1, "gloo", 600.0)
        th = threading.Thread(target=engine.init_weight_transfer, args=(group,))
        th.start()
        pg = wt.open_group(group, 0)
        th.join()
        engine.load_weights(source())
        want = _engine_params(engine)
        rows: dict[str, list[dict[str, float]]] = {"object_store": [], "collective": []}
        for _ in range(repeats):
            for path in ("object_store", "collective"):
                counter = CopyCounter()
                if path == "object_store":
                    r = _object_store_push(engine, source(), counter)
                    extra = r.pop("serialized_bytes")
                else:
                    r = _collective_push(engine, pg, source(tied_head=False), counter, bucket_mb)
                    extra = r.pop("received_into_new_buffers")
                r["copies"] = (counter.bytes + extra) / model_bytes
                rows[path].append(r)
                got = _engine_params(engine)
                if any(not torch.equal(got[n], t) for n, t in want.items()):
                    raise SystemExit(f"{name} {path}: the engine's parameters differ after the push")
        out: dict[str, Any] = {"model": name, "params": sum(p.numel() for p in model.parameters())}
        out["model_bytes"] = model_bytes
        for path, rs in rows.items():
            out[path] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        return out
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    import os

    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="weight_push.json")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--models", default="micro,qwen2.5-0.5b-width")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--workdir", default="/tmp/rollpacker-bench-weight-push")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(  # a head of its own ("local"), never a cluster `ray start` left on this machine
        address="local",
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=6 * 2**30,
    )
    results = []
    try:
        for name in a.models.split(","):
            if name == "micro":
                from rollpacker.tasks.tiny_model import build_tiny_model

                model_dir = build_tiny_model("micro")
            else:
                model_dir = build_05b(Path(a.workdir) / f"{name}-l{a.layers}-v{a.vocab}", a.layers, a.vocab)
            results.append(bench_model(name, model_dir, a.repeats, a.bucket_mb))
            print(json.dumps(results[-1]), flush=True)
    finally:
        ray.shutdown()
    Path(a.out).write_text(
        json.dumps({"bucket_mb": a.bucket_mb, "repeats": a.repeats, "results": results}, indent=1)
    )


if __name__ == "__main__":
    main()
