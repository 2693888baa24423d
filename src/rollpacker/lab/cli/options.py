"""Options several lab commands share: one declaration, one help text."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

if TYPE_CHECKING:
    from rollpacker.core.config import RolloutConfig

R = TypeVar("R")

Preset = Annotated[
    str, typer.Option(help="Trace preset (`rollpacker trace presets`; whatif: also paper-8k/16k/32k).")
]
TraceFile = Annotated[
    Path | None, typer.Option(help="JSON Lines trace file; overrides --preset.", show_default="none")
]
EngineSlots = Annotated[
    int, typer.Option(help="Engine concurrency limit (vLLM max_num_seqs), Q of the bubble ratio.")
]
KvCacheGib = Annotated[int, typer.Option(help="Engine KV-cache size in GiB (VLLM_CPU_KVCACHE_SPACE).")]
Periods = Annotated[int, typer.Option(help="Tail-batching periods to run (each ends with a long round).")]
Seed = Annotated[int, typer.Option(help="Seed of the workload (trace, prompts, schedule).")]
Policies = Annotated[str, typer.Option(help="Comma list of policies (sync and tail_batching always run).")]
ModelPreset = Annotated[
    str, typer.Option(help="Tiny-model preset (or a model directory) of the real engine.")
]
DoomedShare = Annotated[float, typer.Option(help="Share of responses that never terminate.")]
WrongShare = Annotated[float, typer.Option(help="Share of responses that fail the tests.")]
OutDir = Annotated[Path, typer.Option(help="Directory of the run's services, state, logs and figures.")]


@dataclass(frozen=True)
class Shape:
    """A step's rollout shape as the benchmarks take it: P0 prompts x R0 responses, the speculation
    factors (1.0 where a command has none) and the longest response."""

    p0: int
    r0: int
    max_tokens: int
    eta_p: float = 1.0
    eta_r: float = 1.0

    def rollout(self, **more: Any) -> RolloutConfig:
        """The rollout section of a config with this shape (``more``: its other fields)."""
        from rollpacker.core.config import RolloutConfig

        p, r, n = self.p0, self.r0, self.max_tokens
        return RolloutConfig(
            prompts_per_step=p,
            responses_per_prompt=r,
            eta_p=self.eta_p,
            eta_r=self.eta_r,
            max_tokens=n,
            **more,
        )


_SHAPE_OPTIONS: dict[str, Any] = {
    "p0": Annotated[int, typer.Option("--p0", help="P0: prompts (groups) trained per step.")],
    "r0": Annotated[int, typer.Option("--r0", help="R0: responses per prompt.")],
    "eta_p": Annotated[float, typer.Option(help="Prompt speculation factor (1.0 disables).")],
    "eta_r": Annotated[float, typer.Option(help="Response speculation factor (1.0 disables).")],
    "max_tokens": Annotated[int, typer.Option(help="Max response length (traced lengths are clipped).")],
}


def with_shape(
    p0: int, r0: int, max_tokens: int, eta: float | None = 1.25
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command the options ``--p0 --r0 --max-tokens`` (and ``--eta-p --eta-r`` unless ``eta``
    is None) with these defaults, and pass them to it as one ``shape: Shape`` argument."""
    defaults: dict[str, Any] = {"p0": p0, "r0": r0, "max_tokens": max_tokens}
    if eta is not None:
        defaults |= {"eta_p": eta, "eta_r": eta}

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        sig = inspect.signature(fn, eval_str=True)
        kept = [p for p in sig.parameters.values() if p.name != "shape"]
        kind = inspect.Parameter.KEYWORD_ONLY
        added = [
            inspect.Parameter(k, kind, default=v, annotation=_SHAPE_OPTIONS[k]) for k, v in defaults.items()
        ]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> R:
            shape = Shape(**{k: kwargs.pop(k) for k in defaults})
            return fn(*args, shape=shape, **kwargs)

        # the shape's options first in --help; the others keep their order (all keyword-only)
        kept = [p.replace(kind=kind) for p in kept]
        run.__signature__ = sig.replace(parameters=[*added, *kept])  # type: ignore[attr-defined]
        return run

    return wrap
