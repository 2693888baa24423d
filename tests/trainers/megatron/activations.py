"""Activation memory of one megatron rank, measured: the bytes autograd keeps for backward.

``python -m tests.trainers.megatron.activations MODEL_DIR`` builds one ``RankWorker`` (TP=1, gloo,
this process: the CPU shim patches the process, so the tests run it in a subprocess) per
``train.megatron.recompute`` mode and dtype, runs the backend's own forward step and loss on one
sequence of each length under ``torch.autograd.graph.saved_tensors_hooks``, and prints JSON: per
mode, the bytes saved for backward at each length. Saved tensors are counted once per storage;
parameters (weights, not activations) and the causal mask the backend passes in (an input, ``s^2``
bytes per micro-batch however many layers) are left out. This is what a rank holds between a
micro-batch's forward and its backward; recompute adds one layer's transient on top in backward.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import torch

LENGTHS = (64, 128, 256)
MODES = tuple((r, d) for d in ("float32", "bfloat16") for r in ("none", "selective", "full", "sdpa"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sample(length: int, prompt: int = 8) -> Any:
    from rollpacker.core.advantages import TrainSample

    g = torch.Generator().manual_seed(length)
    ids = torch.randint(1, 60, (length,), generator=g).tolist()
    return TrainSample(
        sample_id="s",
        prompt_id="p",
        prompt_ids=tuple(ids[:prompt]),
        response_ids=tuple(ids[prompt:]),
        behaviour_logprobs=tuple([-1.0] * (length - prompt)),
        advantage=1.0,
        reward=1.0,
    )


def saved_bytes(worker: Any, length: int) -> int:
    """Bytes saved for backward by the forward step and the loss on one sequence of ``length``."""
    params = {p.untyped_storage().data_ptr() for p in worker.model.parameters()}
    params |= {p.main_grad.untyped_storage().data_ptr() for p in worker.model.parameters()}
    seen: dict[int, int] = {}
    inputs: set[int] = set()
    masks: list[torch.Tensor] = []  # held: a freed mask's address, reused by an activation, would drop it
    real_triu = torch.triu

    def triu(*a: Any, **k: Any) -> torch.Tensor:  # the causal mask the forward step builds
        t = real_triu(*a, **k)
        inputs.add(t.untyped_storage().data_ptr())
        masks.append(t)
        return t

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    step = worker._forward_step(torch.device("cpu"))
    torch.triu = triu
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, loss_fn = step(iter([[_sample(length)]]), worker.model)
            loss, _, _ = loss_fn(out)
    finally:
        torch.triu = real_triu
    loss.backward()  # the graph is freed; the counts above are what it held
    worker.reset_accum()
    return sum(n for ptr, n in seen.items() if ptr not in inputs)


def measure(model_dir: str, lengths: tuple[int, ...] = LENGTHS) -> dict[str, dict[int, int]]:
    from megatron.core import parallel_state as ps

    from rollpacker.core.config import TrainerConfig
    from rollpacker.trainers.megatron.source import StoreSource
    from rollpacker.trainers.megatron.worker import RankSpec, RankWorker

    out: dict[str, dict[int, int]] = {}
    for recompute, dtype in MODES:
        spec = RankSpec(
            model=StoreSource.local(model_dir),
            train=TrainerConfig(tokens_per_micro_batch=max(lengths)),
            tp=1,
            pp=1,
            dp=1,
            temperature=1.0,
            master_addr="127.0.0.1",
            master_port=_free_port(),
            optimizer="sgd",
            distributed_optimizer=False,
            dtype=dtype,
            recompute="none" if recompute == "sdpa" else recompute,
            attention="sdpa" if recompute == "sdpa" else "unfused",
        )
        worker = RankWorker(spec, 0)
        worker.model.train()
        try:
            out[f"{recompute}/{dtype}"] = {n: saved_bytes(worker, n) for n in lengths}
        finally:
            ps.destroy_model_parallel()
            worker.close()
    return out


if __name__ == "__main__":
    model = sys.argv[1]
    result = measure(model, tuple(int(x) for x in sys.argv[2:]) or LENGTHS)
    print(json.dumps({"model": str(Path(model)), "saved_bytes": result}))
