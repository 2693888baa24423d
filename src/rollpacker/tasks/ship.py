"""Build the shipped models (``rollpacker model ship``): run a shipped config's warm-up recipes (the
policy's start model, ``tasks.models.warmup_spec``, and the toy judge, ``judge_warmup_spec``) with
the project's own warm-ups, measure each on its validation set, and write them with a manifest
into ``rollpacker/models/shipped`` (``tasks/shipped.py`` reads them).

What is measured (and re-measured by tests/tasks/test_shipped.py):
- the policy: ``greedy_exact_match`` on the config's validation prompts (``task.val_size`` of the
  task, the split the RL run validates on): the share whose reference solution (math, code, and the
  judge prompts' reference responses), eos included, is what greedy decoding writes; computed by
  teacher forcing (greedy decoding reproduces a text iff every token of it is the argmax given the
  ones before), so it needs one forward per prompt, no generation and no reward service;
- the judge: its held-out accuracy (``evaluate_judge`` on the held-out pairs, as ``judge.json``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rollpacker.core.config import ExperimentConfig, load_config, resolve_config
from rollpacker.core.errors import ConfigError
from rollpacker.core.tasks import RewardKind, TaskExample, split
from rollpacker.tasks.judge_task import JudgeWarmupSpec
from rollpacker.tasks.shipped import SHIPPED_ROOT, ShippedEntry, ValFigure, sha256_file, write_manifest
from rollpacker.tasks.warmup import WarmupSpec

SHIPPED_CONFIGS = ("experiment", "default", "code")  # the embedded default, `train`'s default, code


@dataclass(frozen=True)
class Recipe:
    """One warm-up a config needs: its cache entry name and how to build and measure it."""

    name: str
    kind: str  # ShippedEntry.kind
    key: str
    spec: WarmupSpec | JudgeWarmupSpec


def recipes(cfg: ExperimentConfig) -> list[Recipe]:
    """The warm-ups ``cfg`` trains on a fresh machine, as cache entries (the names the cache gives)."""
    from rollpacker.tasks.models import judge_warmup_spec, needs_toy_judge, warmup_spec

    out: list[Recipe] = []
    if not cfg.model.model_dir and cfg.model.warmup_steps:
        spec = warmup_spec(cfg)
        out.append(Recipe(f"warm-{spec.model}-{spec.key()}", "warm-up", spec.key(), spec))
    if needs_toy_judge(cfg):
        j = judge_warmup_spec(cfg)
        out.append(Recipe(f"judge-{j.key()}", "judge", j.key(), j))
    return out


def val_examples(cfg: ExperimentConfig) -> tuple[TaskExample, ...]:
    """The config's validation examples: the split ``tasks.models.task_data`` validates on."""
    from rollpacker.tasks.registry import load_task

    examples = load_task(
        cfg.task.name, seed=cfg.seed, num_examples=cfg.task.num_examples, shape=cfg.task.shape.items()
    )
    return split(examples, cfg.task.val_size / len(examples), seed=cfg.seed)[1]


def reference_text(ex: TaskExample) -> str:
    """The response the warm-up taught for ``ex`` (its reference solution)."""
    from rollpacker.tasks import synthetic_code, synthetic_math

    if ex.reward_kind is RewardKind.MATH:
        return synthetic_math.reference_solution(ex)
    if ex.reward_kind is RewardKind.CODE:
        return synthetic_code.reference_solution(ex)
    if ex.reward_kind is RewardKind.JUDGE:
        return ex.reference
    raise ConfigError(f"example {ex.example_id!r}: no reference solution for {ex.reward_kind}")


def greedy_exact_match(
    model_dir: Path, examples: tuple[TaskExample, ...], budget: int = 16384
) -> dict[str, float]:
    """``exact``: the share of ``examples`` whose reference solution + eos greedy decoding writes
    (teacher-forced argmax at every response position); ``token``: the share of response tokens
    that are the argmax. One right-padded forward per micro-batch of ~``budget`` tokens."""
    import torch

    from rollpacker.tasks.warmup import encode_many

    tok, model = _load(model_dir)
    eos = int(tok.eos_token_id)
    prompts = encode_many(tok, [ex.prompt for ex in examples])
    answers = [[*r, eos] for r in encode_many(tok, [reference_text(ex) for ex in examples])]
    order = sorted(range(len(examples)), key=lambda i: len(prompts[i]) + len(answers[i]))
    exact = hits = total = 0
    with torch.inference_mode():
        while order:
            n = 1
            while n < len(order) and (n + 1) * (len(prompts[order[n]]) + len(answers[order[n]])) <= budget:
                n += 1
            chunk, order = order[:n], order[n:]
            width = max(len(prompts[i]) + len(answers[i]) for i in chunk)
            ids = torch.full((len(chunk), width), eos, dtype=torch.long)
            for row, i in enumerate(chunk):  # right padding: causal attention never sees a pad
                ids[row, : len(prompts[i]) + len(answers[i])] = torch.tensor(prompts[i] + answers[i])
            pred = model(input_ids=ids, use_cache=False).logits.argmax(dim=-1)
            for row, i in enumerate(chunk):
                p, a = len(prompts[i]), len(answers[i])
                ok = pred[row, p - 1 : p - 1 + a] == torch.tensor(answers[i])
                exact += int(bool(ok.all()))
                hits += int(ok.sum())
                total += a
    return {"exact": exact / len(examples), "token": hits / total}


def _load(model_dir: Path):  # type: ignore[no-untyped-def]
    """The tokenizer and the float32 model of ``model_dir``, in eval mode."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    return AutoTokenizer.from_pretrained(str(model_dir)), model


def measure(recipe: Recipe, model_dir: Path, cfg: ExperimentConfig) -> ValFigure:
    """What the manifest records as the entry's validation figure (the module's docstring)."""
    s = recipe.spec
    if isinstance(s, JudgeWarmupSpec):
        from rollpacker.tasks.judge_task import JUDGE_EVAL_SEED_OFFSET, evaluate_judge, judge_pairs

        pairs = judge_pairs(s.eval_pairs, JUDGE_EVAL_SEED_OFFSET + s.seed, s.task)
        tok, model = _load(model_dir)
        acc = evaluate_judge(model, tok, pairs, s.prompt)
        return {
            "metric": "heldout_accuracy",
            "value": acc,
            "examples": len(pairs),
            "set": "judge_pairs held out",
        }
    ex = val_examples(cfg)
    got = greedy_exact_match(model_dir, ex)
    return {
        "metric": "greedy_exact_match",
        "value": got["exact"],
        "token_accuracy": got["token"],
        "examples": len(ex),
        "set": f"{cfg.task.name} validation split (seed {cfg.seed}, "
        f"{cfg.task.val_size} of {cfg.task.num_examples})",
    }


def describe(recipe: Recipe, model_dir: Path, config: str, val: ValFigure) -> ShippedEntry:
    """The manifest entry of a built cache entry."""
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from rollpacker.tasks.tiny_model import PRESETS, tokenizer_id

    tensors: dict[str, list[int]] = {}
    dtypes = set()
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as st:
        for k in sorted(st.keys()):
            tensors[k] = list(st.get_slice(k).get_shape())
            dtypes.add(st.get_slice(k).get_dtype())
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    shape_keys = PRESETS[recipe.spec.model].config_json()
    cfg_json = json.loads((model_dir / "config.json").read_text())
    return ShippedEntry(
        name=recipe.name,
        kind=recipe.kind,
        key=recipe.key,
        config=config,
        recipe=asdict(recipe.spec),
        files={f.name: sha256_file(f) for f in sorted(model_dir.iterdir()) if f.is_file()},
        val=val,
        shape={k: cfg_json[k] for k in shape_keys},
        tensors=tensors,
        parameters=sum(_numel(s) for s in tensors.values()),
        dtype=",".join(sorted(dtypes)),
        tokenizer=tokenizer_id(tok.get_vocab(), str(tok.eos_token)),
        built_with={
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": str(torch.get_num_threads()),
        },
    )


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build(recipe: Recipe, cache_dir: Path, progress: Callable[[int, float], None] | None = None) -> Path:
    """The recipe's warm-up in ``cache_dir``, trained by the project's warm-up (never installed
    from the shipped models: they are what is being built)."""
    from rollpacker.tasks.judge_task import warm_up_judge
    from rollpacker.tasks.warmup import warm_up

    if isinstance(recipe.spec, JudgeWarmupSpec):
        return warm_up_judge(recipe.spec, cache_dir=cache_dir, progress=progress, use_shipped=False)
    return warm_up(recipe.spec, cache_dir=cache_dir, progress=progress, use_shipped=False)


def ship(
    configs: tuple[str, ...] = SHIPPED_CONFIGS,
    out: Path = SHIPPED_ROOT,
    cache_dir: Path | None = None,
    say: Callable[[str], None] = print,
    progress: Callable[[Recipe], Callable[[int, float], None] | None] = lambda _r: None,
) -> list[ShippedEntry]:
    """Build every warm-up ``configs`` need, measure it and write it with the manifest to ``out``
    (replacing what was there). ``cache_dir``: train there (a warm-up already cached there is
    reused as it is); by default a new empty directory, so every model is trained now."""
    work = Path(tempfile.mkdtemp(prefix="rollpacker-ship-")) if cache_dir is None else cache_dir
    try:
        built: list[tuple[Recipe, Path, str, ValFigure]] = []
        for config in configs:
            cfg = load_config(resolve_config(config))
            for r in recipes(cfg):
                if any(b[0].name == r.name for b in built):
                    continue
                say(f"{r.name}: building ({r.kind} of {config})")
                path = build(r, work, progress(r))
                val = measure(r, path, cfg)
                say(f"{r.name}: {val['metric']} {val['value']:.4f} on {val['examples']} examples")
                built.append((r, path, config, val))
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        entries = []
        for r, path, config, val in built:
            shutil.copytree(path, out / r.name)
            entries.append(describe(r, out / r.name, config, val))
        write_manifest(out, entries)
        return entries
    finally:
        if cache_dir is None:
            shutil.rmtree(work, ignore_errors=True)
