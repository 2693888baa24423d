"""The per-rank memory preflight (``core/memory.py``) on the shipped cluster sizes: Qwen2.5
7B / 14B / 32B with the layouts of docs/operations.md on 80 GB GPUs."""

from __future__ import annotations

import dataclasses

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.memory import GIB, MemoryPlan, ModelShape, check_fits, estimate

# the shape keys of the models' config.json (Hugging Face Qwen/Qwen2.5-*)
QWEN25 = {
    "7B": {"num_hidden_layers": 28, "hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False},
    "14B": {"num_hidden_layers": 48, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 13824, "vocab_size": 152064, "tie_word_embeddings": False},
    "32B": {"num_hidden_layers": 64, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 8,
            "intermediate_size": 27648, "vocab_size": 152064, "tie_word_embeddings": False},
}  # fmt: skip
# docs/operations.md: (tp, pp, dp) of the training group; dp = world_size / (tp * pp)
LAYOUTS = {"7B": (2, 1, 4), "14B": (2, 2, 4), "32B": (4, 1, 8)}
EIGHT_K = 8192 + 1024  # rollout.max_tokens + prompt: engine.max_model_len of configs/cluster.yaml


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(QWEN25[name])


def plan(name: str, longest: int = EIGHT_K, **kw: object) -> MemoryPlan:
    tp, pp, dp = LAYOUTS[name]
    args: dict[str, object] = {"dtype": "bfloat16", "recompute": "full", "tokens_per_micro_batch": longest}
    args.update(kw)
    return MemoryPlan(tp=tp, pp=pp, dp=dp, longest_tokens=longest, **args)  # type: ignore[arg-type]


def test_parameter_counts_match_the_published_models() -> None:
    assert shape("7B").params() == 7_615_616_512  # Qwen2.5-7B's safetensors total
    assert shape("14B").params() == pytest.approx(14.77e9, rel=1e-3)
    assert shape("32B").params() == pytest.approx(32.76e9, rel=1e-3)


@pytest.mark.parametrize(("name", "gib"), [("7B", 80), ("14B", 80), ("32B", 141)])
def test_shipped_sizing_fits_with_recompute_and_bf16_at_8k(name: str, gib: int) -> None:
    """7B TP=2 and 14B TP=2 x PP=2 fit an 80 GB GPU; 32B TP=4 needs a 141 GB one (H200) with the
    unfused attention of the local layer spec, or TP=8 on 80 GB."""
    est = check_fits(shape(name), plan(name, gpu_memory_gib=gib))
    assert est.total <= gib * GIB
    if name == "32B":
        with pytest.raises(ConfigError, match=r"more than gpu_memory_gib = 80"):
            check_fits(shape(name), plan(name))
        tp8 = dataclasses.replace(plan(name), tp=8, dp=4)
        assert check_fits(shape(name), tp8).total <= 80 * GIB


@pytest.mark.parametrize("name", ["7B", "14B", "32B"])
def test_fp32_without_recompute_is_refused_at_8k_naming_the_numbers(name: str) -> None:
    p = plan(name, dtype="float32", recompute="none")
    total = estimate(shape(name), p).total / GIB
    with pytest.raises(ConfigError) as e:
        check_fits(shape(name), p)
    msg = str(e.value)
    assert f"needs {total:.1f} GiB on pipeline stage" in msg and "more than gpu_memory_gib = 80" in msg
    for term in ("weights", "grads", "optimizer", "activations", "transient", "reserve"):
        assert term in msg
    assert f"longest sequence {EIGHT_K} tokens" in msg and "recompute none" in msg
    assert "train.megatron.recompute: selective or full" in msg and "train.megatron.dtype: bfloat16" in msg


@pytest.mark.parametrize(("name", "longest"), [("14B", 16384 + 1024), ("32B", 32768 + 1024)])
def test_the_papers_long_contexts_do_not_fit_with_unfused_attention(name: str, longest: int) -> None:
    """14B at 16k and 32B at 32k: one layer's attention backward alone (``heads / tp x seq^2``
    scores) exceeds what is left of 80 GB, even with full recompute and bf16."""
    est = estimate(shape(name), plan(name, longest))
    assert est.transient > 40 * GIB
    with pytest.raises(ConfigError, match=r"transient"):
        check_fits(shape(name), plan(name, longest))


def test_invariant_the_estimate_never_decreases_as_the_plan_grows() -> None:
    s = shape("7B")
    base = plan("7B", 4096, recompute="selective")
    totals = [estimate(s, dataclasses.replace(base, longest_tokens=n)).total for n in (1024, 4096, 9216)]
    assert totals == sorted(totals) and totals[0] < totals[-1]
    mbs = [
        estimate(s, dataclasses.replace(base, tokens_per_micro_batch=n)).total for n in (4096, 8192, 16384)
    ]
    assert mbs == sorted(mbs) and mbs[0] < mbs[-1]
    modes = [estimate(s, dataclasses.replace(base, recompute=r)).total for r in ("full", "selective", "none")]
    assert modes == sorted(modes) and modes[0] < modes[-1]
    deeper = dataclasses.replace(s, layers=2 * s.layers)
    assert estimate(deeper, base).total > estimate(s, base).total
    assert estimate(s, dataclasses.replace(base, dp=8)).total < estimate(s, base).total  # optimizer shards


def test_bad_plans_and_shapes_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"recompute = 'some'"):
        plan("7B", recompute="some")
    with pytest.raises(ConfigError, match=r"dtype = 'float16'"):
        plan("7B", dtype="float16")
    with pytest.raises(ConfigError, match=r"no 'intermediate_size'"):
        ModelShape.from_hf_config({k: v for k, v in QWEN25["7B"].items() if k != "intermediate_size"})


@pytest.mark.parametrize(("name", "longest", "tp"), [("14B", 16384 + 1024, 2), ("32B", 32768 + 1024, 8)])
def test_the_papers_long_contexts_fit_with_the_fused_attention(name: str, longest: int, tp: int) -> None:
    """With ``attention: sdpa`` nothing is quadratic in the sequence: 14B TP=2 x PP=2 x DP=4 at 16k
    (16 GPUs) and 32B at 32k with TP=8 x DP=4 (32 GPUs) fit 80 GB with full recompute and bf16."""
    p = dataclasses.replace(plan(name, longest, attention="sdpa"), tp=tp, dp=4)
    assert check_fits(shape(name), p).total <= 80 * GIB
    twice = dataclasses.replace(p, longest_tokens=2 * longest, tokens_per_micro_batch=2 * longest)
    growth = estimate(shape(name), twice).activations / estimate(shape(name), p).activations
    assert growth == pytest.approx(2.0, rel=0.01)  # linear, not 4x
