"""Layer-wise pipelined offload: numerics equal the resident model, memory shrinks as measured.

Every equality check compares against the plain resident model loaded from the same directory,
and the tests at the end show that the comparison catches a broken offload (a layer computed with
the wrong layer's weights, or a buffer used before its copy finished).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from rollpacker.core.errors import ConfigError
from rollpacker.rewards.offload import (
    HostLayerStore,
    OffloadedCausalLM,
    OffloadMode,
    all_weight_bytes,
    bench_offload,
    load_resident,
)
from rollpacker.tasks.judge_task import judge_pairs, verdict_logits
from rollpacker.tasks.tiny_model import build_tiny_model

TOL = 1e-5
MODES = [OffloadMode.PIPELINED, OffloadMode.NAIVE]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model("tiny")  # 4 layers, hidden 256; random weights suffice for numerics


@pytest.fixture(scope="module")
def resident(model_dir: Path):
    return load_resident(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of different lengths, right-padded, with an attention mask."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 250, (3, 37), generator=gen)
    attn = torch.ones_like(ids)
    attn[1, 21:] = 0
    attn[2, 30:] = 0
    return ids, attn


def _logits(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn).logits


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (a - b).abs().max()
    return float("inf") if torch.isnan(d) else float(d)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("k", [0, 1, 3, 4])  # none, one, all but one, all resident (of 4)
def test_offloaded_logits_equal_resident(model_dir, resident, mode, k) -> None:
    ids, attn = _batch()
    ref = _logits(resident, ids, attn)
    with OffloadedCausalLM(model_dir, k, mode=mode) as runner:
        for _ in range(2):  # the second forward re-streams into buffers that hold the last layers
            assert _diff(_logits(runner.model, ids, attn), ref) <= TOL
        assert runner.stats().layers_streamed == 2 * (4 - k)


@pytest.mark.parametrize("n_buffers", [1, 2, 3])
def test_any_number_of_buffers_is_exact(model_dir, resident, n_buffers) -> None:
    ids, attn = _batch()
    with OffloadedCausalLM(model_dir, 0, n_buffers=n_buffers) as runner:
        assert _diff(_logits(runner.model, ids, attn), _logits(resident, ids, attn)) <= TOL


def test_batched_judge_scores_equal_per_sample_and_resident(model_dir, resident, tokenizer) -> None:
    prompts = [p.prompt() for p in judge_pairs(6, seed=3)]
    prompts[0] = prompts[0][:20]  # rows of very different lengths: padding matters
    with torch.no_grad():
        ref_batched = verdict_logits(resident, tokenizer, prompts)
        ref_single = torch.cat([verdict_logits(resident, tokenizer, [p]) for p in prompts])
        assert _diff(ref_batched, ref_single) <= TOL
        for k in (0, 2):
            with OffloadedCausalLM(model_dir, k) as runner:
                assert _diff(verdict_logits(runner.model, tokenizer, prompts), ref_batched) <= TOL
                single = torch.cat([verdict_logits(runner.model, tokenizer, [p]) for p in prompts])
                assert _diff(single, ref_single) <= TOL


@pytest.mark.parametrize("n_buffers", [1, 2])
def test_peak_resident_weight_bytes_shrink_with_offloaded_layers(model_dir, resident, n_buffers) -> None:
    ids, attn = _batch()
    full = all_weight_bytes(resident)
    # independent measurements of a layer's and of the fixed part's bytes, from the resident model
    layer = sum(p.numel() * p.element_size() for p in resident.model.layers[0].parameters())
    fixed = full - 4 * layer
    peaks = {}
    for k in range(5):
        with OffloadedCausalLM(model_dir, k, n_buffers=n_buffers) as runner:
            runner.reset_stats()
            _logits(runner.model, ids, attn)
            peak = runner.stats().peak_resident_weight_bytes
            assert (runner.layer_bytes, runner.fixed_bytes) == (layer, fixed)
        slots = k + min(n_buffers, 4 - k)
        assert abs(peak - (fixed + slots * layer)) <= 0.01 * full, (k, peak)
        peaks[k] = peak
    assert peaks[4] == full
    assert peaks[0] < full - (4 - n_buffers - 0.1) * layer  # all streamed: only the buffers
    assert [peaks[k] for k in range(5)] == sorted(peaks.values())


def test_offloaded_layers_are_not_held_by_the_compute_set(model_dir) -> None:
    with OffloadedCausalLM(model_dir, 1) as runner:
        layers = runner.model.model.layers
        assert sum(1 for _ in layers[0].parameters()) > 0
        assert all(sum(1 for _ in layers[j].parameters()) == 0 for j in range(1, 4))
        host = {t.untyped_storage().data_ptr() for d in runner.host.layers for t in d.values()}
        compute = {t.untyped_storage().data_ptr() for t in runner._compute_set()}
        assert not host & compute


def test_set_resident_layers_moves_layers_and_keeps_numerics(model_dir, resident) -> None:
    ids, attn = _batch()
    ref = _logits(resident, ids, attn)
    with OffloadedCausalLM(model_dir, 4) as runner:
        for k in (0, 3, 1, 4, 2):
            runner.set_resident_layers(k)
            runner.reset_stats()
            assert _diff(_logits(runner.model, ids, attn), ref) <= TOL
            assert runner.stats().peak_resident_weight_bytes == runner.expected_weight_bytes(k)
        with pytest.raises(ConfigError, match=r"must be in \[0, 4\]"):
            runner.set_resident_layers(5)


def test_from_budget_offloads_more_for_longer_sequences(model_dir) -> None:
    with OffloadedCausalLM(model_dir, 0) as probe:
        budget = probe.expected_weight_bytes(1) + probe.kv_bytes_per_token() * 64 * 4
        k_short = probe.plan(budget, seq_len=64, batch=4)
        k_long = probe.plan(budget, seq_len=96, batch=4)
        too_small = probe.expected_weight_bytes(0) - 1
    assert (k_short, k_long) == (1, 0)
    with pytest.raises(ConfigError, match="even with every layer offloaded"):
        OffloadedCausalLM.from_budget(model_dir, too_small, seq_len=64, batch=4).close()
    with OffloadedCausalLM.from_budget(model_dir, budget, seq_len=64, batch=4) as runner:
        assert runner.resident_layers == 1


def test_close_is_idempotent_and_forward_after_close_raises(model_dir) -> None:
    ids, attn = _batch()
    runner = OffloadedCausalLM(model_dir, 1)
    _logits(runner.model, ids, attn)
    runner.close()
    runner.close()
    assert runner._executor is None
    with pytest.raises(RuntimeError, match="closed"):
        _logits(runner.model, ids, attn)


def test_bad_arguments_raise_config_error(model_dir) -> None:
    with pytest.raises(ConfigError, match="resident_layers"):
        OffloadedCausalLM(model_dir, 5)
    with pytest.raises(ConfigError, match="n_buffers"):
        OffloadedCausalLM(model_dir, 1, n_buffers=0)
    with pytest.raises(ConfigError, match=r"no \*\.safetensors file"):
        HostLayerStore(model_dir / "no-such-dir", 4)


# --- a broken offload is caught by the comparison with the resident model ---------------------------


class _WrongLayer(OffloadedCausalLM):
    """Broken: streams layer j+1's weights when layer j is due (an off-by-one in the schedule)."""

    def _copy_layer(self, j: int, slot: int) -> float:
        return super()._copy_layer(min(j + 1, self.num_layers - 1), slot)


class _NoWait(OffloadedCausalLM):
    """Broken: computes a layer without waiting for its copy, which lands only after the compute.
    Here that happens for certain (not by a sleep a loaded machine may outlast) and with no thread
    racing the compute: each layer's copy is made when its compute is over, so a streamed layer
    computes with what its buffer held before: with 2 buffers for layers 1..3, layer 1 computes with
    layer 3's weights from the previous forward."""

    def _copy_layer(self, j: int, slot: int) -> float:
        return 0.0  # the scheduled copy: made at the end of the layer's compute instead (_exit)

    def _wait_copied(self, j: int) -> None:
        self._copy_futs.pop(j, None)  # never waits: the bug

    def _exit(self, j: int) -> None:
        super()._copy_layer(j, self._slot_index(j))
        super()._exit(j)


@pytest.mark.parametrize("broken", [_WrongLayer, _NoWait], ids=["wrong_layer", "no_wait"])
def test_a_broken_offload_is_caught(model_dir, resident, broken) -> None:
    ids, attn = _batch()
    ref = _logits(resident, ids, attn)
    with broken(model_dir, 1) as runner:
        _logits(runner.model, ids, attn)  # the second forward: buffers hold real (wrong) layers
        assert _diff(_logits(runner.model, ids, attn), ref) > 1e-3


def test_the_slow_copy_is_waited_for_when_not_broken(model_dir, resident) -> None:
    class SlowCopy(OffloadedCausalLM):
        """Each copy starts only once the compute thread waits for it, and takes 50 ms more."""

        def _begin(self) -> None:
            self._waiting = {j: threading.Event() for j in range(self.num_layers)}
            super()._begin()

        def _copy_layer(self, j: int, slot: int) -> float:
            self._waiting[j].wait(timeout=60)
            time.sleep(0.05)
            return super()._copy_layer(j, slot)

        def _wait_copied(self, j: int) -> None:
            self._waiting[j].set()
            super()._wait_copied(j)

    ids, attn = _batch()
    with SlowCopy(model_dir, 1) as runner:
        assert _diff(_logits(runner.model, ids, attn), _logits(resident, ids, attn)) <= TOL
        assert runner.stats().wait_s > 0.04 * 3  # three streamed layers, each waited for


def test_bench_offload_reports_every_mode(tmp_path) -> None:
    report = bench_offload("micro", batch=1, seq_len=16, resident_layers=0, repeats=1, cache_dir=tmp_path)
    assert set(report) == {"config", "resident", "naive", "pipelined"}
    for name in ("naive", "pipelined"):
        assert report[name]["max_abs_diff"] <= TOL
        assert report[name]["peak_resident_weight_bytes"] == report[name]["expected_weight_bytes"]
        assert report[name]["time_s"] > 0
    assert report["naive"]["peak_resident_weight_bytes"] < report["resident"]["peak_resident_weight_bytes"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cuda_offload_equals_resident_and_uses_less_device_memory(model_dir, mode) -> None:
    ids, attn = (t.cuda() for t in _batch())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    resident = load_resident(model_dir, "cuda")
    ref = _logits(resident, ids, attn)
    torch.cuda.synchronize()
    resident_peak = torch.cuda.max_memory_allocated()
    full = all_weight_bytes(resident)
    del resident
    torch.cuda.empty_cache()
    with OffloadedCausalLM(model_dir, 0, mode=mode, device="cuda") as runner:
        runner.reset_stats()
        for _ in range(3):
            out = _logits(runner.model, ids, attn)
        torch.cuda.synchronize()
        assert _diff(out, ref) <= TOL
        st = runner.stats()
        assert (
            st.peak_resident_weight_bytes == runner.expected_weight_bytes() == full - 2 * runner.layer_bytes
        )
        assert st.peak_cuda_allocated_bytes is not None
        # two of four layers never reach the device (k = 0, two buffers)
        assert st.peak_cuda_allocated_bytes < resident_peak - runner.layer_bytes
        assert all(t.is_pinned() for d in runner.host.layers for t in d.values())
