"""The reward factory builds the judge from ``reward.judge``: its model (a directory, or a URI in
the experiment's store, downloaded), its device (``auto`` resolved; a GPU faked at torch's edge) and
dtype; the toy judge is refused for open-ended judge prompts."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollpacker.core.config import ExperimentConfig, config_from_text, resolve_config
from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample
from rollpacker.core.timeout import AdaptiveTimeout
from rollpacker.rewards.base import RewardRequest, RewardStatus
from rollpacker.rewards.factory import build_rewards, judge_model_dir, judge_settings
from rollpacker.rewards.judge import JudgeReward
from rollpacker.tasks.tiny_model import build_tiny_model

CLUSTER = resolve_config("cluster").read_text()
EXAMPLE = TaskExample("j0", "2+2?", RewardKind.JUDGE, reference="Answer: 4")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    """An untrained tiny model: any HF causal LM directory can serve as the judge."""
    return build_tiny_model("tiny")


def fake_gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """torch sees ``n`` GPUs (the outer edge: nothing is ever placed on one here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def _rewards(cfg: ExperimentConfig, examples: list[TaskExample]):  # type: ignore[no-untyped-def]
    return build_rewards(cfg, examples, AdaptiveTimeout(cfg.reward.sandbox.timeouts()), quiet=True)


def test_the_cluster_judge_runs_the_cuda_offload_in_its_dtype(model_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = config_from_text(CLUSTER, overrides={"reward.judge.model": str(model_dir)})
    fake_gpus(monkeypatch, 1)
    got_dir, jc = judge_settings(cfg)
    assert got_dir == model_dir
    assert (jc.device, jc.dtype, jc.offloaded) == ("cuda", "bfloat16", True)
    assert jc.memory_budget_bytes == 20000 << 20
    fake_gpus(monkeypatch, 0)  # a judge pod that sees no GPU: refused, not judged on the CPU
    with pytest.raises(ConfigError, match=r"reward\.judge\.device = cuda: this process sees no GPU"):
        judge_settings(cfg)


def test_auto_is_cuda_where_a_gpu_is_visible_and_cpu_elsewhere(model_dir: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cfg = config_from_text("", overrides={"reward.judge.model": str(model_dir)})
    fake_gpus(monkeypatch, 2)
    assert judge_settings(cfg)[1].device == "cuda"
    fake_gpus(monkeypatch, 0)
    assert judge_settings(cfg)[1].device == "cpu"
    gpu_cfg = config_from_text(
        CLUSTER, overrides={"reward.judge.model": str(model_dir), "reward.judge.device": "auto"}
    )
    with pytest.raises(ConfigError, match=r"reward\.judge\.device: auto found no GPU.*gpus_per_rank: 1"):
        judge_settings(gpu_cfg)


def test_a_judge_model_in_the_store_is_downloaded_and_judges(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from rollpacker.store import open_store

    root = tmp_path / "store"
    text = f'store: {{endpoint: "file://{root}"}}\n'
    uri = open_store(config_from_text(text).store).upload_dir(model_dir, "models/judge")
    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    cfg = config_from_text(text, overrides={"reward.judge.model": uri, "reward.judge.device": "cpu"})
    with _rewards(cfg, [EXAMPLE]) as router:
        judge = router.function_for(RewardKind.JUDGE)
        assert isinstance(judge, JudgeReward)
        assert judge.model_dir.parent == tmp_path / "cache" / "judge-models"  # downloaded, not the original
        assert (judge.model_dir / "model.safetensors").is_file()
        res = router.submit(RewardRequest("s0", EXAMPLE, "Answer: 4")).result(timeout=120)
    assert res.status is RewardStatus.OK and 0.0 <= res.reward <= 1.0
    assert judge_model_dir(cfg) == judge.model_dir  # a second build reuses the download


def test_a_judge_directory_that_is_not_on_this_pod_is_named(tmp_path: Path) -> None:
    cfg = config_from_text("", overrides={"reward.judge.model": str(tmp_path / "nope")})
    with pytest.raises(ConfigError, match=r"reward\.judge\.model = .*nope'.*does not exist on this machine"):
        judge_model_dir(cfg)


def test_the_toy_judge_is_refused_for_open_ended_judge_prompts(tmp_path: Path) -> None:
    from rollpacker.tasks.jsonl import dump_jsonl

    data = tmp_path / "train.jsonl"
    dump_jsonl([EXAMPLE], data)
    cfg = config_from_text("", overrides={"task.name": str(data)})  # a CPU config, the toy judge
    with pytest.raises(ConfigError, match=r"the toy judge \(reward\.judge\.model unset: the 'micro'") as e:
        _rewards(cfg, [EXAMPLE])
    assert "open-ended judge prompts" in str(e.value) and "set reward.judge.model" in str(e.value)


def test_the_judge_runs_in_its_dtype_and_the_offload_plans_with_its_bytes(model_dir: Path) -> None:
    """A float32 checkpoint judged in bfloat16: the weights on the device are bfloat16, resident or
    streamed, and the offload's layer size (what the budget plan uses) is the device's, half the file's."""
    import torch

    from rollpacker.rewards.judge import JudgeConfig
    from rollpacker.tasks.judge_task import judge_pairs

    prompts = [p.prompt() for p in judge_pairs(6, seed=5)]
    with JudgeReward(model_dir) as fp32, JudgeReward(model_dir, JudgeConfig(dtype="bfloat16")) as bf16:
        assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
        want = fp32.score_prompts(prompts)
        got = bf16.score_prompts(prompts)
    assert max(abs(a - b) for a, b in zip(want, got, strict=True)) < 0.05  # bf16 rounding only
    with JudgeReward(model_dir, JudgeConfig(dtype="bfloat16", resident_layers=0)) as streamed:
        off = streamed.offload
        assert off is not None
        assert off.layer_bytes * 2 == off.host.layer_bytes(0)  # the file holds float32
        assert streamed.score_prompts(prompts) == pytest.approx(got, abs=1e-6)  # = the resident bf16 judge
        assert off.stats().peak_resident_weight_bytes == off.expected_weight_bytes()


def test_a_configured_judge_reads_the_whole_exchange_and_answers_yes_or_no(
    model_dir: Path, tmp_path: Path
) -> None:
    """A judge model without ``judge.json`` (not the toy judge) gets the problem, the reference and
    the response in full, in its chat template, and P(yes) is read from the yes/Yes against the
    no/No tokens; the toy judge's 12-character tails would cut an open-ended answer to its end."""
    import json
    import shutil

    import torch

    from rollpacker.tasks.judge_task import InstructPromptFormat, instruct_verdict_ids

    chat = tmp_path / "chat-judge"
    shutil.copytree(model_dir, chat)
    tc = json.loads((chat / "tokenizer_config.json").read_text())
    tc["chat_template"] = "{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}<a>"
    (chat / "tokenizer_config.json").write_text(json.dumps(tc))
    problem, response = "Why is the sky blue?", "Rayleigh scattering: short wavelengths scatter more."
    reference = "Because air molecules scatter blue light more than red (Rayleigh scattering)."
    with JudgeReward(chat) as judge:
        assert isinstance(judge.prompt_format, InstructPromptFormat)
        text = judge.render(problem, response, reference)
        assert text.startswith("<u>Problem:\nWhy is the sky blue?") and text.endswith(
            "Answer yes or no.</u><a>"
        )
        assert response in text and reference in text
        got = judge.score(problem, response, reference)
        ids = judge.tokenizer.encode(text, add_special_tokens=False)
        with torch.no_grad():
            logits = judge.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    yes, no = instruct_verdict_ids(judge.tokenizer)
    want = torch.stack((logits[list(yes)].logsumexp(0), logits[list(no)].logsumexp(0))).softmax(0)[0]
    assert set(yes) >= {judge.tokenizer.encode("y")[0], judge.tokenizer.encode("Y")[0]}
    assert got == pytest.approx(float(want), abs=1e-5)


@pytest.mark.gpu
def test_the_cluster_judge_on_a_real_gpu_equals_the_resident_judge(model_dir: Path) -> None:
    """On a GPU: the cluster config's judge (cuda, bfloat16, the budget offload) streams layers
    from pinned memory and scores as the resident bfloat16 judge does."""
    import torch

    from rollpacker.rewards.judge import JudgeConfig
    from rollpacker.tasks.judge_task import judge_pairs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = config_from_text(
        CLUSTER, overrides={"reward.judge.model": str(model_dir), "reward.judge.memory_budget_mb": 7}
    )
    got_dir, jc = judge_settings(cfg)  # 7 MB: k = 0 of 4 layers for this model and batch (plan)
    prompts = [p.prompt() for p in judge_pairs(8, seed=3)]
    with JudgeReward(got_dir, jc) as judge, JudgeReward(got_dir, JudgeConfig("cuda", "bfloat16")) as resident:
        assert judge.offload is not None and judge.offload.device.type == "cuda"
        scores = judge.score_prompts(prompts)
        assert judge.resident_layers_used[-1] < judge.offload.num_layers  # layers were streamed
        assert all(
            t.is_pinned() and t.dtype == torch.bfloat16 for d in judge.offload.host.layers for t in d.values()
        )
        assert scores == pytest.approx(resident.score_prompts(prompts), abs=1e-3)
