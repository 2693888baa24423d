"""``engine.kind: simulated``: the stand-in engine speaks the model's vocabulary, follows its
weights, and the config refuses it wherever it would pass for a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollpacker.core.config import EngineConfig, ExperimentConfig, config_from_text
from rollpacker.core.errors import ConfigError
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.simulated import SimulatedEngine, build_engine, model_vocab


def _model(tmp_path: Path, vocab: int = 320, tokens: int = 262, eos: object = 5) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": vocab, "eos_token_id": eos}))
    words = {f"t{i}": i for i in range(tokens - 2)}
    added = [{"id": tokens - 2, "content": "<a>"}, {"id": tokens - 1, "content": "<b>"}]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": words}, "added_tokens": added}))
    return tmp_path


def _tokens(eng: SimulatedEngine, rid: str, n: int = 200) -> list[int]:
    req = GenerationRequest(rid, Prompt("p", (1, 2, 3)), 0, SamplingSpec(max_tokens=n, ignore_eos=True))
    eng.add_request(req)
    out: list[int] = []
    while eng.has_unfinished():
        ups, _ = eng.step()
        out += [t for u in ups for t in u.new_token_ids]
    return out


def test_tokens_stay_in_the_tokenizer_and_eos_is_the_models(tmp_path: Path) -> None:
    model = _model(tmp_path)
    assert model_vocab(model) == (262, 5)
    eng = build_engine(
        EngineConfig(model_dir=str(model), max_num_seqs=4, tensor_parallel_size=2, kind="simulated")
    )
    assert isinstance(eng, SimulatedEngine)
    assert (eng.vocab_size, eng.eos_token_id, eng.concurrency, eng.tp_size) == (262, 5, 4, 2)
    toks = _tokens(eng, "a", 2000)
    assert max(toks) < 262 and len(set(toks)) > 100


def test_the_same_weights_give_the_same_tokens_and_new_weights_others(tmp_path: Path) -> None:
    model = _model(tmp_path)
    a, b = (SimulatedEngine(EngineConfig(model_dir=str(model), kind="simulated")) for _ in range(2))
    assert _tokens(a, "x") == _tokens(b, "x")
    b.load_weights([("w", [1.0, 2.0])])
    assert _tokens(a, "y") != _tokens(b, "y")


def test_live_requests_are_listed_until_they_finish(tmp_path: Path) -> None:
    eng = SimulatedEngine(EngineConfig(model_dir=str(_model(tmp_path)), max_num_seqs=1, kind="simulated"))
    for rid in ("r1", "r2"):
        eng.add_request(
            GenerationRequest(rid, Prompt("p", (1,)), 0, SamplingSpec(max_tokens=3, ignore_eos=True))
        )
    assert eng.live_request_ids() == ["r1", "r2"]
    eng.abort(["r1"])
    assert eng.live_request_ids() == ["r2"]


def test_a_directory_without_a_model_or_with_a_bad_eos_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a model directory"):
        model_vocab(tmp_path)
    with pytest.raises(ConfigError, match="eos_token_id 400 is outside"):
        model_vocab(_model(tmp_path, eos=400))
    assert model_vocab(_model(tmp_path, eos=[7, 8]))[1] == 7


def _cfg(extra: str) -> ExperimentConfig:
    return config_from_text(f"experiment: x\narms: [sync]\nengine: {{kind: simulated}}\n{extra}")


NO_PROBE = "train: {sync_probe: {enabled: false}}"


def test_the_config_takes_a_simulated_engine_for_a_dry_run() -> None:
    assert _cfg(NO_PROBE).engine.kind == "simulated"
    assert config_from_text("experiment: x\narms: [sync]\n").engine.kind == "vllm"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ("", "train.sync_probe.enabled: the probe compares"),
        ("train: {sync_probe: {enabled: false}, device: cuda}", "runs on GPUs (train.device: cuda)"),
        (f"{NO_PROBE}\nplanner: {{devices: 2, max_tp: 2}}", "planner.devices = 2: it has no engine layouts"),
        ("train: {sync_probe: {enabled: false}, weight_sync: collective}", "collective needs a vLLM"),
    ],
)
def test_the_config_refuses_a_simulated_engine_where_it_would_pass_for_real(
    extra: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=r"engine\.kind: simulated") as e:
        _cfg(extra)
    assert expected in str(e.value) and "or use engine.kind: vllm" in str(e.value)


def test_an_unknown_engine_kind_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"engine\.kind = 'fake': use one of vllm, simulated"):
        EngineConfig(kind="fake")
