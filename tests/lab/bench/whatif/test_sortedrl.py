"""SortedRL's experiment on the simulator (bench.whatif.sortedrl): oversubscription, the two
throughputs, the paper's checks. Small cases (64 prompts), ~2 s."""

from __future__ import annotations

import pytest

from rollpacker.core.errors import ConfigError
from rollpacker.lab.bench.whatif.papers import run_papers
from rollpacker.lab.bench.whatif.sortedrl import SortedRLCase, checks, render_sortedrl, run_case


@pytest.fixture(scope="module")
def rows() -> dict:
    """One group of 4 x 16 prompts, Q = 16 = the rollout batch (the paper's shape, scaled down)."""
    return run_case(SortedRLCase(batch=16, groups=1, q=16))


def test_the_sorted_arms_keep_the_simulated_engine_at_q_until_the_group_drains(rows) -> None:
    """Every round of a group but its last owes at least Q requests: eq. 4 over them is exactly 0
    (no slot idles while the buffer holds more than Q requests' worth of work)."""
    for arm in ("sorted", "sorted_partial"):
        assert rows[arm]["bubble_ratio_before_drain"] == pytest.approx(0.0, abs=1e-9), arm
        assert rows[arm]["bubble_ratio"] < rows["sync"]["bubble_ratio"] / 2, arm
    assert rows["sync"]["bubble_ratio_before_drain"] is None


def test_both_throughputs_per_arm_and_the_same_tokens_trained(rows) -> None:
    assert {r["tokens_trained"] for r in rows.values()} == {rows["sync"]["tokens_trained"]}
    on, part = rows["sorted"], rows["sorted_partial"]
    assert on["wasted_share"] > 0 and on["output_x"] > on["trained_x"] > 1.0  # it regenerates
    assert part["wasted_share"] == 0 and part["output_x"] == pytest.approx(part["trained_x"])
    assert rows["sync"]["output_x"] == rows["sync"]["trained_x"] == 1.0


def test_the_paper_checks_apply_each_figures_bar() -> None:
    def row(bubble: float, x: float | None) -> dict:
        return {"bubble_ratio": bubble, "output_x": x}

    ok = checks({"sync": row(0.70, 1.0), "sorted": row(0.10, 1.2), "sorted_partial": row(0.03, 1.1)})
    assert [k["ok"] for k in ok.values()] == [True, True, True, True, False]
    bad = checks({"sync": row(0.68, 1.0), "sorted": row(0.11, None), "sorted_partial": row(0.03, 1.4)})
    assert [k["ok"] for k in bad.values()] == [False, False, False, True, True]


def test_the_report_renders_and_an_unknown_part_is_named(rows) -> None:
    rep = {
        "case": {**SortedRLCase(batch=16, groups=1, q=16).__dict__},
        "trace": "sortedrl-8k",
        "rows": rows,
        "checks": checks(rows),
        "sensitivity_q": [{"q": 16, "rows": rows}],
        "sensitivity_tail": [{"sigma_prompt": 1.15, "rows": rows}],
    }
    text = "\n".join(render_sortedrl(rep))
    assert "| sorted_partial |" in text and "out tok/s (all)" in text and "trained tok/s" in text
    with pytest.raises(ConfigError, match=r"unknown part\(s\) \['nope'\]"):
        run_papers(only=("nope",))
    with pytest.raises(ConfigError, match=r"sortedrl\.q"):
        SortedRLCase(q=0)
