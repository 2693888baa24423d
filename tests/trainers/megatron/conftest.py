"""Tiny Qwen2 models for the megatron backend's tests: grouped-query attention (4 heads, 2 KV
heads, so TP=2 splits whole KV groups), QKV bias, SwiGLU, 2 layers (PP=2), an odd vocabulary (63,
padded to 64 at TP=2), tied and untied embeddings; norms and biases perturbed away from their
init so a mapping that mixes them up cannot pass."""

from __future__ import annotations

from pathlib import Path

import pytest


def build_gqa_model(out: Path, tied: bool, vocab: int = 63, max_positions: int = 256) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tied,
        pad_token_id=0,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def gqa_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gqa_model(tmp_path_factory.mktemp("gqa-tied"), tied=True)


@pytest.fixture(scope="session")
def gqa_untied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gqa_model(tmp_path_factory.mktemp("gqa-untied"), tied=False)
