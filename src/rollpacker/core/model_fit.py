"""The config against the model's shape: every split and length the model cannot take, refused
before any slow work (warm-up, engine start, Ray, the store) by ``tasks.models.check_model``,
which reads the shape from ``model.model_dir``'s ``config.json`` or the tiny preset's spec.

Checked (each refusal names the setting and the model's number):

- the megatron backend (``train.backend: megatron``): ``train.megatron.tp`` divides the attention
  heads and the KV heads (each TP rank needs whole KV groups), ``train.megatron.pp`` is at most the
  layers and divides them (``split_refusal``; the gang checks the same before its ranks start);
- every TP the rollout engine may run (``engine.tensor_parallel_size``, or with layouts every
  power of two from ``planner.min_tp`` to ``planner.max_tp``): it divides the attention heads, and
  it divides the KV heads or is a multiple of them (vLLM replicates KV heads over larger TP groups);
- ``engine.max_model_len`` is at most the model's ``max_position_embeddings`` (vLLM refuses longer);
- the collective push's kept copy fits the rollout pods' ``/dev/shm`` (``core/sizing.py``,
  ``shm_refusal``; only where ``services.rollout_shm_gib`` declares it).

Invariants (tests/core/test_model_fit.py; purity: tests/core/test_purity.py):
- pure arithmetic on the config and the shape: the same answer on any machine, no model loaded;
- ``model_refusals`` returns every refusal at once, in the order above; none for the shipped configs;
- ``split_refusal`` is the one rule for a megatron split, here and in the gang.
"""

from __future__ import annotations

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.memory import ModelShape
from rollpacker.core.sizing import shm_refusal


def split_refusal(shape: ModelShape, tp: int, pp: int, where: str = "train.megatron") -> str:
    """Why the model cannot be split into TP ``tp`` x PP ``pp`` megatron ranks ("" when it can)."""
    if shape.heads % tp:
        return f"{where}.tp = {tp} does not divide the model's {shape.heads} attention heads"
    if shape.kv_heads % tp:
        return (
            f"{where}.tp = {tp} does not divide the model's {shape.kv_heads} KV heads (grouped-query "
            "attention: each TP rank needs whole KV groups)"
        )
    if pp > shape.layers:
        return f"{where}.pp = {pp} is larger than the model's {shape.layers} layers"
    if shape.layers % pp:
        return f"{where}.pp = {pp} does not divide the model's {shape.layers} layers"
    return ""


def engine_tps(cfg: ExperimentConfig) -> tuple[int, ...]:
    """Every tensor-parallel size the rollout engine may run: one engine of
    ``engine.tensor_parallel_size``, or with layouts (``planner.devices``) each power of two from
    ``planner.min_tp`` to ``planner.max_tp``."""
    if not cfg.planner.devices:
        return (cfg.engine.tensor_parallel_size,)
    out, tp = [], cfg.planner.min_tp
    while tp <= cfg.planner.max_tp:
        out.append(tp)
        tp *= 2
    return tuple(out)


def engine_tp_refusal(shape: ModelShape, tp: int, where: str) -> str:
    """Why vLLM cannot shard the model over ``tp`` ranks ("" when it can)."""
    if shape.heads % tp:
        return f"{where}: TP {tp} does not divide the model's {shape.heads} attention heads"
    if shape.kv_heads % tp and tp % shape.kv_heads:
        return (
            f"{where}: TP {tp} neither divides the model's {shape.kv_heads} KV heads nor is a multiple "
            "of them (vLLM splits or replicates whole KV heads)"
        )
    return ""


def model_refusals(cfg: ExperimentConfig, shape: ModelShape, max_positions: int, model: str) -> list[str]:
    """Every setting of ``cfg`` the model (``model``: its name in messages) cannot take."""
    out = []
    t = cfg.train
    if t.backend == "megatron":
        why = split_refusal(shape, t.megatron.tp, t.megatron.pp)
        out.append(why and f"{why} ({model})")
    where = "planner.min_tp..max_tp (layouts)" if cfg.planner.devices else "engine.tensor_parallel_size"
    for tp in engine_tps(cfg):
        why = engine_tp_refusal(shape, tp, where)
        out.append(why and f"{why} ({model})")
    if cfg.engine.max_model_len > max_positions:
        out.append(
            f"engine.max_model_len = {cfg.engine.max_model_len} exceeds the model's "
            f"max_position_embeddings = {max_positions} ({model}): lower it, or shorten the task"
        )
    out.append(shm_refusal(cfg, shape.params(), model))
    return [w for w in out if w]
