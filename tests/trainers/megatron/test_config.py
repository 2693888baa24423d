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
        ({"megatron": {"attention": "flash"}}, r"attention = 'flash': use one of unfused, sdpa"),
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


def test_the_cluster_config_trains_in_the_engines_dtype_and_fits_its_gpus() -> None:
    """configs/cluster.yaml (= manifests/experiment.yaml): bf16 like its engine, recompute and the
    fused attention on, and the Qwen2.5-7B plan passes the memory preflight on 80 GB; in fp32
    against the bf16 engine it is refused by name, and without recompute or with the unfused
    attention the preflight refuses it."""
    from rollpacker.core.config import load_config
    from rollpacker.core.memory import GIB, ModelShape, check_fits, training_plan
    from tests.core.test_memory import QWEN25

    cfg = load_config("cluster")
    assert (cfg.engine.dtype, cfg.train.megatron.dtype) == ("bfloat16", "bfloat16")
    plan = training_plan(cfg)
    assert plan is not None and (plan.tp, plan.dp, plan.longest_tokens, plan.attention) == (
        2,
        4,
        9216,
        "sdpa",
    )
    assert check_fits(ModelShape.from_hf_config(QWEN25["7B"]), plan).total <= 80 * GIB
    with pytest.raises(ConfigError, match=r"train.megatron.dtype = 'float32' with engine.dtype = 'bfloat16'"):
        load_config("cluster", {"train.megatron.dtype": "float32"})
    load_config("cluster", {"train.megatron.dtype": "float32", "engine.dtype": "float32"})
    load_config("cluster", {"train.megatron.dtype": "float32", "train.megatron.gpus_per_rank": 0})  # CPU
    torch_gpu = {"train.backend": "torch", "train.device": "cuda"}  # the torch backend on a GPU likewise
    with pytest.raises(ConfigError, match=r"train.dtype = 'float32' with engine.dtype = 'bfloat16' on GPUs"):
        load_config("cluster", torch_gpu)
    load_config("cluster", {**torch_gpu, "train.dtype": "bfloat16"})
    for change in ({"train.megatron.recompute": "none"}, {"train.megatron.attention": "unfused"}):
        other = training_plan(load_config("cluster", change))
        assert other is not None
        with pytest.raises(ConfigError, match=r"more than gpu_memory_gib = 80"):
            check_fits(ModelShape.from_hf_config(QWEN25["7B"]), other)
