"""A SIGKILLed engine core process surfaces as an EngineError within seconds, never a hang."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from rollpacker.core.config import EngineConfig
from rollpacker.core.errors import EngineError
from rollpacker.core.types import GenerationRequest, Prompt, SamplingSpec
from rollpacker.engines.layout import start_replica

pytestmark = pytest.mark.slow


def _req(rid: str, max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid,
        prompt=Prompt(rid, tuple(range(10, 40))),
        sample_index=0,
        sampling=SamplingSpec(max_tokens=max_tokens, temperature=1.0, ignore_eos=True),
    )


def _hung(*_: object) -> None:
    raise AssertionError("step() still waits 60 s after its engine core was killed")


def test_a_killed_engine_core_fails_the_waiting_step_with_its_pid_and_signal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollpacker.tasks.tiny_model import build_tiny_model

    # a temporary directory as deep as a Ray actor's under a services directory: vLLM's socket
    # paths would pass the 107-byte limit of a Unix socket there, and the engine would not start
    deep = tmp_path / ("d" * 40) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    cfg = EngineConfig(model_dir=str(build_tiny_model("tiny")), max_num_seqs=8, max_model_len=512)
    eng = start_replica(cfg, 1, [str(min(os.sched_getaffinity(0)))])
    ipc = eng._ipc_dir  # vLLM's ZMQ socket files: a directory of the engine's own
    assert ipc and any(stat.S_ISSOCK(os.stat(os.path.join(ipc, f)).st_mode) for f in os.listdir(ipc))
    try:
        cores = [
            k
            for k in psutil.Process().children(recursive=True)
            if k.cmdline()[:1] and k.cmdline()[0].startswith("VLLM::EngineCore")
        ]
        assert len(cores) == 1
        eng.add_request(_req("a", 400))
        eng.step()
        assert not eng.dead
        os.kill(cores[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        signal.signal(signal.SIGALRM, _hung)  # without the watcher, vLLM's step() waits forever
        signal.alarm(60)
        try:
            with pytest.raises(EngineError, match=rf"pid {cores[0].pid} \(signal SIGKILL\)"):
                for _ in range(400):
                    eng.step()
        finally:
            signal.alarm(0)
        assert time.monotonic() - t0 < 10
        assert eng.dead
        with pytest.raises(EngineError, match="died"):  # every later call, too
            eng.add_request(_req("b", 4))
    finally:
        t0 = time.monotonic()
        eng.close()
        assert time.monotonic() - t0 < 30
        assert not os.path.exists(ipc), "the dead engine's socket files are left behind"
