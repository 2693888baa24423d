"""The collective weight push (``engines/weight_transfer.py``) into every engine that serves: one
vLLM engine, or engines in layouts (``planner.devices``: every replica of every started layout).

``PushTargets`` is what the rollout service hands a push to. It lists the engines that receive
(each replica of each started layout, parked ones included: they serve again after the round),
gives each its first rank in the group (``TransferGroup.with_offset``: the engines' workers follow
one another after the senders), and has them join and receive side by side, one thread per
engine (a broadcast needs every member at once).

A layout started after a push must serve the same weights. On CPU every candidate layout stays
started (``resident_layouts``), so every one receives every push. Where only some fit at once
(GPUs at ``engine.gpu_memory_utilization`` 0.9: one), the first engine's first worker also writes
each bucket it receives to a directory of the rollout service's node (``weight_transfer.keeping``:
one safetensors file per bucket; the rollout service puts it in ``/dev/shm``), and the pool loads
that copy into a layout it starts later (``EnginePool.remember``), as it does with the
object-store path's tensors. That host copy is the price of starting layouts on demand: one full
copy per push (device to host on GPUs), written by a process that already holds the bucket, so
the group needs no extra rank (NCCL allows one rank per GPU, and every GPU of the rollout group
runs an engine).

A layout that started since the group was opened is not in it: the ``key`` (the receiving engines)
changes, the rollout service reports the group as not joined, and the trainer opens a new group
with every started engine at the next push.

Invariants (tests/engines/test_layout_push.py):
- every started engine's workers hold distinct ranks after the senders;
- every receiving engine gets every tensor of every sender;
- a layout started after a push serves the pushed weights (the kept copy).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from rollpacker.core.errors import EngineError
from rollpacker.core.weight_sync import TransferGroup
from rollpacker.engines.base import WeightReceiver
from rollpacker.engines.layout import SwitchingEngine
from rollpacker.engines.weight_transfer import PushReport, read_kept


def _receivers(engine: Any) -> list[Any]:
    """The engines a push reaches: every replica of every started layout, or ``engine``."""
    if isinstance(engine, SwitchingEngine):
        return [r for lay in engine.pool.started for r in engine.pool.engines[lay].replicas]
    return [engine]


def _side_by_side(calls: Sequence[Callable[[], Any]], timeout_s: float, what: str) -> list[Any]:
    """Run ``calls`` at once (members of one collective), their results in order; the first
    error is raised once every call has returned or ``timeout_s`` passed."""
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=timeout_s)
    if errors:
        raise errors[0]
    if any(th.is_alive() for th in threads):
        raise EngineError(f"{what}: an engine did not finish within {timeout_s:.0f} s")
    return out


class PushTargets:
    """The engines one collective push reaches, and where the first of them keeps a copy for
    layouts that start later (engines in layouts where not every layout stays started)."""

    def __init__(self, engine: Any, keep_dir: str = "") -> None:
        """``keep_dir``: where the copy for later layouts goes (a directory of this node, needed
        only when not every layout stays started)."""
        self.engines = _receivers(engine)
        missing = [e for e in self.engines if not isinstance(e, WeightReceiver)]
        if missing:
            raise EngineError(
                f"the collective weight push needs vLLM engines; {type(missing[0]).__name__} takes none"
            )
        pool = engine.pool if isinstance(engine, SwitchingEngine) else None
        self.pool = pool if pool is not None and pool.resident < len(pool.candidates) else None
        if self.pool is not None and not keep_dir:
            raise EngineError("layouts that start on demand need a directory to keep the pushed weights in")
        self.keep_dir = keep_dir if self.pool is not None else ""
        self._group: TransferGroup | None = None

    @property
    def workers(self) -> int:
        """The group's receiving ranks: every engine's workers."""
        return sum(int(e.tp_size) for e in self.engines)

    @property
    def key(self) -> tuple[int, ...]:
        """Which engines receive (a layout started or closed since changes it)."""
        return tuple(id(e) for e in self.engines)

    def join(self, group: TransferGroup) -> None:
        """Every engine joins ``group``, each at its own first rank."""
        if group.workers != self.workers:
            raise EngineError(
                f"weight transfer group for {group.workers} engine workers; these engines have {self.workers}"
            )
        calls: list[Callable[[], Any]] = []
        offset = group.senders
        for e in self.engines:
            calls.append(functools.partial(e.init_weight_transfer, group.with_offset(offset)))
            offset += int(e.tp_size)
        _side_by_side(calls, group.timeout_s, "joining the weight transfer group")
        self._group = group

    def receive(self, policy_version: int) -> list[PushReport]:
        """One push, received by every engine side by side (one report per engine worker); the
        first engine's copy (``keep_dir``) becomes what a layout started later loads."""
        if self._group is None:
            raise EngineError("weight push before the engines joined a weight transfer group")
        calls: list[Callable[[], Any]] = [
            functools.partial(e.receive_weights, policy_version, self.keep_dir if i == 0 else "")
            for i, e in enumerate(self.engines)
        ]
        got = _side_by_side(calls, self._group.timeout_s, "the collective weight push")
        if self.pool is not None:
            self.pool.remember(functools.partial(read_kept, self.keep_dir))
        return [r for reports in got for r in reports]
