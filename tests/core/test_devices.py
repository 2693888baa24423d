"""Device settings (core/devices.py): resolution, what declares GPUs, and the refusals on a GPU
config (the toy judge; a judge model outside the experiment's store)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import (
    JudgeRewardConfig,
    TrainerConfig,
    config_from_text,
    load_config,
    resolve_config,
)
from rollpacker.core.devices import check_device_setting, resolve_device
from rollpacker.core.errors import ConfigError

CLUSTER = resolve_config("cluster").read_text()


@pytest.mark.parametrize(
    ("setting", "gpus", "device"),
    [
        ("auto", 0, "cpu"),
        ("auto", 2, "cuda"),
        ("cpu", 2, "cpu"),
        ("cuda", 1, "cuda"),
        ("cuda:1", 2, "cuda:1"),
    ],
)
def test_resolve_device_gives_a_concrete_device(setting: str, gpus: int, device: str) -> None:
    assert resolve_device(setting, gpus, name="train.device") == device


@pytest.mark.parametrize(
    ("setting", "gpus", "says"), [("cuda", 0, "sees no GPU"), ("cuda:2", 2, "sees 2 GPU(s) (cuda:0..cuda:1)")]
)
def test_a_gpu_that_is_not_there_is_refused(setting: str, gpus: int, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_device(setting, gpus, name="train.device")
    assert str(e.value).startswith(f"train.device = {setting}: this process {says}")


def test_auto_falls_back_to_the_cpu_only_on_a_config_that_declares_no_gpu() -> None:
    declared = ("train.megatron.gpus_per_rank: 1",)
    assert resolve_device("auto", 0, name="train.device") == "cpu"
    with pytest.raises(ConfigError, match=r"auto found no GPU.*gpus_per_rank: 1.*set train\.device: cpu"):
        resolve_device("auto", 0, name="train.device", declared=declared)
    assert resolve_device("cpu", 0, name="train.device", declared=declared) == "cpu"  # told: obeyed


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:01", "cpu:0", "", 0])
def test_device_settings_are_auto_cpu_cuda_or_cuda_n(bad: object) -> None:
    with pytest.raises(ConfigError, match="use auto"):
        check_device_setting("reward.judge.device", bad)
    with pytest.raises(ConfigError, match=r"train\.device"):
        TrainerConfig(device=bad)  # type: ignore[arg-type]


def test_dtypes_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"train\.dtype = 'float16'"):
        TrainerConfig(dtype="float16")
    with pytest.raises(ConfigError, match=r"reward\.judge\.dtype"):
        JudgeRewardConfig(dtype="int8")


def test_what_declares_gpus() -> None:
    cfg = load_config("cluster")
    assert cfg.gpu_declarations == ("train.megatron.gpus_per_rank: 1", "reward.judge.device: cuda")
    assert load_config("experiment").gpu_declarations == ()  # the embedded default: a CPU config
    torch_gpu = config_from_text("train: {device: cuda:1}")
    assert torch_gpu.gpu_declarations == ("train.device: cuda:1",)
    # megatron's GPUs declare nothing when the torch backend trains
    assert config_from_text("train: {megatron: {gpus_per_rank: 1}}").gpu_declarations == ()


def test_the_cluster_config_has_a_real_judge_on_cuda() -> None:
    j = load_config("cluster").reward.judge
    assert j.model.startswith("s3://rollpacker/") and j.device == "cuda" and j.dtype == "bfloat16"
    assert j.memory_budget_mb > 0  # the layer-wise offload (CUDA: pinned host memory, a copy stream)


def test_the_toy_judge_is_refused_on_a_gpu_config_by_name() -> None:
    with pytest.raises(
        ConfigError, match=r"toy judge \(reward\.judge\.model unset: the 'micro' tiny model"
    ) as e:
        config_from_text(CLUSTER, overrides={"reward.judge.model": ""})
    assert "set reward.judge.model" in str(e.value) and "reward.judge.device: cuda" in str(e.value)
    assert "train.megatron.gpus_per_rank: 1" in str(e.value)  # why this is a GPU config
    # a GPU config whose task holds no judge prompts never builds a judge: nothing to refuse
    math_only = config_from_text(CLUSTER, overrides={"reward.judge.model": "", "task.name": "synthetic_math"})
    assert not math_only.reward.judge.model
    # the embedded default (CPU, the mixed task's synthetic judge prompts) keeps its toy judge
    assert load_config("experiment").reward.judge.model == ""


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("s3://other-bucket/models/judge/", "bucket 'rollpacker'"),
        ("s3://rollpacker/", "with a prefix"),
        ("s3://rollpacker", "with a prefix"),
        ("file:///models/judge", "a file:// URI needs a file store"),
        ("http://example.com/judge", "with a prefix"),
        (" /models/judge", "give a Hugging Face directory"),
    ],
)
def test_a_judge_model_outside_the_experiments_store_is_refused(model: str, says: str) -> None:
    with pytest.raises(ConfigError, match=f"reward.judge.model = {model!r}".replace(".", r"\.")) as e:
        config_from_text(CLUSTER, overrides={"reward.judge.model": model})
    assert says in str(e.value)


def test_a_judge_model_in_a_file_store_or_on_the_pod_is_accepted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    text = f'store: {{endpoint: "file://{tmp_path}"}}\n'
    uri = f"file://{tmp_path}/models/judge"
    assert config_from_text(text, overrides={"reward.judge.model": uri}).reward.judge.model == uri
    assert (
        config_from_text(CLUSTER, overrides={"reward.judge.model": "/models/judge"}).reward.judge.device
        == "cuda"
    )
