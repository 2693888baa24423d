"""The judge offload plan: one test per invariant of ``rollpacker.core.judge_plan``."""

from __future__ import annotations

import itertools

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.core.judge_plan import (
    choose_resident_layers,
    judge_memory,
    resident_weight_bytes,
    stream_buffers,
)

MiB = 1 << 20
BASE = dict(layer_bytes=10 * MiB, fixed_bytes=5 * MiB, kv_bytes_per_token=1024, num_layers=8)


def _need(k: int, seq_len: int = 256, batch: int = 4, n_buffers: int = 2) -> int:
    return judge_memory(k, seq_len=seq_len, batch=batch, n_buffers=n_buffers, **BASE).total_bytes


def _choose(budget: int, seq_len: int = 256, batch: int = 4, n_buffers: int = 2) -> int:
    return choose_resident_layers(
        budget,
        BASE["layer_bytes"],
        BASE["fixed_bytes"],
        BASE["kv_bytes_per_token"],
        seq_len,
        batch,
        n_buffers,
        num_layers=BASE["num_layers"],
    )


def test_need_is_non_decreasing_in_k() -> None:
    for n_buffers in (1, 2, 3):
        needs = [_need(k, n_buffers=n_buffers) for k in range(9)]
        assert needs == sorted(needs), needs
    assert stream_buffers(8, 8) == 0 and stream_buffers(7, 8) == 1 and stream_buffers(0, 8) == 2


def test_weight_bytes_formula() -> None:
    # fixed + (k + buffers) layers; no buffer once every layer is resident
    assert resident_weight_bytes(0, 8, 10, 5) == 5 + 2 * 10
    assert resident_weight_bytes(3, 8, 10, 5) == 5 + 5 * 10
    assert resident_weight_bytes(7, 8, 10, 5) == 5 + 8 * 10
    assert resident_weight_bytes(8, 8, 10, 5) == 5 + 8 * 10
    assert resident_weight_bytes(2, 8, 10, 5, n_buffers=1) == 5 + 3 * 10


def test_result_fits_budget_and_is_maximal() -> None:
    lo, hi = _need(0), _need(8)
    for budget in range(lo, hi + 30 * MiB, MiB // 3):
        k = _choose(budget)
        assert 0 <= k <= 8
        assert _need(k) <= budget
        assert k == 8 or _need(k + 1) > budget


def test_exact_thresholds() -> None:
    act = 1024 * 256 * 4
    assert _choose(5 * MiB + 2 * 10 * MiB + act) == 0
    assert _choose(5 * MiB + 3 * 10 * MiB + act) == 1
    assert _choose(5 * MiB + 3 * 10 * MiB + act - 1) == 0
    # k = 7 needs the same as k = 8 (one buffer for the one offloaded layer): never stop at 6 needlessly
    assert _choose(5 * MiB + 8 * 10 * MiB + act) == 8


def test_monotone_in_budget() -> None:
    ks = [_choose(b) for b in range(_need(0), _need(8) + 5 * MiB, 257 * 1024)]
    assert ks == sorted(ks)
    assert ks[0] == 0 and ks[-1] == 8


def test_decreases_with_sequence_length_and_batch() -> None:
    budget = _need(5)
    by_len = [_choose(budget, seq_len=s) for s in (64, 256, 1024, 2048, 4096)]
    assert by_len == sorted(by_len, reverse=True) and by_len[0] > by_len[-1], by_len
    by_batch = [_choose(budget, batch=b) for b in (1, 4, 16, 32)]
    assert by_batch == sorted(by_batch, reverse=True) and by_batch[0] > by_batch[-1], by_batch
    for budget, s, b in itertools.product((_need(2), _need(6), _need(8)), (64, 512, 2048), (1, 8)):
        for s2, b2 in ((2 * s, b), (s, 2 * b), (2 * s, 2 * b)):
            if _need(0, seq_len=s2, batch=b2) <= budget:  # the longer shape still fits
                assert _choose(budget, seq_len=s, batch=b) >= _choose(budget, seq_len=s2, batch=b2)


def test_too_small_budget_raises_config_error_with_what_to_do() -> None:
    with pytest.raises(
        ConfigError, match=r"even with every layer offloaded.*raise the judge's memory budget"
    ):
        _choose(_need(0) - 1)
    with pytest.raises(ConfigError, match="too many"):
        _choose(_need(0, seq_len=100_000), seq_len=100_000 + 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(budget_bytes=-1), "budget_bytes"),
        (dict(layer_bytes=-1), "layer_bytes"),
        (dict(seq_len=-1), "seq_len"),
        (dict(batch=-1), "batch"),
        (dict(n_buffers=0), "n_buffers"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_invalid_arguments_raise_config_error(kwargs: dict[str, int], match: str) -> None:
    args = dict(
        budget_bytes=10**9,
        layer_bytes=10,
        fixed_bytes=5,
        kv_bytes_per_token=1,
        seq_len=8,
        batch=1,
        n_buffers=2,
        num_layers=4,
    )
    args.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        choose_resident_layers(**args)
