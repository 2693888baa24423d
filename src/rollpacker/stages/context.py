"""What every stage of one arm works with: the arm's config, the store, the state, the services.

Invariants:
- a stage reads the committed state only through ``state_for(plan)``, which refuses a stale plan
  (another attempt committed meanwhile);
- every key a step writes in the store is named here, once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from rollpacker.core.config import ExperimentConfig, arm_config
from rollpacker.core.errors import TrackingUnavailable
from rollpacker.core.state import ControllerState, StateError
from rollpacker.core.types import ServicesMode
from rollpacker.services.api import TrackingAPI
from rollpacker.services.base import ServiceError
from rollpacker.services.registry import RegistrySpec, ServiceRegistry
from rollpacker.stages.messages import PlanOutput
from rollpacker.store import open_store
from rollpacker.store.base import ObjectStore
from rollpacker.store.state_store import StateStore
from rollpacker.tasks.models import base_key

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    config_text: str
    arm: str
    cfg: ExperimentConfig
    store: ObjectStore
    states: StateStore
    services: ServiceRegistry
    # wall clock when the process running this stage started (a KFP task), if the step's time
    # should include the process's start-up; None: the stage's own start
    process_start: float | None = None

    @classmethod
    def create(
        cls,
        config_text: str,
        arm: str,
        services_mode: ServicesMode,
        process_start: float | None = None,
        ray_address: str = "",
    ) -> StageContext:
        """The context of ``arm``; ``services_mode``: ``ray`` (named actors) or ``inline``;
        ``ray_address``: the Ray cluster a runner resolved (``RegistrySpec.of``)."""
        cfg = arm_config(config_text, arm)
        store = open_store(cfg.store)
        states = StateStore(store, cfg.experiment, arm)
        services = ServiceRegistry(RegistrySpec.of(config_text, cfg, arm, services_mode, ray_address))
        return cls(config_text, arm, cfg, store, states, services, process_start)

    def tracking_optional(self, what: str, call: Callable[[], object]) -> bool:
        """Run a tracking ``call`` that the step does not depend on (MLflow is never the source of
        truth); when MLflow does not answer, or the tracking service died, say so and go on: the
        next plan logs what was missed from the commit records. True when it went through."""
        try:
            call()
        except (TrackingUnavailable, ServiceError) as e:
            log.warning("%s skipped, MLflow is not reachable now (the next step logs it): %s", what, e)
            print(
                f"[{self.arm}] warning: {what} skipped: {str(e).splitlines()[0]}", file=sys.stderr, flush=True
            )
            return False
        return True

    @property
    def tracker(self) -> TrackingAPI:
        """The arm's MLflow run, through the tracking service (no MLflow import here)."""
        return self.services.tracking()

    def state_for(self, plan: PlanOutput, latest: ControllerState | None = None) -> ControllerState:
        """The committed state ``plan`` was made from (``latest``: the committed state, if the
        caller has just read it); refuses a stale plan."""
        latest = latest if latest is not None else self.states.latest()
        if latest is None or latest.step != plan.state_step:
            raise StateError(
                f"step {plan.step} (attempt {plan.attempt}) was planned from state step "
                f"{plan.state_step}, but the committed state is at step "
                f"{latest.step if latest else '(none)'}: re-run the step from its plan stage"
            )
        return latest

    # -- keys in the store ------------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"{self.cfg.experiment}/{self.arm}"

    def base_key(self) -> str:
        """The start model, keyed by what it is (``model_identity``): a changed model or warm-up
        is a new key, never a stale cached download of the old one."""
        return base_key(self.cfg, self.arm)

    def checkpoint_key(self, step: int, attempt: str) -> str:
        return f"{self.prefix}/ckpt/step-{step:06d}-{attempt}/"

    def batch_key(self, step: int, attempt: str) -> str:
        return f"{self.prefix}/batches/step-{step:06d}-{attempt}/samples.json"

    def profile_key(self, attempt: str) -> str:
        """Where the profile stage of an attempt writes its table (the commit looks there: the
        profile stage is conditional, so its output is not a DAG edge)."""
        return f"{self.prefix}/profiles/profile-{attempt}.json"
