"""The tests' small Qwen2 (2 layers, hidden 32, vocab 64): fast enough for float64 gradient checks
and for a real trainer service in a unit test."""

from __future__ import annotations

from pathlib import Path


def build_small_model(out: Path) -> Path:
    """Save the small model (seeded, deterministic) in Hugging Face format under ``out``."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return out
