"""Warm-up: a short supervised run that teaches the tiny model a task's format before RL.

RL needs a starting policy with non-zero but imperfect reward whose responses already have the
task's long-tailed lengths. No pretrained weights can be downloaded here, so the tiny model built
by ``tiny_model`` is trained for a few hundred steps on reference solutions of the synthetic math
task (loss on the response tokens only, AdamW, token-budget micro-batches sorted by length).

Invariants:
- ``warm_up(spec)`` is deterministic: the same spec gives the same weights (seeded data order and
  init, single-threaded reductions are not required: CPU matmuls are deterministic per machine);
- the result is cached under a key that hashes the whole spec (and the base model's key), and a
  cached directory is complete or absent (written to a temporary sibling, then renamed);
- warm-up problems are drawn with a seed disjoint from the RL datasets' seeds.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.tasks import shipped, synthetic_code, synthetic_math
from rollpacker.tasks.tiny_model import PRESETS, build_tiny_model, default_cache_dir, publish_dir

WARMUP_VERSION = 1
WARMUP_DATA_SEED_OFFSET = 1_000_003  # warm-up problems never share a seed with an RL dataset


@dataclass(frozen=True)
class WarmupSpec:
    model: str = "tiny"  # a tiny_model preset
    task: synthetic_math.SyntheticMathSpec = field(
        default_factory=lambda: synthetic_math.SyntheticMathSpec(num_examples=20000)
    )
    # a share of the warm-up data from the synthetic code task (0: math only, 1: code only)
    code: synthetic_code.SyntheticCodeSpec = field(
        default_factory=lambda: synthetic_code.SyntheticCodeSpec(num_examples=20000)
    )
    code_fraction: float = 0.0
    # the share of math solutions with one wrong step (a sloppy teacher): the warmed-up model keeps
    # a slip rate that RL with the verifier's reward can remove (configs/learning.yaml)
    slip_rate: float = 0.0
    steps: int = 300
    batch_size: int = 32  # sequences per optimizer step
    tokens_per_micro_batch: int = 4096  # padded tokens per forward/backward
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in PRESETS:
            raise ValueError(f"warm-up model {self.model!r}: use one of {sorted(PRESETS)}")
        for name in ("steps", "batch_size", "tokens_per_micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm-up {name} = {getattr(self, name)}: must be >= 1")
        if not self.lr > 0:
            raise ValueError(f"warm-up lr = {self.lr}: must be > 0")
        if not 0.0 <= self.code_fraction <= 1.0:
            raise ValueError(f"warm-up code_fraction = {self.code_fraction}: must be in [0, 1]")
        if not 0.0 <= self.slip_rate < 1.0:
            raise ValueError(f"warm-up slip_rate = {self.slip_rate}: must be in [0, 1)")

    def key(self) -> str:
        fields = asdict(self)
        # a change of a task's text must not reuse a model warmed up on the old one
        fields["math_task_version"] = synthetic_math.TASK_VERSION
        if self.slip_rate == 0.0:
            del fields["slip_rate"]  # the keys of warm-ups from before the field existed
        if self.code_fraction == 0.0:
            del fields["code"], fields["code_fraction"]
        else:
            fields["code_task_version"] = synthetic_code.TASK_VERSION
        blob = json.dumps(
            {"v": WARMUP_VERSION, "base": PRESETS[self.model].key(), **fields}, sort_keys=True
        ).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def encode(tokenizer: object, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]


def encode_many(tokenizer: object, texts: Sequence[str]) -> list[list[int]]:
    """``[encode(tokenizer, t) for t in texts]`` in one call (a fast tokenizer encodes the list in
    Rust: ~10x quicker than one call per text for the 40,000 warm-up texts)."""
    if not texts:
        return []
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    return [list(x) for x in ids]


def warm_up(
    spec: WarmupSpec | None = None,
    cache_dir: Path | None = None,
    force: bool = False,
    progress: Callable[[int, float], None] | None = None,
    use_shipped: bool = True,
) -> Path:
    """Return the directory of the warmed-up model for ``spec``: the cached one, else the shipped
    one for the same key installed into the cache (``tasks/shipped.py``; unless ``use_shipped`` is
    False), else one trained now. ``force``: train even if cached or shipped.

    ``progress(step, loss)`` is called after each optimizer step.
    """
    spec = spec or WarmupSpec()
    out = _warmup_dir(spec, cache_dir)
    if (out / "warmup.json").is_file() and not force:
        return out
    if use_shipped and not force and shipped.install(out) is not None:
        return out
    base = build_tiny_model(spec.model, cache_dir=cache_dir)

    def build(tmp: Path) -> None:
        info = _train(spec, base, tmp, progress)
        (tmp / "warmup.json").write_text(json.dumps({"spec": asdict(spec), **info}, indent=2))

    return publish_dir(out, build, None if force else lambda d: (d / "warmup.json").is_file())


def cached_warm_up(spec: WarmupSpec, cache_dir: Path | None = None) -> Path | None:
    """The directory of the warmed-up model for ``spec`` if the cache holds it, else None."""
    out = _warmup_dir(spec, cache_dir)
    return out if (out / "warmup.json").is_file() else None


def shipped_warm_up(spec: WarmupSpec, cache_dir: Path | None = None) -> Path | None:
    """The shipped model for ``spec``'s key installed into the cache (verified against the
    manifest), or None when no model is shipped for that key."""
    return shipped.install(_warmup_dir(spec, cache_dir))


def _warmup_dir(spec: WarmupSpec, cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / f"warm-{spec.model}-{spec.key()}"


def _train(
    spec: WarmupSpec, base: Path, out: Path, progress: Callable[[int, float], None] | None
) -> dict[str, float]:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(base))
    model = Qwen2ForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.train()
    eos = int(tok.eos_token_id)
    math_data, code_data = _warmup_data(spec, tok, eos)
    rng = random.Random(f"warmup:{spec.seed}")

    def draw() -> tuple[list[int], list[int]]:
        pool = code_data if code_data and (not math_data or rng.random() < spec.code_fraction) else math_data
        return pool[rng.randrange(len(pool))]

    gen = torch.Generator().manual_seed(spec.seed)
    torch.manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / spec.warmup_steps) * max(0.05, 1 - s / spec.steps)
    )
    del gen
    loss_v = float("nan")
    for step in range(spec.steps):
        batch = [draw() for _ in range(spec.batch_size)]
        opt.zero_grad(set_to_none=True)
        loss_v = _backward(model, batch, spec.tokens_per_micro_batch, eos)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if progress is not None:
            progress(step, loss_v)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return {"final_loss": loss_v, "train_s": time.perf_counter() - t0}


def _warmup_data(
    spec: WarmupSpec, tok: object, eos: int
) -> tuple[list[tuple[list[int], list[int]]], list[tuple[list[int], list[int]]]]:
    """The (prompt ids, response ids + eos) pairs of the math and the code warm-up problems (a
    task's list is empty when ``code_fraction`` leaves it out)."""
    slips = random.Random(f"warmup-slips:{spec.seed}")

    def solution(ex: Any) -> str:
        if spec.slip_rate > 0 and slips.random() < spec.slip_rate:
            return synthetic_math.slipped_solution(ex, slips)
        return synthetic_math.reference_solution(ex)

    def pairs(prompts: list[str], solutions: list[str]) -> list[tuple[list[int], list[int]]]:
        return [
            (p, [*r, eos])
            for p, r in zip(encode_many(tok, prompts), encode_many(tok, solutions), strict=True)
        ]

    math_data: list[tuple[list[int], list[int]]] = []
    if spec.code_fraction < 1.0:
        exs = list(synthetic_math.generate(spec.task, seed=WARMUP_DATA_SEED_OFFSET + spec.seed))
        math_data = pairs([ex.prompt for ex in exs], [solution(ex) for ex in exs])
    code_data: list[tuple[list[int], list[int]]] = []
    if spec.code_fraction > 0.0:
        cexs = list(synthetic_code.generate(spec.code, seed=WARMUP_DATA_SEED_OFFSET + spec.seed))
        code_data = pairs([ex.prompt for ex in cexs], [synthetic_code.reference_solution(ex) for ex in cexs])
    return math_data, code_data


def _backward(model: Any, batch: Sequence[tuple[list[int], list[int]]], budget: int, eos: int) -> float:
    """Accumulate the gradient of the batch's mean response-token NLL, micro-batch by micro-batch
    (``budget`` padded tokens each); the loss.

    The same sums as a forward of the padded micro-batch with its attention mask and a loss over all
    logits, computed with less work: the padding is on the right, so under the causal mask no real
    token sees a pad and the mask is dropped (attention takes its causal fast path); the output head
    and the loss run on the rows that predict a response token only, not on prompt or pad rows.
    ``tests/tasks/test_warmup.py`` holds the step-by-step equality with the straightforward form.
    """
    import torch

    n_tokens = sum(len(r) for _, r in batch)
    total = 0.0
    for mb in _micro_batches(batch, budget):
        ids, labels, _attn = _pad(mb, eos)
        target = labels[:, 1:]
        rows = target != -100  # position t predicts token t + 1
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
        logits = model.lm_head(hidden[rows]).float()
        nll = torch.nn.functional.cross_entropy(logits, target[rows], reduction="sum")
        (nll / n_tokens).backward()
        total += float(nll.detach())
    return total / n_tokens


# the cost of one more forward/backward, in padded tokens: a micro-batch is ~300 small ops whose
# per-op cost grows when other jobs share the cores (2 threads at load ~7 here: 128 made a step
# slower than the greedy cut, 512 made it 1.4x faster)
MICRO_BATCH_OVERHEAD_TOKENS = 512


def _micro_batches(
    batch: Sequence[tuple[list[int], list[int]]], budget: int
) -> list[list[tuple[list[int], list[int]]]]:
    """Sort by length and cut into micro-batches whose padded size stays within ``budget`` tokens,
    at the cuts that minimise the padded tokens plus ``MICRO_BATCH_OVERHEAD_TOKENS`` per micro-batch
    (the experiment's long-tailed batches, cut greedily, pad ~31 % more tokens than they hold, in 2.8
    micro-batches; these cuts ~13 %, in 3.4).

    A sequence longer than ``budget`` gets a micro-batch of its own."""
    items = sorted(batch, key=lambda pr: len(pr[0]) + len(pr[1]))
    lengths = [len(p) + len(r) for p, r in items]
    # cost[j]: the least cost of items[:j]; start[j]: where the last micro-batch of that split starts
    cost = [0] + [-1] * len(items)
    start = [0] * (len(items) + 1)
    for j in range(1, len(items) + 1):
        for i in range(j - 1, -1, -1):
            if i < j - 1 and lengths[j - 1] * (j - i) > budget:
                break
            c = cost[i] + lengths[j - 1] * (j - i) + MICRO_BATCH_OVERHEAD_TOKENS
            if cost[j] < 0 or c < cost[j]:
                cost[j], start[j] = c, i
    out: list[list[tuple[list[int], list[int]]]] = []
    j = len(items)
    while j > 0:
        out.append(items[start[j] : j])
        j = start[j]
    return out[::-1]


def _pad(mb: Sequence[tuple[list[int], list[int]]], pad_id: int):  # type: ignore[no-untyped-def]
    import torch

    width = max(len(p) + len(r) for p, r in mb)
    ids = torch.full((len(mb), width), pad_id, dtype=torch.long)
    labels = torch.full((len(mb), width), -100, dtype=torch.long)
    attn = torch.zeros((len(mb), width), dtype=torch.long)
    for i, (p, r) in enumerate(mb):
        seq = p + r
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(r)
        attn[i, : len(seq)] = 1
    return ids, labels, attn
