"""Named points inside the stages where a test may inject a fault.

``at(point, step)`` does nothing unless ``$ROLLPACKER_STAGE_HOOK`` names a function
(``module:function``, e.g. ``rollpacker.testing.faults:kill_at``), which is then called with the
point, the step and a delay. The fault test uses it to SIGKILL a stage's process at each point
(plan, rollout, reward, judge, train, commit); production runs never set it.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

from rollpacker.core.errors import ConfigError

HOOK_ENV = "ROLLPACKER_STAGE_HOOK"


def at(point: str, step: int, delay_s: float = 0.0) -> None:
    spec = os.environ.get(HOOK_ENV, "")
    if spec:
        _load(spec)(point, step, delay_s)


@functools.lru_cache(maxsize=4)
def _load(spec: str) -> Callable[[str, int, float], None]:
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"${HOOK_ENV} = {spec!r}: no such function ({e}); use module:function") from e
    return fn  # type: ignore[no-any-return]
