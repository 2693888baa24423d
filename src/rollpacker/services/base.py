"""What every service shares: its config (the arm's policy applied), its peers, the store.

A service is built from the experiment's config text and its arm; everything else it needs per
step (weights, cursor, queue, timeout anchors) comes from the committed state a stage passes in.
The registry calls ``bind(peers)`` once after construction; in a Ray actor ``peers`` is the
registry itself, unpickled there, so a service never imports the registry.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar, cast

from rollpacker.core.config import StoreConfig, arm_config
from rollpacker.core.errors import RollpackerError
from rollpacker.core.serde import Message
from rollpacker.core.types import Role, parse_enum
from rollpacker.services.api import Collected, Peers, Pending
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore
from rollpacker.tasks.dataset_store import local_dataset, readable_here

R = TypeVar("R", bound=Message)


class ServiceError(RollpackerError):
    """A service could not be reached, created, or failed a call."""


def config_digest(config_text: str) -> str:
    """What a service was built from: a running service with another digest is rebuilt."""
    return hashlib.sha256(config_text.encode()).hexdigest()[:16]


class Service:
    """The base of the Ray actors (and their in-process twins)."""

    def __init__(self, config_text: str, arm: str, role: Role) -> None:
        self.config_text = config_text
        self.arm = arm
        self.role = parse_enum(Role, role, "service role")  # a Ray actor's argument may be plain text
        self.cfg = arm_config(config_text, arm)
        self._digest = config_digest(config_text)
        self._peers: Peers | None = None
        self._started: OrderedDict[str, tuple[Pending[Message], Future[Collected[Message]]]] = OrderedDict()
        self._started_lock = threading.Lock()
        self._dataset: str | None = None

    def config_digest(self) -> str:
        return self._digest

    def bind(self, peers: Peers) -> None:
        """The first binding stays: every stage process that reaches a Ray actor binds it again,
        and replacing its peers would drop their cached handles (a cascade of lookups and binds
        among the actors at every stage)."""
        if self._peers is None:
            self._peers = peers

    @property
    def peers(self) -> Peers:
        if self._peers is None:
            raise ServiceError(f"{self.role} service used before the registry bound its peers")
        return self._peers

    # calls begun ahead of the stage that waits for them (``begin_*`` -> Pending, ``collect``)
    MAX_STARTED = 8  # uncollected calls kept (a stage that died never collects its own)

    def _run_ahead(self, call: str, attempt: str, result: type[R], work: Callable[[], R]) -> Pending[R]:
        """Run ``work`` now in a thread of its own and return its ticket: a stage begins the step's
        next piece of work before the KFP task that waits for it exists (its process start-up then
        overlaps the work). Beginning the same call of the same attempt again returns the first
        ticket and runs nothing."""
        ticket = Pending[R](self.role, call, attempt, result.__name__, time.time())
        with self._started_lock:
            if ticket.key in self._started:
                return cast(Pending[R], self._started[ticket.key][0])
            fut: Future[Collected[Message]] = Future()
            self._started[ticket.key] = (cast(Pending[Message], ticket), fut)
            while len(self._started) > self.MAX_STARTED:
                self._started.popitem(last=False)

        def run() -> None:
            t0 = time.time()
            try:
                value = work()
            except BaseException as e:  # handed to the collector, raised there
                fut.set_exception(e)
            else:
                fut.set_result(Collected(value, t0, time.time()))

        threading.Thread(target=run, name=f"{self.role}-{call}", daemon=True).start()
        return ticket

    def collect(self, ticket: Pending[R]) -> Collected[R]:
        """Wait for the call ``ticket`` names: its result (or its exception), with when it ran.
        Each ticket is collected once."""
        if ticket.service != self.role:
            raise ServiceError(
                f"{self.role} service: the {ticket.call} of attempt {ticket.attempt} was begun on the "
                f"{ticket.service} service; collect it there"
            )
        with self._started_lock:
            begun = self._started.get(ticket.key)
        if begun is None:
            raise ServiceError(
                f"{self.role} service: no {ticket.call} of attempt {ticket.attempt} was begun here: this "
                "service was rebuilt since the call was begun (the one running it died), or it was "
                "collected already; re-run the step from its plan stage"
            )
        try:
            got = begun[1].result()
        finally:
            with self._started_lock:
                if self._started.get(ticket.key) is begun:
                    del self._started[ticket.key]
        if type(got.value).__name__ != ticket.result:
            raise ServiceError(
                f"{self.role} service: the {ticket.call} of attempt {ticket.attempt} returned a "
                f"{type(got.value).__name__}, its ticket promised a {ticket.result}"
            )
        return cast(Collected[R], got)

    def store(self) -> ObjectStore:
        return _store(self.cfg.store)

    def dataset(self) -> str:
        """``task.name`` as this pod reads it: a built-in name, or the arm's dataset from the store
        (published by the plan stage, downloaded once per pod; looked up once per service)."""
        name = self.cfg.task.name
        if self._dataset is None and readable_here(name):
            self._dataset = name
        if self._dataset is None:
            cache = download_cache() / "datasets"
            self._dataset = local_dataset(self.store(), name, self.cfg.experiment, self.arm, cache)
        return self._dataset

    def close(self) -> None:
        pass


@functools.lru_cache(maxsize=4)
def _store(store_cfg: StoreConfig) -> ObjectStore:
    return open_store(store_cfg)


CHECKPOINT_CACHE_ENV = "ROLLPACKER_CHECKPOINT_CACHE"


def download_cache() -> Path:
    """Where services keep what they download (``$ROLLPACKER_CACHE``, else ~/.cache/rollpacker)."""
    return Path(os.environ.get("ROLLPACKER_CACHE", Path.home() / ".cache" / "rollpacker"))


def checkpoint_cache() -> Path:
    """Where services keep downloaded checkpoints: ``$ROLLPACKER_CHECKPOINT_CACHE`` when set (a
    directory of one session's own, such as the test suite's), else ``$ROLLPACKER_CACHE``/checkpoints."""
    own = os.environ.get(CHECKPOINT_CACHE_ENV)
    return Path(own) if own else download_cache() / "checkpoints"
