"""``engine.kind: simulated``: the rollout engine a dry run starts in place of vLLM.

``build_engine(config)`` is the one place the rollout service's engine is made from the config:
``vllm`` starts the real engine (``VLLMEngine``, a minute or more); ``simulated`` starts
``SimulatedEngine`` at once. The simulated engine is ``FakeEngine`` (the deterministic simulator
of ``engines/fake.py``, virtual clock included) sized from the config and the model directory:
its concurrency is ``engine.max_num_seqs``, its TP ``engine.tensor_parallel_size``, its tokens are
ids the model's tokenizer decodes and its EOS the model's. Its samples and logprobs are not the
model's, so everything around it (rewards, the trainer, the store, MLflow, the stages) runs for
real on meaningless text: a dry run of the pipeline, what the interrupt tests
(tests/experiment/test_interrupts.py) need, never a result. The config refuses it where it would
pass for a real run (``ExperimentConfig._check_simulated_engine``).

Contract: the engine port of ``engines/base.py`` (tests/engines/test_engine_contract.py runs the
same tests on it as on vLLM), plus what the rollout service and profiling use beside the port
(``live_request_ids``, ``forget_cached``, ``cfg``, ``kv_capacity_tokens``).

Invariants (tests/engines/test_simulated_engine.py):
- every sampled token is below the model's tokenizer size and ``vocab_size``, EOS is the model's;
- the same weights and request give the same tokens (loading other weights changes them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import ConfigError
from rollpacker.engines.fake import FakeEngine


class SimulatedEngine(FakeEngine):
    """``FakeEngine`` with the model's vocabulary and EOS, sized by ``engine.*``."""

    def __init__(self, config: EngineConfig) -> None:
        vocab, eos = model_vocab(Path(config.model_dir))
        super().__init__(
            concurrency=config.max_num_seqs,
            vocab_size=vocab,
            eos_token_id=eos,
            tp_size=config.tensor_parallel_size,
            kv_capacity_tokens=config.max_num_seqs * config.max_model_len,  # never preempts
        )
        self.cfg = config  # as VLLMEngine's: what profiling sizes the single layout by

    @property
    def kv_capacity_tokens(self) -> int:
        """What its KV cache holds, in tokens (what profiling sizes its grid by)."""
        return self._kv_cap

    def live_request_ids(self) -> list[str]:
        """The requests not finished yet (running or waiting)."""
        return [r.req.request_id for r in (*self._running, *self._waiting)]

    def forget_cached(self) -> None:
        """Nothing is cached between requests here."""


def build_engine(config: EngineConfig) -> Any:
    """The rollout engine ``engine.kind`` names, on the model in ``config.model_dir``."""
    if config.kind == "simulated":
        return SimulatedEngine(config)
    from rollpacker.engines.vllm_engine import VLLMEngine

    return VLLMEngine(config)


def model_vocab(model_dir: Path) -> tuple[int, int]:
    """(token ids the model's tokenizer decodes, its EOS id) from the model directory's files
    (``config.json``, ``tokenizer.json`` where present), without loading the model."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"engine.kind: simulated: {model_dir} is not a model directory ({e})") from e
    vocab = int(cfg["vocab_size"])
    tok_file = model_dir / "tokenizer.json"
    if tok_file.is_file():
        tok = json.loads(tok_file.read_text())
        base = tok.get("model", {}).get("vocab", {})  # token -> id (BPE, WordLevel), or a list (Unigram)
        ids = [*(base.values() if isinstance(base, dict) else range(len(base)))]
        ids += [t["id"] for t in tok.get("added_tokens", [])]
        vocab = min(vocab, max(ids) + 1) if ids else vocab
    eos = cfg.get("eos_token_id", 0)
    eos = int(eos[0] if isinstance(eos, list) else eos if eos is not None else 0)
    if not 0 <= eos < vocab:
        raise ConfigError(f"{model_dir}: eos_token_id {eos} is outside the tokenizer's {vocab} ids")
    return vocab, eos
