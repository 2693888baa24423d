"""The speculation benchmark's summary and table (the measurement itself needs the real engine)."""

from __future__ import annotations

import pytest

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.speculation import _summary, render, run_speculation_bench
from rollpacker.lab.bench.tables import MAX_COLUMNS


def _row(
    batch: int, arm: str, tokens: float, seconds: float, drafted: float = 0, accepted: float = 0
) -> dict:
    return {
        "batch": batch,
        "repeat": 0,
        "arm": arm,
        "tokens": tokens,
        "seconds": seconds,
        "drafted": drafted,
        "accepted": accepted,
        "draft_s": 0.1 if drafted else 0.0,
    }


def test_summary_pools_repeats_and_divides_the_arms() -> None:
    rows = [_row(4, "off", 100, 1.0), _row(4, "off", 300, 1.0), _row(4, "on", 400, 1.0, 100, 60)]
    (s,) = _summary(rows)
    assert s["off_tokens_per_s"] == 200 and s["on_tokens_per_s"] == 400
    assert s["speedup"] == 2.0 and s["acceptance"] == 0.6 and s["draft_share"] == pytest.approx(0.1)


def test_the_table_fits_and_explains_itself() -> None:
    rows = [_row(b, a, 100.0, 1.0, 10, 5) for b in (1, 4, 32) for a in ("off", "on")]
    report = {
        "rows": rows,
        "summary": _summary(rows),
        "settings": {
            "config_task": "mixed",
            "max_tokens": 1700,
            "temperature": 0.0,
            "repeats": 2,
            "speculation": {"max_draft_tokens": 4},
        },
    }
    text = render(report)
    assert "measured on the real engine" in text and "legend:" in text and "acceptance" in text
    assert max(len(line) for line in text.splitlines()) <= MAX_COLUMNS


@pytest.mark.parametrize(("batches", "temperature"), [((), 0.0), ((0,), 0.0), ((4,), -1.0)])
def test_bad_settings_are_refused_before_any_model_is_built(
    batches: tuple[int, ...], temperature: float
) -> None:
    with pytest.raises(ConfigError, match="batch sizes"):
        run_speculation_bench(ExperimentConfig(), batches, temperature=temperature)
