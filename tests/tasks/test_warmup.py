"""The warm-up's fast training step computes what the straightforward one computes."""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rollpacker.tasks import synthetic_code, synthetic_math
from rollpacker.tasks.tiny_model import TinyModelSpec, build_tiny_model
from rollpacker.tasks.warmup import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    WarmupSpec,
    _backward,
    _micro_batches,
    _pad,
    _warmup_data,
    encode,
    encode_many,
)

# two layers and two heads: attention across positions and grouped KV heads are exercised
SPEC = TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128)
Pair = tuple[list[int], list[int]]


def _reference_backward(model: Any, batch: Sequence[Pair], budget: int, eos: int) -> float:
    """The straightforward step: the padded micro-batch with its attention mask, logits at every
    position, the loss over the response positions; each micro-batch cut greedily."""
    import torch

    n_tokens = sum(len(r) for _, r in batch)
    items = sorted(batch, key=lambda pr: len(pr[0]) + len(pr[1]))
    mbs: list[list[Pair]] = [[]]
    for it in items:
        if mbs[-1] and max(len(p) + len(r) for p, r in [*mbs[-1], it]) * (len(mbs[-1]) + 1) > budget:
            mbs.append([])
        mbs[-1].append(it)
    total = 0.0
    for mb in mbs:
        ids, labels, attn = _pad(mb, eos)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            reduction="sum",
            ignore_index=-100,
        )
        (nll / n_tokens).backward()
        total += float(nll.detach())
    return total / n_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(SPEC, cache_dir=tmp_path_factory.mktemp("warm"))


def _long_tailed_batches(tok: Any, eos: int, n: int, size: int) -> list[list[Pair]]:
    """Batches of warm-up pairs with the long tail the warm-up sees (a few long solutions)."""
    spec = WarmupSpec(
        task=synthetic_math.SyntheticMathSpec(num_examples=200, hard_fraction=0.2, hard_min_steps=12),
        code=synthetic_code.SyntheticCodeSpec(num_examples=200),
        code_fraction=0.5,
    )
    math_data, code_data = _warmup_data(spec, tok, eos)
    rng = random.Random(0)
    pool = math_data + code_data
    return [[pool[rng.randrange(len(pool))] for _ in range(size)] for _ in range(n)]


def test_fast_step_matches_the_straightforward_step(model_dir: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    eos = int(tok.eos_token_id)
    torch.manual_seed(0)
    fast = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref = copy.deepcopy(fast)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.01) for m in (fast, ref)]
    budget = 1024
    batches = _long_tailed_batches(tok, eos, n=4, size=12)
    # the batches pad: the fast step's dropped mask and skipped rows are under test
    assert any(len({len(p) + len(r) for p, r in mb}) > 1 for b in batches for mb in _micro_batches(b, budget))
    for batch in batches:
        losses = []
        for m, opt, step in ((fast, opts[0], _backward), (ref, opts[1], _reference_backward)):
            opt.zero_grad(set_to_none=True)
            losses.append(step(m, batch, budget, eos))
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), name
    assert losses[0] < 5.0  # it learned something: the comparison is not of two untouched models


def test_micro_batches_keep_every_sequence_within_the_budget_with_less_padding() -> None:
    rng = random.Random(1)
    lengths = [rng.choice([20, 40, 60, 80]) for _ in range(28)] + [700, 900, 1200, 2500]
    batch: list[Pair] = [([1] * (n - 5), [2] * 5) for n in lengths]
    budget = 2048
    mbs = _micro_batches(batch, budget)
    assert sorted(len(p) + len(r) for mb in mbs for p, r in mb) == sorted(lengths)
    widths = [max(len(p) + len(r) for p, r in mb) for mb in mbs]
    for mb, w in zip(mbs, widths, strict=True):
        assert w * len(mb) <= budget or len(mb) == 1  # only a sequence over the budget stands alone
    assert [len(mb) for mb, w in zip(mbs, widths, strict=True) if w == 2500] == [1]
    # the greedy cut (fill each micro-batch to the budget) pads these far more
    greedy_padded, greedy_count, cur = 0, 1, []
    for n in sorted(lengths):
        if cur and max([*cur, n]) * (len(cur) + 1) > budget:
            greedy_padded += max(cur) * len(cur)
            greedy_count, cur = greedy_count + 1, []
        cur.append(n)
    greedy_padded += max(cur) * len(cur)
    padded = sum(w * len(mb) for mb, w in zip(mbs, widths, strict=True))
    assert padded < greedy_padded
    assert len(mbs) <= greedy_count + 1  # not bought with many more forwards
    over = MICRO_BATCH_OVERHEAD_TOKENS
    assert padded + over * len(mbs) < greedy_padded + over * greedy_count
    assert padded < 1.1 * sum(lengths)
    assert _micro_batches([], budget) == []


def test_encode_many_is_encode_per_text(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = ["12+3=15\n", "", "def f(x):\n    return x * 2  # ok", "é!<|endoftext|>"]
    assert encode_many(tok, texts) == [encode(tok, t) for t in texts]
    assert encode_many(tok, []) == []
