"""hasattr/getattr and ``Any`` live in adapters; every other module holds a pinned budget.

List every finding on the real tree with ``.venv/bin/python -m tests.test_loose_typing`` (exit 1 if
any). The checker (``tests/loose_typing.py``) reads the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .loose_typing import Budget, adapter_of, findings, scan

REPO = Path(__file__).resolve().parents[1]
ROOTS = (REPO / "src" / "rollpacker", REPO / "components", REPO / "pipelines")

# The adapters: modules whose job is to talk to a library or a system whose types are not ours.
# A key places that module and everything under it.
ADAPTERS: dict[str, str] = {
    "rollpacker.engines.vllm_engine": "vLLM's LLMEngine",
    "rollpacker.engines.vllm_transfer_ext": "vLLM's worker extension (collective weight push)",
    "rollpacker.engines.speculation": "vLLM's custom proposer hook and model runner",
    "rollpacker.engines.verification": "vLLM's rejection-sampler kernels (the expand-kernel override)",
    "rollpacker.engines.weight_transfer": "torch.distributed process groups and vLLM's workers",
    "rollpacker.engines.gpus": "pynvml and CUDA",
    "rollpacker.trainers.torch_trainer": "torch and transformers",
    "rollpacker.trainers.megatron": "megatron-core and torch.distributed",
    "rollpacker.rewards.offload": "torch and transformers (layer offload of the judge)",
    "rollpacker.store": "S3 (the minio client) and the filesystem",
    "rollpacker.tracking": "MLflow",
    "rollpacker.devservices": "the local SeaweedFS, MLflow and Ray processes",
    "rollpacker.pipeline_compile": "the KFP compiler",
    "rollpacker.pipeline_local": "kfp.local",
    "rollpacker.submit": "the KFP client",
    "rollpacker.deploy": "Kubernetes manifests (kubectl, kustomize)",
    "rollpacker.cli": "typer",
    # the lab: benchmarks and what-if tools over every library above, outside the step path
    "rollpacker.lab": "the lab: benchmarks, what-if, profiler, soak and chaos drivers (vLLM, torch, Ray)",
}

# Reasons shared by several modules.
FIELDS = "validates its fields by name in a loop (getattr(self, name) over dataclass fields)"
DOC = "reads a JSON/YAML document: its values are Any until each field is checked"
TENSORS = (
    "tensors pass typed as Any: torch is imported lazily (rollpacker.core and the ports load without it)"
)
HF = "a transformers tokenizer/model (imported lazily, untyped)"
OS = "probes the platform (os.sched_getaffinity exists on Linux only)"

# Every other module: (hasattr/getattr, Any) it may hold, and why. Only ever lowered.
BUDGET: dict[str, Budget] = {
    "rollpacker.core.config": Budget(
        9, 10, f"{FIELDS}; {DOC} (the config tree); from_name on enum-like types"
    ),
    "rollpacker.core.costmodel": Budget(0, 9, DOC + " (hardware and model specs)"),
    "rollpacker.core.drafts": Budget(1, 0, FIELDS),
    "rollpacker.core.fidelity": Budget(2, 0, FIELDS),
    "rollpacker.core.latency": Budget(2, 3, f"{FIELDS}; {DOC} (the profile table)"),
    "rollpacker.core.memory": Budget(3, 1, f"{FIELDS}; {DOC} (a model's config.json)"),
    "rollpacker.core.metrics": Budget(2, 0, "a metrics dataclass as a dict of its fields"),
    "rollpacker.core.planner": Budget(2, 0, FIELDS),
    "rollpacker.core.pod_paths": Budget(1, 1, "walks any config dataclass for local paths (fields by name)"),
    "rollpacker.core.policies.entries": Budget(0, 5, DOC + " (the rollout buffer)"),
    "rollpacker.core.scaledown": Budget(1, 2, f"{FIELDS}; {DOC} (its state in the controller state)"),
    "rollpacker.core.serde": Budget(
        2,
        22,
        "the strict JSON reader itself: data is Any until checked against the hints (generic messages too)",
    ),
    "rollpacker.core.sizing": Budget(2, 0, "compares two volume tables field by field"),
    "rollpacker.core.state": Budget(0, 6, DOC + " (the controller state)"),
    "rollpacker.core.tasks": Budget(
        0, 1, "a task example's free-form metadata (JSON values from the dataset)"
    ),
    "rollpacker.engines.base": Budget(0, 1, TENSORS),
    "rollpacker.engines.fake": Budget(3, 3, TENSORS + "; fingerprints a tensor or a plain sequence"),
    "rollpacker.engines.layout": Budget(
        8, 8, TENSORS + "; replicas are vLLM engines or fakes: startup_s, dead and the KV capacity are probed"
    ),
    "rollpacker.engines.layout_push": Budget(
        0, 8, "runs vLLM engines' collective calls side by side, on threads (the calls' results of any kind)"
    ),
    "rollpacker.engines.simulated": Budget(
        0, 1, "build_engine: a VLLMEngine (imported only when chosen) or the stand-in"
    ),
    "rollpacker.engines.profiler": Budget(0, 3, "writes the profile document (JSON rows)"),
    "rollpacker.experiment": Budget(
        1, 4, "config overrides are YAML values; the local services handle is devservices'"
    ),
    "rollpacker.logs": Budget(
        2, 0, "a stream's encoding and a logger's handlers (stdlib objects of any kind)"
    ),
    "rollpacker.rewards.base": Budget(1, 0, "a registered reward function's optional kind attribute"),
    "rollpacker.rewards.judge": Budget(1, 1, HF),
    "rollpacker.rewards.math_rule": Budget(
        1, 4, "math-verify's parse results and its module flag (untyped library)"
    ),
    "rollpacker.rewards.sandbox": Budget(
        3, 6, f"{FIELDS}; the sandbox's JSON records; sys._base_executable (set in a venv only)"
    ),
    "rollpacker.services.api": Budget(0, 2, TENSORS),
    "rollpacker.services.registry": Budget(
        6, 21, "the proxies over Ray actor handles and in-process objects (Ray's handles are untyped)"
    ),
    "rollpacker.services.rollout": Budget(0, 5, f"{TENSORS}; {HF}"),
    "rollpacker.services.tracking": Budget(
        0, 4, "the MLflow tracker (imported lazily) and the profile document"
    ),
    "rollpacker.services.trainer": Budget(
        6,
        8,
        f"{TENSORS}; the torch trainer or the megatron gang, probed for broken/close/store_checkpoint; {OS}",
    ),
    "rollpacker.stages.hooks": Budget(
        1, 0, "loads the fault hook named in $ROLLPACKER_STAGE_HOOK (module:function)"
    ),
    "rollpacker.tasks.dataset_store": Budget(0, 1, DOC + " (a dataset record)"),
    "rollpacker.tasks.jsonl": Budget(0, 17, DOC + " (dataset lines)"),
    "rollpacker.tasks.judge_task": Budget(2, 11, f"{HF}; {FIELDS}"),
    "rollpacker.tasks.warmup": Budget(2, 2, f"{HF}; {FIELDS}"),
    "rollpacker.testing.chain": Budget(0, 5, "test support: reads a run's state chain as JSON"),
    "rollpacker.trainers.base": Budget(0, 1, TENSORS),
    "rollpacker.trainers.stream": Budget(2, 1, f"{OS}; torch passed in (imported lazily)"),
}


def _real_uses():
    return scan(ROOTS, base=REPO)


def test_probes_and_any_stay_in_adapters_or_within_their_pinned_budget() -> None:
    found = findings(_real_uses(), ADAPTERS, BUDGET)
    assert not found, "loose typing outside the adapters:\n" + "\n".join(found)


# -- the checker catches what it should (planted trees) ------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)


PLANTED = {
    "__init__.py": "",
    "core/__init__.py": "",
    "core/a.py": "from typing import Any\n\n\ndef f(x: object) -> int:\n    return len(x.items)\n",
    "services/__init__.py": "",
    "services/b.py": "def f(engine: object) -> bool:\n    return hasattr(engine, 'remember_drafts')\n",
    "vendor/__init__.py": "",
    "vendor/glue.py": "import typing\n\n\ndef g(o: typing.Any) -> typing.Any:\n    return getattr(o, 'x')\n",
}


def test_a_planted_probe_or_any_outside_the_adapters_is_caught(tmp_path: Path) -> None:
    _write(tmp_path / "pkg", PLANTED)
    uses = scan([tmp_path / "pkg"], base=tmp_path)
    # the import of Any alone is no use; typing.Any counts like Any
    assert [(u.what, u.line) for u in uses["pkg.core.a"]] == []
    assert [(u.what, u.path, u.line) for u in uses["pkg.vendor.glue"]] == [
        ("Any", "pkg/vendor/glue.py", 4),
        ("Any", "pkg/vendor/glue.py", 4),
        ("getattr", "pkg/vendor/glue.py", 5),
    ]
    adapters = {"pkg.vendor": "a foreign library"}
    found = findings(uses, adapters, {})
    assert len(found) == 1 and found[0].startswith("pkg.services.b: 1 hasattr/getattr where 0 are pinned")
    assert "pkg/services/b.py:2: hasattr" in found[0] and "Protocol" in found[0]
    # the same probe with a pinned budget and a reason passes; without the adapter, glue is caught
    assert findings(uses, adapters, {"pkg.services.b": Budget(1, 0, "why")}) == []
    assert [f.split(":")[0] for f in findings(uses, {}, {"pkg.services.b": Budget(1, 0, "why")})] == [
        "pkg.vendor.glue",
        "pkg.vendor.glue",
    ]
    # the planted Any in core is caught the same way
    (tmp_path / "pkg/core/a.py").write_text("from typing import Any\n\nX: Any = 1\n")
    found = findings(
        scan([tmp_path / "pkg"], base=tmp_path), adapters, {"pkg.services.b": Budget(1, 0, "why")}
    )
    assert found == [
        "pkg.core.a: 1 Any where 0 are pinned (no budget): pkg/core/a.py:3: Any; "
        + found[0].split("; ", 1)[1]
    ]


def test_a_budget_only_goes_down_and_names_real_modules_with_a_reason(tmp_path: Path) -> None:
    _write(tmp_path / "pkg", PLANTED)
    uses = scan([tmp_path / "pkg"], base=tmp_path)
    adapters = {"pkg.vendor": "a foreign library", "pkg.gone": "x"}
    budget = {
        "pkg.services.b": Budget(2, 0, "why"),  # holds 1: lower the pin
        "pkg.core.a": Budget(0, 0, " "),  # no reason
        "pkg.core.z": Budget(0, 1, "why"),  # no such module
        "pkg.vendor.glue": Budget(1, 2, "why"),  # an adapter needs no pin
    }
    found = findings(uses, adapters, budget)
    assert found == [
        "ADAPTERS['pkg.gone'] names no scanned module: remove it",
        "BUDGET['pkg.core.a'] has no reason: say why this module needs what it holds",
        "BUDGET['pkg.core.z'] names no scanned module: remove it",
        "BUDGET['pkg.vendor.glue']: the module is an adapter (pkg.vendor); remove its pin",
        "pkg.services.b: holds 1 hasattr/getattr but BUDGET pins 2: lower the pin to 1 "
        "(a budget only goes down)",
    ]


def test_the_adapter_table_places_modules_by_prefix() -> None:
    assert adapter_of("rollpacker.store.s3", ADAPTERS) == "rollpacker.store"
    assert adapter_of("rollpacker.engines.vllm_engine", ADAPTERS) == "rollpacker.engines.vllm_engine"
    assert adapter_of("rollpacker.engines.layout", ADAPTERS) is None
    assert adapter_of("rollpacker.storex", {"rollpacker.store": "S3"}) is None
    # the step path holds no probe: the rollout service reaches the engine through the port
    uses = _real_uses()
    assert [u for u in uses["rollpacker.services.rollout"] if u.kind == "probe"] == []
    assert all(
        not uses[m] for m in uses if m.startswith("rollpacker.stages.") and m != "rollpacker.stages.hooks"
    )


if __name__ == "__main__":
    found = findings(_real_uses(), ADAPTERS, BUDGET)
    print("\n".join(found) or "no probe or Any beyond the adapters and the pinned budget")
    sys.exit(1 if found else 0)
