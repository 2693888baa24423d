"""The stream trainer's gradient worker runs on its own thread count even where an in-process vLLM
CPU engine has made ``torch.set_num_threads`` a no-op (vLLM's CPU worker replaces it)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rollpacker.core.advantages import Scope
from rollpacker.trainers.stream import StreamTrainer


class _Probe:
    """A trainer that records the intra-op threads its gradient calls run with."""

    estimator = SimpleNamespace(scope=Scope.GROUP)
    replicas = 1

    def __init__(self) -> None:
        self.threads: list[int] = []

    def accumulate(self, samples: Any) -> Any:
        self.threads.append(torch.get_num_threads())
        return SimpleNamespace(samples=len(samples))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell 1 thread from all")
def test_the_worker_gets_its_threads_where_set_num_threads_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's CPU worker does
    probe = _Probe()
    st = StreamTrainer(probe, stream=True, threads=1)  # type: ignore[arg-type]
    try:
        st.submit([SimpleNamespace(prompt_id="p", prompt_ids=(1,), num_tokens=1)])  # type: ignore[list-item]
        st._queues[0].join()
    finally:
        st.close()
    assert probe.threads == [1]
