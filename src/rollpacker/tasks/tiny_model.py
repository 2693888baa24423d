"""Build a tiny Qwen2-architecture model and its tokenizer, locally and deterministically.

No weights can be downloaded here, so every model rollpacker runs on a CPU is made by this module:
a character-level tokenizer built with the ``tokenizers`` library and a randomly initialised
``Qwen2ForCausalLM`` saved with ``save_pretrained`` (safetensors), loadable by vLLM and by
``transformers``.

Invariants:
- the same ``TinyModelSpec`` gives byte-identical weights (seeded init, float32);
- a built directory is complete or absent: it is written to a temporary sibling and renamed;
- the cache key is a hash of the spec, so changing the spec never reuses a stale model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BUILDER_VERSION = 3  # bump when the on-disk layout changes


@dataclass(frozen=True)
class TinyModelSpec:
    """The shape of a tiny model. The defaults give ~3M parameters."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 704
    max_position_embeddings: int = 4096
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def config_json(self) -> dict[str, int | bool]:
        """The shape keys of the ``config.json`` ``build_model`` writes (vocabulary padded to 64)."""
        return {
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": -(-len(vocab()) // 64) * 64,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True,
        }

    def key(self) -> str:
        blob = json.dumps({"v": BUILDER_VERSION, **asdict(self)}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    # The replay benchmark's model (62K parameters): as narrow and shallow as vLLM's CPU kernels
    # allow, so a decode step's cost is mostly per-step overhead and grows as little as this CPU
    # allows with batch size (closest to a GPU's memory-bound regime); see the README.
    "bench": TinyModelSpec(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=128),
    "micro": TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=352),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("ROLLPACKER_CACHE", Path.home() / ".cache" / "rollpacker"))


def _byte_chars() -> list[str]:
    """GPT-2's reversible byte -> printable-unicode map, in byte order (byte b is entry b)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = 0
    out = []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def vocab() -> dict[str, int]:
    """Special tokens first, then one token per byte: token id of byte b is len(SPECIAL_TOKENS)+b."""
    toks = list(SPECIAL_TOKENS) + _byte_chars()
    return {t: i for i, t in enumerate(toks)}


def tokenizer_id(vocabulary: dict[str, int] | None = None, eos: str = SPECIAL_TOKENS[0]) -> str:
    """The tokenizer's identity: a digest of its vocabulary (token -> id, special tokens included)
    and its eos token; with no arguments, that of the tokenizer ``build_tokenizer`` writes."""
    blob = json.dumps({"vocab": vocab() if vocabulary is None else vocabulary, "eos": eos}, sort_keys=True)
    return "bytelevel-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


def build_tokenizer(out_dir: Path) -> None:
    """Write a byte-level tokenizer with no merges (every byte is one token) to ``out_dir``.

    Byte-level BPE is the Qwen2 tokenizer's own scheme, so transformers' Qwen2 tokenizer class
    and vLLM load it faithfully, and any text (code, maths, judge prompts) is encodable.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=4096,
    )
    fast.save_pretrained(str(out_dir))


def build_model(spec: TinyModelSpec, out_dir: Path) -> None:
    """Write a seeded random Qwen2ForCausalLM (float32 safetensors) to ``out_dir``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    eos_id = vocab()["<|endoftext|>"]
    cfg = Qwen2Config(
        **spec.config_json(),  # the shape the load-time checks read without building (tasks/models.py)
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
        use_sliding_window=False,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(cfg).to(torch.float32)
    finally:
        torch.random.set_rng_state(state)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(str(out_dir), safe_serialization=True)


def build_tiny_model(
    spec: TinyModelSpec | str = "tiny", cache_dir: Path | None = None, force: bool = False
) -> Path:
    """Return the directory of a built tiny model, building it (atomically) if absent."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise ValueError(f"unknown tiny model preset {spec!r}; use one of {sorted(PRESETS)}")
        spec = PRESETS[spec]
    root = (cache_dir or default_cache_dir()) / "models"
    out = root / f"qwen2-tiny-{spec.key()}"
    if out.is_dir() and (out / "config.json").is_file() and not force:
        return out

    def build(tmp: Path) -> None:
        build_tokenizer(tmp)
        build_model(spec, tmp)
        (tmp / "rollpacker_spec.json").write_text(json.dumps(asdict(spec), indent=2))

    return publish_dir(out, build, None if force else lambda d: (d / "config.json").is_file())


def publish_dir(
    out: Path, build: Callable[[Path], None], complete: Callable[[Path], bool] | None = None
) -> Path:
    """Run ``build`` into a temporary sibling of ``out``, then rename it to ``out``: a cached
    directory is complete or absent, whatever dies half-way.

    Under an exclusive lock of ``out`` (``flock`` of a ``<name>.lock`` sibling): a second process
    building the same entry (the suite's other worker, another pod on a shared cache volume) waits
    for the first and, when ``complete(out)`` then holds, returns the first one's result instead of
    building it again, and never replaces a directory another process has published and may read.
    ``complete``: whether ``out`` is a whole entry (its marker file); None: build whatever is there.

    A builder that was killed (SIGKILL, a lost pod) leaves its temporary sibling behind; a builder
    holds the lock for as long as its temporary exists, so whatever ``<name>.tmp-*`` is there when
    the lock is taken is such a leftover, and is removed (a warm-up's is the size of the model).
    """
    import fcntl
    import glob

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in out.parent.glob(glob.escape(out.name) + ".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if complete is not None and complete(out):
                return out
            tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
            try:
                build(tmp)
                if out.exists():
                    shutil.rmtree(out)
                os.replace(tmp, out)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def count_parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += _prod(st.get_slice(k).get_shape())
    return total


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
