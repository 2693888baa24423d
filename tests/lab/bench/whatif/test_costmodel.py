"""core.costmodel: spec files refused by name, the roofline's physics, the profile adapter."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from rollpacker.core.costmodel import (
    HardwareSpec,
    ModelSpec,
    ProfileCost,
    RooflineCost,
    SpecError,
    decode_run_s,
)
from rollpacker.core.errors import ConfigError
from rollpacker.core.latency import Layout, Predictor, ProfileTable
from rollpacker.lab.bench.whatif.specfiles import HARDWARE_DIR, MODELS_DIR, load_hardware, load_model, shipped

DATA = Path(__file__).resolve().parents[3] / "data"


def _raw(kind_dir: Path, name: str) -> dict:
    return yaml.safe_load((kind_dir / f"{name}.yaml").read_text())


def test_every_shipped_spec_loads_and_cites_every_number() -> None:
    hws, models = shipped(HARDWARE_DIR), shipped(MODELS_DIR)
    assert {"h100", "h800", "h200", "a100"} <= set(hws)
    assert {"qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"} <= set(models)
    for name in hws:
        hw = load_hardware(name)
        assert hw.memory_bandwidth_gb_s > 0 and set(hw.sources) >= {
            "memory_bandwidth_gb_s",
            "peak_bf16_tflops",
        }
    for name in models:
        m = load_model(name)
        assert abs(m.derived_params - m.num_params) / m.num_params < 0.01
        assert "num_params" in m.sources


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("memory_bandwidth_gb_s", 0, r"'memory_bandwidth_gb_s' = 0: must be > 0"),
        ("memory_bandwidth_gb_s", -3.35, r"'memory_bandwidth_gb_s' = -3.35: must be > 0"),
        ("peak_bf16_tflops", "fast", r"'peak_bf16_tflops' = 'fast': must be a number"),
        ("bandwidth_efficiency", 1.5, r"'bandwidth_efficiency' = 1.5: must be in \(0, 1\]"),
        ("devices_per_node", 0, r"'devices_per_node' = 0: must be an integer >= 1"),
    ],
)
def test_a_non_physical_hardware_field_is_refused_by_name(field: str, value: object, match: str) -> None:
    d = _raw(HARDWARE_DIR, "h800")
    d[field] = value
    with pytest.raises(SpecError, match=match):
        HardwareSpec.from_mapping(d, "bad.yaml")


def test_missing_unknown_and_uncited_fields_are_refused_by_name() -> None:
    d = _raw(HARDWARE_DIR, "h100")
    missing = {k: v for k, v in d.items() if k != "memory_gib"}
    with pytest.raises(SpecError, match=r"bad.yaml: missing field 'memory_gib'"):
        HardwareSpec.from_mapping(missing, "bad.yaml")
    with pytest.raises(SpecError, match=r"unknown field 'memory_bw'"):
        HardwareSpec.from_mapping({**d, "memory_bw": 1}, "bad.yaml")
    uncited = copy.deepcopy(d)
    del uncited["sources"]["peak_bf16_tflops"]
    with pytest.raises(SpecError, match=r"'peak_bf16_tflops' has no source"):
        HardwareSpec.from_mapping(uncited, "bad.yaml")


def test_a_model_whose_shapes_do_not_add_up_is_refused() -> None:
    d = _raw(MODELS_DIR, "qwen2.5-7b")
    with pytest.raises(SpecError, match=r"'num_params' = 7,615,616,512 but the shapes add up to"):
        ModelSpec.from_mapping({**d, "hidden_size": 4096}, "bad.yaml")
    with pytest.raises(SpecError, match=r"not a multiple of num_kv_heads"):
        ModelSpec.from_mapping({**d, "num_kv_heads": 5}, "bad.yaml")
    with pytest.raises(SpecError, match=r"'tie_word_embeddings' = 'no'"):
        ModelSpec.from_mapping({**d, "tie_word_embeddings": "no"}, "bad.yaml")


def test_unknown_names_and_bad_files_are_refused_with_what_exists(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"unknown model 'qwen9-1t'.*qwen2.5-7b"):
        load_model("qwen9-1t")
    with pytest.raises(SpecError, match=r"unknown hardware 'b300'.*h800"):
        load_hardware("b300")
    bad = tmp_path / "mine.yaml"
    d = _raw(HARDWARE_DIR, "h800")
    d["memory_bandwidth_gb_s"] = 0
    bad.write_text(yaml.safe_dump(d))
    with pytest.raises(SpecError, match=rf"{bad}: field 'memory_bandwidth_gb_s'"):
        load_hardware(str(bad))
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_hardware(str(bad))


def _cost(tp: int = 1, hw: str = "h800", model: str = "qwen2.5-7b") -> RooflineCost:
    return RooflineCost(load_hardware(hw), load_model(model), tp)


def test_decode_is_monotone_in_batch_and_context() -> None:
    c = _cost(2)
    by_batch = [c.decode_s(b, 1000.0 * b) for b in (1, 2, 8, 32, 128, 512, 2048)]
    by_ctx = [c.decode_s(64, t) for t in (0, 1e3, 1e4, 1e5, 1e6)]
    assert by_batch == sorted(by_batch) and by_batch[-1] > by_batch[0]
    assert by_ctx == sorted(by_ctx) and by_ctx[-1] > by_ctx[0]


def test_batch_one_is_memory_bound_weights_over_bandwidth() -> None:
    hw, m = load_hardware("h800"), load_model("qwen2.5-7b")
    c = RooflineCost(hw, m, 1)
    expect = hw.step_overhead_s + (m.weight_bytes + 100 * m.kv_bytes_per_token) / (
        hw.memory_bandwidth_gb_s * 1e9 * hw.bandwidth_efficiency
    )
    assert c.decode_s(1, 100) == pytest.approx(expect, rel=1e-12)
    # a 7B model in bf16 on 3.35 TB/s: a few ms per token, as measured on Hopper
    assert 0.004 < c.decode_s(1, 100) < 0.012


def test_more_tp_never_slows_the_memory_bound_part() -> None:
    hw, m = load_hardware("h800"), load_model("qwen2.5-14b")
    bw = hw.memory_bandwidth_gb_s * 1e9 * hw.bandwidth_efficiency
    prev = float("inf")
    for tp in (1, 2, 4, 8):
        c = RooflineCost(hw, m, tp)
        mem = (m.weight_bytes / tp + 5e4 * m.kv_bytes_per_token / min(tp, m.num_kv_heads)) / bw
        assert mem <= prev
        prev = mem
        assert c.kv_capacity_tokens > 0


def test_a_model_that_does_not_fit_is_refused_naming_the_tp_it_needs() -> None:
    d = _raw(HARDWARE_DIR, "a100")
    small = HardwareSpec.from_mapping({**d, "memory_gib": 16.0}, "small.yaml")
    with pytest.raises(ConfigError, match=r"leaves no KV cache on 1 x a100.*use tp >= "):
        RooflineCost(small, load_model("qwen2.5-32b"), 1)
    with pytest.raises(ConfigError, match="do not split evenly"):
        RooflineCost(load_hardware("h800"), load_model("qwen2.5-7b"), 8)


def test_decode_run_is_exact_where_the_cost_is_linear_in_context() -> None:
    c = _cost(1)
    batch, tokens, steps = 16, 4000.0, 37
    by_step = sum(c.decode_s(batch, tokens + i * batch) for i in range(steps))
    assert decode_run_s(c, batch, tokens, steps) == pytest.approx(by_step, rel=1e-9)
    assert decode_run_s(c, 0, tokens, steps) == 0.0


def test_profile_cost_returns_the_measured_value_on_a_profiled_point() -> None:
    doc = json.loads((DATA / "profile_cpu_tiny.json").read_text())
    table = ProfileTable.from_dict(doc.get("table", doc))
    lay = table.layouts[0]
    cost = ProfileCost(Predictor(table), lay.layout)
    p = lay.points[3]
    assert cost.decode_s(p.batch, p.tokens) == pytest.approx(p.decode_s)
    assert cost.tp == lay.layout.tp and cost.kv_capacity_tokens == lay.kv_capacity_tokens
    with pytest.raises(ConfigError, match="the profile has no tp8dp1"):
        ProfileCost(Predictor(table), Layout(8, 1))


def test_profile_prefill_is_what_a_prefill_adds_to_a_running_step() -> None:
    doc = json.loads((DATA / "profile_cpu_tiny.json").read_text())
    table = ProfileTable.from_dict(doc.get("table", doc))
    lay = table.layouts[0].layout
    pred = Predictor(table)
    cost = ProfileCost(pred, lay)
    shortest = min(p.context for p in table.layouts[0].points)
    assert cost.prefill_s([shortest]) == 0.0  # the fixed submit-to-first-step latency is not paid
    assert cost.prefill_s([]) == 0.0
    assert cost.prefill_s([768]) == pytest.approx(
        pred.prefill_s(lay, 1, 768) - pred.prefill_s(lay, 1, shortest)
    )
    assert cost.prefill_s([256] * 4) > cost.prefill_s([64] * 4) > 0
