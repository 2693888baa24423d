"""Every config refusal fires before slow work: `train`, `run`, `bench learning`, `submit` and the
lab's benches that start engines or trainers, with a mistaken setting, fail at load time, in
seconds, on an empty model cache and with no services, and leave nothing behind (no warm-up, no
store, no MLflow file, no log, no output directory, no engine, Ray or torch loaded), so the
corrected command in the same directory just runs. The machine is checked too: a
cuda engine, trainer or layout where no GPU (or too few) is visible."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from rollpacker.core.config import SHIPPED_CONFIGS

# (name, command, what the error must say); {model} is a Hugging Face config.json written here, whose
# shape (6 heads, 2 KV heads, 3 layers, 1024 positions) is not the tiny preset's
MEGATRON = ["--set", "train.backend=megatron"]
TP3 = [*MEGATRON, "--set", "train.megatron.tp=3"]
HEADS = "does not divide the model's 4 attention heads"
CUDA = ["--set", "engine.device=cuda"]
CUDA_ENGINE = "engine.device: cuda: the rollout engine runs on GPUs but this machine shows no GPU"
CASES: list[tuple[str, list[str], str]] = [
    ("tp vs heads", ["train", *TP3], f"train.megatron.tp = 3 {HEADS}"),
    (
        "tp vs kv heads",
        ["train", *MEGATRON, "--set", "train.megatron.tp=4"],
        "tp = 4 does not divide the model's 2 KV",
    ),
    (
        "pp vs layers",
        ["train", *MEGATRON, "--set", "train.megatron.pp=3"],
        "pp = 3 does not divide the model's 4 layers",
    ),
    (
        "pp > layers",
        ["train", *MEGATRON, "--set", "train.megatron.pp=8"],
        "pp = 8 is larger than the model's 4 layers",
    ),
    (
        "engine tp",
        ["train", "--set", "engine.tensor_parallel_size=3"],
        f"engine.tensor_parallel_size: TP 3 {HEADS}",
    ),
    (
        "layout tps",
        ["train", "--set", "planner.devices=8", "--set", "planner.max_tp=8"],
        f"(layouts): TP 8 {HEADS}",
    ),
    ("max_model_len", ["train", "--set", "engine.max_model_len=5000"], "max_position_embeddings = 4096"),
    (
        "model_dir shape",
        ["train", *MEGATRON, "--set", "train.megatron.tp=4", "--set", "model.model_dir={model}"],
        "tp = 4 does not divide the model's 6 attention heads",
    ),
    (
        "model_dir missing",
        ["train", "--set", "model.model_dir={model}/nowhere"],
        "not a Hugging Face model directory",
    ),
    (
        "preset",
        ["train", "--set", "model.preset=huge", "--set", "model.warmup_steps=0"],
        "model.preset = 'huge'",
    ),
    ("warm-up preset", ["train", "--set", "model.preset=huge"], "use one of"),
    ("backend vs kl", ["train", *MEGATRON, "--set", "train.kl_coef=0.1"], "no reference model yet"),
    ("objective", ["train", "--set", "train.objective=nonsense"], "train.objective = 'nonsense'"),
    ("policy", ["train", "--set", "rollout.policy=nonsense"], "rollout.policy = 'nonsense'"),
    ("unknown key", ["train", "--set", "engine.tp=2"], "engine.tp"),
    # the machine (no GPU here; CUDA_VISIBLE_DEVICES as MACHINE says), counted without NVML or vLLM
    (
        "engine on cuda, no GPU",
        ["train", "--set", "engine.device=cuda"],
        "engine.device: cuda: the rollout engine runs on GPUs but this machine shows no GPU",
    ),
    (
        "engine tp > GPUs",
        ["train", "--set", "engine.device=cuda", "--set", "engine.tensor_parallel_size=4"],
        "engine.tensor_parallel_size = 4 with engine.device: cuda: it needs 4 GPUs but this machine shows 2",
    ),
    (
        "layouts > GPUs",
        ["train", "--set", "engine.device=cuda", "--set", "planner.devices=4", "--set", "planner.max_tp=4"],
        "planner.devices = 4 with engine.device: cuda: it needs 4 GPUs but this machine shows 1",
    ),
    ("trainer on cuda, no GPU", ["train", "--set", "train.device=cuda"], "train.device = cuda: this machine"),
    (
        "run on cuda, no GPU",
        ["run", "--runner", "inline", "--no-services", "--config", "{cuda_yaml}"],
        "engine.device: cuda: the rollout engine runs on GPUs",
    ),
    ("run", ["run", "--no-services", "--config", "{megatron_yaml}"], f"tp = 3 {HEADS}"),
    (
        "bench learning",
        ["bench", "learning", "--arms", "sync", "--seeds", "0", *TP3, "--out", "o.json"],
        f"tp = 3 {HEADS}",
    ),
    (
        "submit",
        ["submit", "--host", "http://127.0.0.1:{port}", "--config", "{megatron_yaml}"],
        f"tp = 3 {HEADS}",
    ),
    # the lab's benches that start engines or trainers: the machine before any warm-up or output
    (
        "lab bench learning on cuda",
        ["lab", "bench", "learning", "--arms", "sync,dapo", "--seeds", "0", "--set", "train.device=cuda"],
        "train.device = cuda: this machine shows no GPU",
    ),
    (  # its second arm's setting: refused before the first arm trains
        "lab bench learning, a later arm",
        [
            "lab",
            "bench",
            "learning",
            "--arms",
            "sync,dapo",
            "--seeds",
            "0",
            "--set",
            "rollout.max_tokens=100",
        ],
        "train.overlong_buffer = 128: must be smaller than rollout.max_tokens = 100",
    ),
    ("lab bench scaledown on cuda", ["lab", "bench", "scaledown", "--config", "{cuda_yaml}"], CUDA_ENGINE),
    (
        "lab bench speculation on cuda",
        ["lab", "bench", "speculation", "--set", "engine.device=cuda"],
        CUDA_ENGINE,
    ),
    (
        "lab bench speculation tp > GPUs",
        ["lab", "bench", "speculation", *CUDA, "--set", "engine.tensor_parallel_size=4"],
        "engine.tensor_parallel_size = 4 with engine.device: cuda: it needs 4 GPUs but this machine shows 2",
    ),
    ("lab bench rollout-task on cuda", ["lab", "bench", "rollout-task", *CUDA], CUDA_ENGINE),
    (
        "lab bench rollout-replay on cuda",
        ["lab", "bench", "rollout-replay", "--out", "replay.json"],
        "engine.device: auto (the installed vLLM's): the rollout engine runs on GPUs",
    ),
    ("lab bench planner on cuda", ["lab", "bench", "planner", "--config", "{cuda_yaml}"], CUDA_ENGINE),
    ("lab profile on cuda", ["lab", "profile", "--config", "{cuda_yaml}"], CUDA_ENGINE),
    ("lab soak", ["lab", "soak", "--steps", "4", *TP3], f"tp = 3 {HEADS}"),
    ("lab soak on cuda", ["lab", "soak", "--steps", "4", *CUDA], CUDA_ENGINE),
    ("lab chaos, an arm", ["lab", "chaos", "--arms", "sync,tail-batching"], "arms[1] = 'tail-batching'"),
    ("lab chaos, a task", ["lab", "chaos", "--task", "synthetic-code"], "did you mean 'synthetic_code'"),
    ("train, a task", ["train", "--set", "task.name=humaneval.json"], "task.name = 'humaneval.json'"),
]

# the environment per case (every other case: CUDA_VISIBLE_DEVICES="", no GPU, whatever the
# machine has, and vLLM's device the installed package's)
MACHINE: dict[str, dict[str, str]] = {
    "engine tp > GPUs": {"CUDA_VISIBLE_DEVICES": "0,1"},
    "layouts > GPUs": {"CUDA_VISIBLE_DEVICES": "0"},
    "lab bench speculation tp > GPUs": {"CUDA_VISIBLE_DEVICES": "0,1"},
    "lab bench rollout-replay on cuda": {"ROLLPACKER_VLLM_DEVICE": "cuda"},  # a CUDA vLLM, no GPU
}

# one interpreter walks every case (CliRunner); a case still running after LIMIT_S has reached slow
# work: it is stopped there (SIGALRM) and reported, and the walk stops
LIMIT_S = 5
_DRIVER = """
import json, os, signal, socket, sys, time
from typer.testing import CliRunner
from rollpacker.cli import app
def too_slow(*_):
    raise TimeoutError("still running: it reached slow work")
signal.signal(signal.SIGALRM, too_slow)
cases, limit, report = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
machine = json.loads(sys.argv[4])
kfp = socket.socket(); kfp.bind(("127.0.0.1", 0)); kfp.listen()  # a KFP host that accepts connections
port = kfp.getsockname()[1]
out = []
for name, args, _ in cases:
    args = [a.replace("{port}", str(port)) for a in args]
    os.environ.pop("ROLLPACKER_VLLM_DEVICE", None)
    os.environ.update({"CUDA_VISIBLE_DEVICES": "", **machine.get(name, {})})
    t0 = time.perf_counter()
    signal.alarm(limit)
    res = CliRunner().invoke(app, args)
    signal.alarm(0)
    out.append([name, res.exit_code, res.output + repr(res.exception), time.perf_counter() - t0])
    if isinstance(res.exception, TimeoutError):
        break
heavy = sorted(m for m in ("torch", "vllm", "ray", "transformers", "megatron") if m in sys.modules)
with open(report, "w") as f:
    json.dump({"cases": out, "heavy": heavy}, f)
"""


def test_every_refusal_fires_before_slow_work(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    shape = {"num_attention_heads": 6, "num_key_value_heads": 2, "num_hidden_layers": 3, "hidden_size": 96}
    shape |= {"intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 1024}
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], **shape}))
    data = yaml.safe_load((SHIPPED_CONFIGS / "experiment.yaml").read_text())
    data["train"] = {**data.get("train", {}), "backend": "megatron", "megatron": {"tp": 3}}
    data["train"].pop("kl_coef", None)
    megatron_yaml = tmp_path / "megatron.yaml"
    megatron_yaml.write_text(yaml.safe_dump(data))
    data = yaml.safe_load((SHIPPED_CONFIGS / "experiment.yaml").read_text())
    data["engine"] = {**data.get("engine", {}), "device": "cuda"}
    cuda_yaml = tmp_path / "cuda.yaml"
    cuda_yaml.write_text(yaml.safe_dump(data))
    work = tmp_path / "work"
    work.mkdir()
    cases = [
        (
            n,
            [
                a.replace("{model}", str(model))
                .replace("{megatron_yaml}", str(megatron_yaml))
                .replace("{cuda_yaml}", str(cuda_yaml))
                for a in args
            ],
            m,
        )
        for n, args, m in CASES
    ]
    cache, services = tmp_path / "cache", tmp_path / "services"
    env = {**os.environ, "ROLLPACKER_CACHE": str(cache), "ROLLPACKER_SERVICES_DIR": str(services)}
    env.pop("RAY_ADDRESS", None)
    report_file = tmp_path / "report.json"
    args = [json.dumps(cases), str(LIMIT_S), str(report_file), json.dumps(MACHINE)]
    res = subprocess.run(
        [sys.executable, "-c", _DRIVER, *args], cwd=work, env=env, stderr=subprocess.PIPE, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(report_file.read_text())
    for (name, code, output, took), (_, _, expected) in zip(report["cases"], cases, strict=False):
        assert code == 2, f"{name}: exit {code}\n{output}"
        assert expected in output, f"{name}: expected {expected!r} in\n{output}"
        assert "Traceback" not in output, f"{name}:\n{output}"
        assert took < LIMIT_S, f"{name}: refused after {took:.1f} s"
    assert len(report["cases"]) == len(cases)
    assert report["heavy"] == []  # no engine, trainer, Ray or model was loaded
    assert not cache.exists() and not services.exists()  # nothing warmed up, no service started
    # no store, no MLflow file, no output, no log (`run` opens its log after the checks), not even
    # an empty directory (`submit`'s and the benches' output directories are made after the checks)
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*"))
    assert left == [], left
