"""The weight-sync probe (core/fidelity.py): after each push the engine's logprobs on probe prompts
agree with the trainer's within the precisions' bound, and a stale or half-loaded engine fails the
step, naming the gap, before any rollout on its weights.

The engine is faked at the outer edge: a Hugging Face copy of the model that takes the pushed
weights as the vLLM engine's ``load_weights`` would (all, none: stale, or half of them).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from rollpacker.core.errors import ConfigError
from rollpacker.core.fidelity import SyncProbeConfig, probe_bound
from tests.services.test_scaledown_runtime import _group, start_state
from tests.small_model import build_small_model


class _Engine:
    """The rollout service's probe on a model of its own: loads ``share`` of the pushed tensors."""

    def __init__(self, model_dir: Path, share: float) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.share, self.version = share, 0

    def load_weights(self, version: int, uri: str, weights: dict[str, Any]) -> float:
        names = sorted(weights)
        keep = names[: int(len(names) * self.share)]
        self.model.load_state_dict({n: weights[n] for n in keep}, strict=False)
        self.version = version if keep else self.version
        return 0.0

    @torch.no_grad()
    def probe(self, prompts: int, max_tokens: int) -> Any:
        from rollpacker.services.api import WeightProbe

        rng = random.Random(0)
        ps = tuple(tuple(rng.randrange(1, 64) for _ in range(5)) for _ in range(prompts))
        rs = tuple(tuple(rng.randrange(1, 64) for _ in range(max_tokens)) for _ in range(prompts))
        lps = []
        for p, r in zip(ps, rs, strict=True):
            logits = self.model(input_ids=torch.tensor([list(p) + list(r)])).logits[0]
            logp = torch.log_softmax(logits[len(p) - 1 : -1], -1)
            lps.append(tuple(float(logp[t, tok]) for t, tok in enumerate(r)))
        return WeightProbe(self.version, ps, rs, tuple(lps))

    # the trainer service's peers: this engine is its rollout service
    def rollout(self) -> _Engine:
        return self

    def refresh(self) -> None:
        pass


def _step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, share: float, lr: str = "1.0e-2"):  # type: ignore[no-untyped-def]
    """One training step of a trainer service whose engine loads ``share`` of each push."""
    from rollpacker.core.config import StoreConfig
    from rollpacker.services.trainer import TrainerService
    from rollpacker.store import open_store

    monkeypatch.setenv("ROLLPACKER_CACHE", str(tmp_path / "cache"))
    store = open_store(StoreConfig(endpoint=f"file://{tmp_path / 'store'}"))
    model = build_small_model(tmp_path / "model")
    base = store.upload_dir(model, "t/base/")
    text = f'experiment: t\nstore: {{endpoint: "file://{tmp_path / "store"}"}}\ntrain: {{lr: {lr}}}\n'
    svc = TrainerService(text, "sync")
    svc.bind(_Engine(model, share))
    svc.begin("a0", start_state("t", "sync", base), base)
    svc.submit("a0", "g0", _group("g0", 0))
    try:
        return svc.finish("a0", 0, ("g0",), "t/ckpt/s0/", "t/batch/s0")
    finally:
        svc.close()


def test_a_fully_loaded_engine_passes_and_the_gap_is_logged(tmp_path, monkeypatch) -> None:
    r = _step(tmp_path, monkeypatch, share=1.0)
    assert 0 <= r.metrics["sync/probe_logprob_gap"] < 1e-5  # fp32 on both sides: rounding only


@pytest.mark.parametrize(("share", "version"), [(0.0, 0), (0.5, 1)])  # stale, half-loaded
def test_a_stale_or_half_loaded_engine_fails_the_step_naming_the_gap(
    tmp_path, monkeypatch, share, version
) -> None:
    from rollpacker.core.errors import TrainerError

    gap = r"sync/probe_logprob_gap = 0\.[0-9]+ .*, bound 0\.002 \(float32 engine, float32 trainer\)"
    with pytest.raises(TrainerError, match=gap + f", engine at version {version}"):
        _step(tmp_path, monkeypatch, share=share)


def test_a_stale_engine_within_the_bound_fails_on_its_version(tmp_path, monkeypatch) -> None:
    """At the default learning rate one step moves the probe's logprobs by less than the bound: the
    engine's version (what the rollout service last loaded) still names it stale."""
    from rollpacker.core.errors import TrainerError

    with pytest.raises(TrainerError, match=r"sync/probe_logprob_gap = [0-9.e-]+ .* engine at version 0"):
        _step(tmp_path, monkeypatch, share=0.0, lr="3.0e-5")


def test_the_bound_is_the_coarser_precision_or_the_configured_one() -> None:
    cfg = SyncProbeConfig()
    assert probe_bound(cfg, "float32", "float32") == 2e-3
    assert probe_bound(cfg, "bfloat16", "float32") == probe_bound(cfg, "float32", "bfloat16") == 0.15
    assert probe_bound(cfg, "float16", "float32") == 3e-2
    assert probe_bound(SyncProbeConfig(bound=0.5), "float32", "float32") == 0.5
    with pytest.raises(ConfigError, match="prompts"):
        SyncProbeConfig(prompts=0)
