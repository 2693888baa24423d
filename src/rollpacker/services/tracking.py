"""The tracking service: the arm's MLflow client, warm, in one long-lived process.

Every KFP task is a fresh Python process; importing MLflow costs ~1.5-2 s there and each task would
open its own HTTP session. The plan, profile and commit stages reach MLflow through this service
instead (``TrackingAPI``): one Ray round trip per call, the client and its connection pool stay
warm across steps, and a committed step is logged in one call (``log_committed``: one metric batch,
the lengths, the state pointer).

Invariants:
- MLflow is never the source of truth: a step is committed (state document, pointer) before it is
  logged, and the plan stage re-logs a committed step MLflow missed from its commit record, so a
  tracking service that dies loses nothing (the next lookup rebuilds it);
- the service holds no step state: every call names its run.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from rollpacker.core.errors import RollpackerError
from rollpacker.core.types import Role
from rollpacker.services.api import CommittedStep, TrackingAPI
from rollpacker.services.base import Service

T = TypeVar("T")


class TrackingService(Service, TrackingAPI):
    def __init__(self, config_text: str, arm: str, role: Role = Role.TRACKING) -> None:
        super().__init__(config_text, arm, role)

    @functools.cached_property
    def tracker(self) -> Any:
        from rollpacker.tracking import ExperimentTracker

        # a stage must not hang for minutes in MLflow's default retry loop (7 tries, backoff)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        return ExperimentTracker(self.cfg.tracking_uri, self.cfg.experiment)

    def _guarded(self, call: Callable[[Any], T], check: bool = True) -> T:
        """``call(tracker)``; a server that does not answer is a ``TrackingUnavailable`` within
        seconds (``check`` first: no retries), whatever MLflow raised."""
        from rollpacker.tracking import unreachable

        t = self.tracker
        if check:
            t.check()  # fails fast (no retries) when the server is down
        try:
            return call(t)
        except RollpackerError:
            raise
        except Exception as e:  # MLflow raises many types: the server went away mid-call
            raise unreachable(self.cfg.tracking_uri, e) from e

    def check(self) -> str:
        return str(self._guarded(lambda t: t.check(), check=False))

    def arm_run(self, arm: str, params: dict[str, str]) -> str:
        return str(self._guarded(lambda t: t.arm_run(arm, params), check=False))

    def log_step(self, run_id: str, step: int, metrics: dict[str, float]) -> None:
        self._guarded(lambda t: t.log_step(run_id, step, metrics), check=False)

    def state_pointer(self, run_id: str) -> tuple[str, int] | None:
        got = self._guarded(lambda t: t.state_pointer(run_id))
        return None if got is None else (str(got[0]), int(got[1]))

    def log_committed(self, commit: CommittedStep) -> None:
        """A committed step; ``TrackingUnavailable`` within seconds when MLflow does not answer
        (the commit stage then goes on: the next commit logs the step from its commit record)."""

        def log(t: Any) -> None:
            t.log_step(commit.run_id, commit.step, commit.metrics)
            t.log_step_lengths(commit.run_id, commit.step, commit.round_kind, list(commit.lengths))
            t.set_state_pointer(commit.run_id, commit.state_uri, commit.state_step)  # last: done
            if commit.last:
                t.finish_arm(commit.run_id)

        self._guarded(log, check=False)  # the caller read the state pointer just before

    def log_profile(self, run_id: str, step: int, uri: str, doc: dict[str, Any]) -> None:
        self._guarded(lambda t: t.log_profile(run_id, step, uri, doc))
