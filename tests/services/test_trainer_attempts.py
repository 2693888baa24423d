"""The trainer's update runs ahead of the training stage (begun as the round ends); a newer
attempt must never be mixed with an older attempt's update still waiting or running."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.services.test_scaledown_runtime import _group, _TrainerPeers, start_state
from tests.small_model import build_small_model


def _service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: str = ""):  # type: ignore[no-untyped-def]
    """A trainer service on a file store holding the small model; ``extra``: more config YAML."""
    from rollpacker.core.config import StoreConfig
    from rollpacker.services.trainer import TrainerService
    from rollpacker.store import open_store

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    store = open_store(StoreConfig(endpoint=f"file://{tmp_path / 'store'}"))
    base = store.upload_dir(build_small_model(tmp_path / "model"), "t/base/")
    text = f'experiment: t\nstore: {{endpoint: "file://{tmp_path / "store"}"}}\n{extra}'
    svc = TrainerService(text, "sync")
    svc.bind(_TrainerPeers())
    state = start_state("t", "sync", base)
    return svc, state, base


def test_a_newer_attempt_stops_an_older_finish_that_still_waits_for_its_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.core.errors import TrainerError

    svc, state, base = _service(tmp_path, monkeypatch)
    svc.begin("old", state, base)
    # the old attempt's update was begun at its round's end; its groups never all arrive (the
    # reward task died), and a re-run of the same step expects the very same prompts
    ticket = svc.begin_update("old", 0, ("p1", "p2"), "t/ckpt/old/", "t/batch/old")
    time.sleep(0.3)
    t0 = time.monotonic()
    svc.begin("new", state, base)
    assert time.monotonic() - t0 < 10  # begin did not wait for the old finish's 1800 s timeout
    with pytest.raises(TrainerError, match="superseded by attempt new"):
        svc._started[ticket.key][1].result(timeout=10)  # at once, not at the 1800 s call timeout
    assert svc._attempt == "new" and svc.trainer.policy_version == 0  # nothing was updated
    svc.close()


def test_begin_waits_for_an_older_update_in_flight_then_restores_the_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, state, base = _service(tmp_path, monkeypatch)
    svc.begin("old", state, base)
    entered, release = threading.Event(), threading.Event()
    real = svc._update

    def slow_update(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        release.wait(10)
        return real(*args, **kwargs)

    svc._update = slow_update
    svc.submit("old", "g0", _group("g0", 0))
    ticket = svc.begin_update("old", 0, ("g0",), "t/ckpt/old/", "t/batch/old")
    assert entered.wait(10)
    done = threading.Event()
    threading.Thread(target=lambda: (svc.begin("new", state, base), done.set()), daemon=True).start()
    time.sleep(0.5)
    assert not done.is_set()  # the new attempt waits for the update in flight
    release.set()
    assert done.wait(30)
    assert svc.collect(ticket).value.policy_version == 1  # the old update ran to its end...
    assert svc.trainer.policy_version == state.policy_version  # ...and the new attempt restored the state
    svc.close()


def test_an_update_that_fails_after_the_optimizer_step_is_rolled_back_by_the_next_begin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, state, base = _service(tmp_path, monkeypatch)
    svc.begin("a1", state, base)
    svc.submit("a1", "g0", _group("g0", 0))

    def broken_save(*_a, **_k):  # type: ignore[no-untyped-def]
        raise OSError("planted: the checkpoint could not be written")

    monkeypatch.setattr(svc.trainer, "save_checkpoint", broken_save)
    with pytest.raises(OSError, match="planted"):
        svc.finish("a1", 0, ("g0",), "t/ckpt/a1/", "t/batch/a1")
    assert svc.trainer.policy_version == 1  # the optimizer stepped; its checkpoint never landed
    monkeypatch.undo()
    began = svc.begin("a2", state, base)  # the re-run of the same step, from the same state
    assert began.restored and svc.trainer.policy_version == state.policy_version == 0
    svc.submit("a2", "g0", _group("g0", 0))
    assert svc.finish("a2", 0, ("g0",), "t/ckpt/a2/", "t/batch/a2").policy_version == 1
    svc.close()


def test_a_step_between_checkpoints_stores_nothing_and_only_this_trainer_holds_its_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.core.errors import TrainerError

    svc, state, base = _service(tmp_path, monkeypatch, "steps: 4\ncheckpoint: {every: 2}\n")
    svc.begin("a0", state, base)
    svc.submit("a0", "g0", _group("g0", 0))
    r0 = svc.finish("a0", 0, ("g0",), "t/ckpt/s0/", "t/batch/s0")
    assert not r0.stored and r0.metrics["train/checkpoint_stored"] == 0.0
    # the engine/trainer mismatch of the trained tokens is logged every step (core/fidelity.py)
    assert r0.metrics["mismatch/abs_logp_mean"] > 0 and r0.metrics["correction/masked_frac"] == 0.0
    assert not svc.store().list("t/ckpt/s0/")  # the key only names the weights in memory
    assert svc.holds(r0.checkpoint_uri) and not svc.holds(base)
    s0 = state.successor(checkpoint_uri=r0.checkpoint_uri, policy_version=1, rollback_step=-1)
    assert not svc.begin("a1", s0, base).restored  # the next step goes on from memory
    svc.submit("a1", "g1", _group("g1", 1))
    r1 = svc.finish("a1", 1, ("g1",), "t/ckpt/s1/", "t/batch/s1")
    assert r1.stored and svc.store().exists("t/ckpt/s1/trainer.json")
    svc.close()
    svc.trainer = None  # rebuilt: the weights of step 0 are gone, and no store has them
    assert not svc.holds(r0.checkpoint_uri)
    with pytest.raises(TrainerError, match=r"only in the trainer's memory .* rolls the arm back to step -1"):
        svc.begin("a2", s0, base)
