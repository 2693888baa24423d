"""The chaos suite, short (``rollpacker.lab.bench.chaos``; ``make chaos`` runs the long one): a few
steps of a tail-batching arm through kfp.local on its own real SeaweedFS, MLflow and Ray, the
rollout on an engine layout of one CPU device (its vLLM engine core a process of its own), with a
fault of a different kind at each of five seeded steps (a stage process SIGKILLed, the engine core
SIGKILLed while the step's round runs, the S3 server restarted, MLflow down for a step, a sandbox
run frozen; the service actors' kills are tests/experiment/test_pipeline_faults.py's), then checked
against a fault-free run of the same config: every fault fired and was recovered by the run's own
retries, the chain's invariants hold, no prompt lost or trained twice, the round kinds, queue
lengths, cursor and policy version equal to the fault-free run's at every step, and nothing left
behind once the services are stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

KINDS = ("stage", "engine-core", "s3-restart", "mlflow-down", "sandbox-hang")
STEPS, FAULTS = 7, 5


def test_faults_of_every_kind_are_recovered_within_the_run_and_nothing_is_lost(tmp_path: Path) -> None:
    from rollpacker.lab.bench.chaos import render, run_chaos

    lines: list[str] = []
    report = run_chaos(
        STEPS,
        FAULTS,
        seed=1,
        out_dir=tmp_path / "chaos",
        arms=["tail_batching"],
        kinds=KINDS,
        devices=1,
        say=lines.append,
    )
    d = report.to_dict()
    text = render(d)
    print(text)
    assert len(d["faults"]) == FAULTS and len({f["kind"] for f in d["faults"]}) == FAULTS, text
    for f in d["faults"]:
        assert f["fired"], f"{f['spec']} never fired:\n{text}\n" + "\n".join(lines[-40:])
        assert f["recovered"], f"{f['spec']} not recovered:\n{text}\n" + "\n".join(lines[-40:])
        assert f["recover_s"] is not None and f["recover_s"] < 600
    core = next(f for f in d["faults"] if f["kind"] == "engine-core")
    assert core["in_its_step"], f"the engine core was not killed in its own step's round: {core}"
    run = d["arm_runs"]["tail_batching"]
    assert run["complete"] and run["committed_step"] == STEPS - 1, text
    c = d["comparison"]["tail_batching"]
    assert not c["chain_problems"], c["chain_problems"]
    assert c["prompts_lost"] == 0 and c["trained_twice"] == 0
    assert c["deterministic_fields_equal"], c["deterministic_diffs"]
    left = d["leftovers"]
    assert not left["processes"] and not left["ports"] and not left["temp_files"], left
    assert d["ok"], text
