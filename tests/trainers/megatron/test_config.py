"""``train.backend`` / ``train.megatron``: bad layouts are refused by name before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.core.config import ConfigError, MegatronConfig, TrainerConfig, from_mapping
from rollpacker.trainers.megatron import gang


def test_backend_and_layout_parse() -> None:
    cfg = from_mapping(
        TrainerConfig, {"backend": "megatron", "megatron": {"tp": 2, "pp": 2, "world_size": 8}}, "train."
    )
    assert (cfg.megatron.tp, cfg.megatron.pp, cfg.megatron.data_parallel, cfg.megatron.ranks) == (2, 2, 2, 8)
    assert TrainerConfig().backend == "torch"
    assert MegatronConfig(tp=2).ranks == 2
    m = from_mapping(MegatronConfig, {"recompute": "full", "gpu_memory_gib": 141}, "train.megatron.")
    assert (m.recompute, m.gpu_memory_gib, MegatronConfig().recompute) == ("full", 141.0, "none")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"backend": "deepspeed"}, r"train.backend = 'deepspeed': use 'torch' or 'megatron'"),
        ({"megatron": {"tp": 2, "pp": 1, "dp": 2, "world_size": 2}}, r"world_size = 2 != tp \* pp \* dp"),
        ({"megatron": {"tp": 2, "pp": 2, "world_size": 6}}, r"world_size = 6 is not a multiple of tp \* pp"),
        ({"megatron": {"tp": 0}}, r"train.megatron.tp"),
        ({"megatron": {"tpp": 2}}, r"'train.megatron.tpp'"),
        ({"backend": "megatron", "kl_coef": 0.1}, r"kl_coef = 0.1 with train.backend: megatron"),
        ({"megatron": {"recompute": "partial"}}, r"recompute = 'partial': use one of none, selective, full"),
        (
            {"megatron": {"gpu_memory_gib": 0}},
            r"train.megatron.gpu_memory_gib = 0.0: must be a positive number",
        ),
    ],
)
def test_bad_config_refused_by_name(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_mapping(TrainerConfig, data, "train.")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"tp": 8}, r"tp = 8 does not divide the model's 4 attention heads"),
        ({"tp": 4}, r"tp = 4 does not divide the model's 2 KV heads"),
        ({"pp": 4}, r"pp = 4 is larger than the model's 2 layers"),
    ],
)
def test_model_layout_refused_before_any_process_starts(
    gqa_tied: Path, monkeypatch: pytest.MonkeyPatch, layout: dict[str, int], message: str
) -> None:
    def no_gang(self: object) -> None:
        raise AssertionError("a process was started for a refused layout")

    monkeypatch.setattr(gang.MegatronTrainer, "_start", no_gang)
    cfg = TrainerConfig(backend="megatron", megatron=MegatronConfig(**layout))
    with pytest.raises(ConfigError, match=message):
        gang.MegatronTrainer(gqa_tied, cfg)


def test_unsupported_architecture_refused_before_any_process_starts(
    gqa_tied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json
    import shutil

    bad = tmp_path / "llama"
    shutil.copytree(gqa_tied, bad)
    cfg_json = json.loads((bad / "config.json").read_text())
    cfg_json["architectures"] = ["MistralForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg_json))
    monkeypatch.setattr(gang.MegatronTrainer, "_start", lambda self: pytest.fail("started"))
    with pytest.raises(ConfigError, match=r"architecture 'MistralForCausalLM' is not supported"):
        gang.MegatronTrainer(bad, TrainerConfig(backend="megatron"))


def test_a_plan_that_cannot_fit_the_gpus_is_refused_before_any_process_starts(
    gqa_tied: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On GPUs the gang runs the memory preflight (core/memory.py) on the model's config.json;
    CPU ranks (gpus_per_rank: 0) share the host's memory and are not sized per device."""
    started: list[bool] = []
    monkeypatch.setattr(gang.MegatronTrainer, "_start", lambda self: started.append(True))
    monkeypatch.setattr(gang.MegatronTrainer, "_reset_accum", lambda self: None)
    small = MegatronConfig(gpus_per_rank=1, gpu_memory_gib=2.0)
    with pytest.raises(
        ConfigError, match=r"needs 4\.\d GiB .*more than gpu_memory_gib = 2 .*longest sequence 200"
    ):
        gang.MegatronTrainer(gqa_tied, TrainerConfig(backend="megatron", megatron=small), longest_tokens=200)
    assert not started
    cpu = MegatronConfig(gpus_per_rank=0, gpu_memory_gib=2.0)
    gang.MegatronTrainer(gqa_tied, TrainerConfig(backend="megatron", megatron=cpu), longest_tokens=200)
    assert started == [True]
