"""What the GPU bench's phases share with its runner: the run's context, the skip, the JSON writer."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.errors import RollpackerError

# what a phase may find missing on a machine (skipped, not failed); anything else missing is a bug
OPTIONAL_PACKAGES = frozenset(
    {"torch", "transformers", "safetensors", "tokenizers", "numpy", "megatron", "yaml"}
)


class Skip(RollpackerError):
    """The phase cannot run here; the message says why (and what to bring or run first)."""


class PhaseTimeout(RollpackerError):
    """The phase ran past its deadline."""


@dataclass
class Context:
    """What a phase gets: the settings, where to write, the earlier phases' results, its deadline."""

    out: Path
    tiny: bool
    device: str  # "cuda" or "cpu"
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    deadline_at: float = 0.0  # perf_counter() at which the running phase's budget ends

    def left_s(self) -> float:
        return self.deadline_at - time.perf_counter()

    def needs(self, phase: str, key: str) -> Any:
        """A figure an earlier phase produced, or ``Skip`` naming that phase."""
        r = self.results.get(phase, {})
        if r.get("status") != "ok" or key not in r:
            raise Skip(f"needs the {phase} phase's {key!r}, which it did not produce ({r.get('status')})")
        return r[key]


def write_json(doc: dict[str, Any], path: Path) -> None:
    """Atomically: a reader never sees half a document."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)
