"""Helpers: strict parsing of compiled KFP YAML and walking its DAGs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

# rl-step: the plan, then the gate (``step-unless-done``: a condition on the plan's ``skip``)
# holding every other stage
STEP_TASKS = {"controller-plan", "step-unless-done"}
GATED_TASKS = {"profile-if-needed", "rollout", "sandbox-reward", "judge", "training", "controller-commit"}
SKIP_CONDITION = "inputs.parameter_values['pipelinechannel--skip'] == false"


def load_docs(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"
    return docs


def parse_strict(docs: list[dict[str, Any]]) -> tuple[pipeline_spec_pb2.PipelineSpec, Any]:
    """The PipelineSpec (first document) and the PlatformSpec (second, if any), rejecting unknown
    fields anywhere (json_format.ParseError)."""
    spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec(), ignore_unknown_fields=False)
    platform = None
    if len(docs) > 1:
        platform = json_format.ParseDict(
            docs[1], pipeline_spec_pb2.PlatformSpec(), ignore_unknown_fields=False
        )
    assert len(docs) <= 2, f"unexpected extra YAML documents: {len(docs)}"
    return spec, platform


def load_spec(path: Path) -> pipeline_spec_pb2.PipelineSpec:
    return parse_strict(load_docs(path))[0]


def dag_of(spec: pipeline_spec_pb2.PipelineSpec, component: str) -> Any:
    comp = spec.components[component]
    assert comp.WhichOneof("implementation") == "dag", f"{component} is not a DAG"
    return comp.dag


def ancestors(tasks: Any, name: str) -> set[str]:
    """Every task ``name`` (transitively) runs after, within one DAG."""
    seen: set[str] = set()
    todo = list(tasks[name].dependent_tasks)
    while todo:
        t = todo.pop()
        if t not in seen:
            seen.add(t)
            todo.extend(tasks[t].dependent_tasks)
    return seen


def all_dag_tasks(spec: pipeline_spec_pb2.PipelineSpec) -> list[tuple[str, str, Any]]:
    """(dag name, task name, task spec) for every task of the root and every component DAG."""
    out = [("root", n, t) for n, t in spec.root.dag.tasks.items()]
    for cname, comp in spec.components.items():
        if comp.WhichOneof("implementation") == "dag":
            out += [(cname, n, t) for n, t in comp.dag.tasks.items()]
    return out


def executor_of(spec: pipeline_spec_pb2.PipelineSpec, task: Any) -> str:
    return spec.components[task.component_ref.name].executor_label


def containers(spec: pipeline_spec_pb2.PipelineSpec) -> dict[str, dict[str, Any]]:
    """executor label -> its container spec, as a dict."""
    execs = json_format.MessageToDict(spec.deployment_spec)["executors"]
    return {label: e["container"] for label, e in execs.items()}


def gated(spec: pipeline_spec_pb2.PipelineSpec, gate: Any) -> tuple[Any, Any]:
    """The gate task's one condition task and the tasks under that condition."""
    (cond,) = dag_of(spec, gate.component_ref.name).tasks.values()
    return cond, dag_of(spec, cond.component_ref.name).tasks
