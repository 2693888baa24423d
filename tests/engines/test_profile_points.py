"""A profile point lost to the race between replicas is measured again before it is skipped
(engines/profiler.py): on a busy machine one replica's engine core can lag another's by a whole
decode window, which loses the point for that try only."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from rollpacker.core.latency import Layout, ProfilePoint
from rollpacker.engines import profiler
from rollpacker.engines.profiler import POINT_TRIES, ProfileSpec, _measure_point_again_if_lost, _PointLost

POINT = ProfilePoint(batch=4, context=192, tokens=800.0, prefill_s=1.0, decode_s=0.01)


def _lose(times: int, calls: list[str]):
    def measure(eng, rng, tag, batch, length, window, max_model_len):
        calls.append(tag)
        if len(calls) <= times:
            raise _PointLost(f"profile point B={batch} L={length}: lost")
        return POINT

    return measure


@pytest.mark.parametrize("lost", [0, 1, POINT_TRIES - 1])
def test_a_point_lost_to_the_race_is_measured_again(monkeypatch: pytest.MonkeyPatch, lost: int) -> None:
    calls: list[str] = []
    said: list[str] = []
    monkeypatch.setattr(profiler, "measure_point", _lose(lost, calls))
    spec = ProfileSpec(layouts=(Layout(tp=1, dp=2),), window=8)
    cfg = SimpleNamespace(max_model_len=200)
    p = _measure_point_again_if_lost(None, random.Random(0), "t", 4, 192, spec, cfg, said.append)  # type: ignore[arg-type]
    assert p == POINT
    assert len(calls) == lost + 1 and len(set(calls)) == len(calls)  # request ids are single-use
    assert len(said) == lost


def test_a_point_lost_every_time_is_skipped_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    said: list[str] = []
    monkeypatch.setattr(profiler, "measure_point", _lose(POINT_TRIES, calls))
    spec = ProfileSpec(layouts=(Layout(tp=1, dp=2),), window=8)
    cfg = SimpleNamespace(max_model_len=200)
    assert _measure_point_again_if_lost(None, random.Random(0), "t", 4, 192, spec, cfg, said.append) is None  # type: ignore[arg-type]
    assert len(calls) == POINT_TRIES and len(said) == POINT_TRIES
    assert all("B=4 L=192" in m and f"of {POINT_TRIES}" in m for m in said)
