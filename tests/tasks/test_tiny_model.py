from __future__ import annotations

import hashlib
import json

from rollpacker.tasks.tiny_model import TinyModelSpec, build_tiny_model, count_parameters

SPEC = TinyModelSpec(hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, intermediate_size=128)


def _digest(p) -> str:
    return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()


def test_build_is_deterministic_cached_and_loadable(tmp_path) -> None:
    a = build_tiny_model(SPEC, cache_dir=tmp_path / "a")
    b = build_tiny_model(SPEC, cache_dir=tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert build_tiny_model(SPEC, cache_dir=tmp_path / "a") == a  # cached
    assert 10_000 < count_parameters(a) < 200_000
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a))
    for text in ["12+3=15\n", "def f(x):\n    return x * 2  # ok", "é!"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    model = AutoModelForCausalLM.from_pretrained(str(a))
    assert model.config.model_type == "qwen2"
    written = json.loads((a / "config.json").read_text())  # the shape the load-time checks read
    assert {k: written[k] for k in SPEC.config_json()} == SPEC.config_json()
    assert not list(tmp_path.glob("a/models/*.tmp-*"))  # no half-written directory left
