from __future__ import annotations

import pytest

from rollpacker.core.errors import EngineError
from rollpacker.engines.vllm_engine import check_model_dir


def test_bad_model_dirs_are_named(tmp_path) -> None:
    with pytest.raises(EngineError, match="does not exist"):
        check_model_dir(str(tmp_path / "nope"))
    with pytest.raises(EngineError, match="empty"):
        check_model_dir("")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineError, match=r"lacks \*\.safetensors, tokenizer\.json"):
        check_model_dir(str(tmp_path))
