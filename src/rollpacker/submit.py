"""``rollpacker submit --host URL``: compile the experiment pipeline, upload it to a Kubeflow Pipelines
server with ``kfp.Client`` and start one run per arm (the KFP-UI way, scripted).

What it does, in order:
1. checks the URL, that something answers at its host and port, and that it is the KFP API (its
   health endpoint), each with a clear error rather than a retry loop;
2. reads the experiment config (``--config``, ``--set`` overrides; the cluster's is
   ``manifests/experiment.yaml``) and compiles ``rl_experiment`` with ``--steps`` (default: the
   config's ``steps``) chained steps (``rollpacker.pipeline_compile``);
3. uploads it as pipeline ``--pipeline-name`` (a new version if that pipeline exists);
4. gets or creates the KFP experiment ``--experiment`` (default: the config's ``experiment``);
5. starts one run per arm (``--arm``, default every arm of the config) with the parameters
   ``config`` (the config's YAML text, overrides applied) and ``arm``, as ``--service-account``.

Before anything is uploaded, the arms' GPUs are checked against the worker groups the config
declares (``services.gpus``; core/placement.py) under ``services.arms``: ``disjoint`` starts every
arm's run at once, each on GPUs of its own; ``sequential`` starts the first arm's run, waits for it
to succeed (polling KFP every ``poll_s``), then starts the next. Sequencing here rather than in one
pipeline of all arms: a pipeline of 40 chained steps already compiles to 1.2 MB, near the 1.5 MB a
Kubernetes object (the Argo Workflow) may hold, and two arms would double it. The next arm's first
stage releases the finished arm's services on the cluster (services/registry.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

from rollpacker.core.config import ArmSchedule, arm_config
from rollpacker.core.errors import RollpackerError
from rollpacker.core.placement import declared_capacity, plan_placement
from rollpacker.tasks.models import check_model

DEFAULT_PIPELINE = "rollpacker-rl-experiment"
DEFAULT_SERVICE_ACCOUNT = "rollpacker-pipeline"  # manifests/base/rbac
DEFAULT_POLL_S = 60.0  # services.arms: sequential: how often the state of the running arm's run is read
# KFP v2 run states after which a run does nothing more (V2beta1RuntimeState)
ENDED = frozenset({"SUCCEEDED", "FAILED", "CANCELED", "SKIPPED"})


class SubmitError(RollpackerError):
    """The pipeline could not be submitted; the message says what to fix."""


@dataclasses.dataclass(frozen=True)
class SubmittedRun:
    arm: str
    run_id: str
    url: str


@dataclasses.dataclass(frozen=True)
class Submission:
    pipeline_id: str
    version_id: str
    experiment_id: str
    package: Path
    runs: tuple[SubmittedRun, ...]


def check_host(host: str, timeout_s: float = 5.0) -> str:
    """``host`` without a trailing slash, after checking it is an http(s) URL whose host:port accepts
    a TCP connection."""
    url = urllib.parse.urlsplit(host)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise SubmitError(
            f"--host {host!r}: use the KFP API's URL with its scheme, e.g. http://localhost:8888 "
            "(kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8888:80)"
        )
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError as e:
        raise SubmitError(f"--host {host!r}: {e}") from e
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise SubmitError(
            f"--host {host!r}: nothing answers at {url.hostname}:{port} ({e}); is the KFP API reachable "
            "from here (a port-forward running, the right port)?"
        ) from e
    return host.rstrip("/")


def probe_api(host: str, token: str = "", timeout_s: float = 10.0) -> None:
    """One GET of the KFP API's health endpoint, so that a wrong URL or missing credentials fail at
    once with a clear message (kfp.Client retries its health check for ~25 s, then times out)."""
    import json
    import urllib.error
    import urllib.request

    url = f"{host}/apis/v2beta1/healthz"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise _kfp_error("the health check", host, e) from e
    except (urllib.error.URLError, OSError) as e:
        raise SubmitError(f"--host {host!r}: {url} did not answer ({getattr(e, 'reason', e)})") from e
    try:
        json.loads(body)
    except ValueError as e:
        raise SubmitError(
            f"--host {host!r}: {url} answered, but not with JSON: not the KFP API, or a login page in front "
            "of it (set KFP_TOKEN, or port-forward to the ml-pipeline-ui service inside the cluster)"
        ) from e


def config_text(path: Path, overrides: dict[str, Any] | None = None) -> tuple[str, Any]:
    """The config's YAML text as the pipeline gets it (overrides applied) and the validated config."""
    import yaml

    from rollpacker.core.config import config_from_text, load_config, resolve_config

    path = resolve_config(path)
    cfg = load_config(path, overrides)
    if not overrides:
        return path.read_text(), cfg
    data = yaml.safe_load(path.read_text()) or {}
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = value
    text = yaml.safe_dump(data, sort_keys=False)
    config_from_text(text, where=f"{path} with overrides")  # the same validation the stages do
    return text, cfg


def memory_preflight(cfg: Any, log: Any = print) -> None:
    """Refuse a megatron GPU plan whose ranks cannot fit ``train.megatron.gpu_memory_gib``
    (``core/memory.py``) before anything is uploaded, when the model's ``config.json`` is readable
    here; otherwise the training gang runs the same check before its ranks start."""
    import json

    from rollpacker.core.memory import ModelShape, check_fits, training_plan

    plan = training_plan(cfg)
    if plan is None:
        return
    f = Path(cfg.model.model_dir or ".") / "config.json"
    if not cfg.model.model_dir or not f.is_file():
        log(f"memory preflight: {f} is not readable here; the training gang checks it before its ranks start")
        return
    est = check_fits(ModelShape.from_hf_config(json.loads(f.read_text()), str(f)), plan)
    log(f"memory preflight: {est.render()} per training GPU, within gpu_memory_gib = {plan.gpu_memory_gib:g}")


def _kfp_error(action: str, host: str, e: Exception) -> SubmitError:
    status = getattr(e, "status", None) or getattr(e, "code", None)
    body = getattr(e, "body", None) or (e.read().decode(errors="replace") if hasattr(e, "read") else str(e))
    body = str(body).strip()
    hint = {
        401: "the server wants credentials (set KFP_TOKEN, or use a port-forward inside the cluster)",
        403: "the credentials may not do this in that namespace (--namespace)",
        404: f"{host} is not the KFP API (use the ml-pipeline-ui or ml-pipeline service's URL)",
    }.get(status or 0, "see the server's answer above")
    return SubmitError(f"{action} at {host} failed ({status or type(e).__name__}): {body[:500]}; {hint}")


def submit(
    host: str,
    config: Path,
    *,
    overrides: dict[str, Any] | None = None,
    experiment: str = "",
    steps: int | None = None,
    arms: list[str] | None = None,
    pipeline_name: str = DEFAULT_PIPELINE,
    namespace: str = "",
    service_account: str = DEFAULT_SERVICE_ACCOUNT,
    out_dir: Path = Path("build"),
    token: str = "",
    client_factory: Any = None,
    log: Any = print,
    poll_s: float = DEFAULT_POLL_S,
) -> Submission:
    """Compile, upload and run (see the module docstring); returns the ids and run URLs."""
    host = check_host(host)
    text, cfg = config_text(config, overrides)
    for arm in cfg.arm_names:  # the model's shape against each arm's settings, when readable here
        check_model(arm_config(text, arm), local=False, log=log)
    memory_preflight(cfg, log)
    steps = cfg.steps if steps is None else steps
    arms = _check_arms(arms or cfg.arm_names, cfg.arm_names, config)
    check_placement(cfg, arms, log)
    if cfg.services.arms is ArmSchedule.SEQUENTIAL and len(arms) > 1 and steps < cfg.steps:
        raise SubmitError(
            f"--steps {steps} with services.arms: sequential: arm {arms[1]}'s services start only once "
            f"arm {arms[0]} has committed all steps = {cfg.steps}, so its run would be refused; pass "
            f"--set steps={steps} to make {steps} the experiment's length, or submit one arm (--arm)"
        )
    experiment = experiment or cfg.experiment
    probe_api(host, token)
    package = _compile(out_dir, steps, log)

    if client_factory is None:
        import kfp

        client_factory = kfp.Client
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    try:
        client = _connect(client_factory, host, namespace, token)
        pipeline_id, version_id = _upload(client, package, pipeline_name, steps, stamp, log)
        exp = client.create_experiment(name=experiment, namespace=namespace or None)
        sequential = cfg.services.arms is ArmSchedule.SEQUENTIAL
        runs: list[SubmittedRun] = []
        for i, arm in enumerate(arms):
            if sequential and runs:
                _wait_for(client, runs[-1], arms[i:], poll_s, log)
            runs.append(
                _start_run(
                    client,
                    host,
                    exp.experiment_id,
                    f"{cfg.experiment}-{arm}-{stamp}",
                    {"config": text, "arm": arm},
                    pipeline_id,
                    version_id,
                    service_account,
                    log,
                )
            )
    except SubmitError:
        raise
    except Exception as e:  # kfp_server_api.ApiException, urllib3 errors, ...
        raise _kfp_error("talking to Kubeflow Pipelines", host, e) from e
    return Submission(
        pipeline_id=pipeline_id,
        version_id=version_id,
        experiment_id=exp.experiment_id,
        package=package,
        runs=tuple(runs),
    )


def check_placement(cfg: Any, arms: list[str], log: Any) -> None:
    """The arms' GPUs against the worker groups ``services.gpus`` declares (``PlacementError``, a
    ``ConfigError``, names what does not fit and what to change); when none are declared the check
    waits for the cluster (the services check Ray's nodes before their first actor starts)."""
    if not cfg.services.gpus.declared:
        log("services.gpus declares no GPUs: the cluster's are checked when the services start")
        return
    log(plan_placement(cfg, arms, declared_capacity(cfg), "services.gpus").describe())


def _wait_for(client: Any, run: SubmittedRun, rest: list[str], poll_s: float, log: Any) -> None:
    """``services.arms: sequential``: return when ``run`` succeeded; a ``SubmitError`` naming the
    arms not started when it ended otherwise, or when the wait is interrupted."""
    import time

    later = " ".join(f"--arm {a}" for a in rest)
    log(
        f"services.arms: sequential: waiting for arm {run.arm}'s run to end before starting {', '.join(rest)}"
    )
    try:
        while True:
            state = str(client.get_run(run.run_id).state or "")
            if state in ENDED:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        raise SubmitError(
            f"interrupted while arm {run.arm}'s run {run.run_id} goes on ({run.url}); when it has "
            f"succeeded, start the next arm(s) with `rollpacker submit {later}`"
        ) from None
    if state != "SUCCEEDED":
        raise SubmitError(
            f"arm {run.arm}'s run {run.run_id} ended {state} ({run.url}), so {', '.join(rest)} were not "
            f"started (services.arms: sequential runs one arm at a time); submit `--arm {run.arm}` again "
            f"to resume it from its last committed step, then `{later}`"
        )
    log(f"arm {run.arm}'s run {run.run_id} succeeded")


def _check_arms(arms: list[str], known: list[str], config: Path) -> list[str]:
    """``arms`` as a new list, after checking each is an arm of the config."""
    arms = list(arms)
    unknown = [a for a in arms if a not in known]
    if unknown:
        raise SubmitError(f"--arm {unknown}: not arms of {config} (its arms: {known})")
    return arms


def _compile(out_dir: Path, steps: int, log: Any) -> Path:
    """Compile the pipelines with ``steps`` chained steps; the ``rl_experiment`` package."""
    from rollpacker.pipeline_compile import compile_pipelines

    package = next(p for p in compile_pipelines(out_dir, steps) if p.name == "rl_experiment.yaml")
    log(f"compiled {package} ({steps} step{'s' if steps != 1 else ''})")
    return package


def _connect(client_factory: Any, host: str, namespace: str, token: str) -> Any:
    """The KFP client for ``host`` (in ``namespace``, with ``token`` when given)."""
    kwargs: dict[str, Any] = {"host": host}
    if namespace:
        kwargs["namespace"] = namespace
    if token:
        kwargs["existing_token"] = token
    with warnings.catch_warnings():  # "only works with KFP v2.0.0-beta.2 and later": said in the docs
        warnings.simplefilter("ignore", FutureWarning)
        return client_factory(**kwargs)


def _upload(
    client: Any, package: Path, pipeline_name: str, steps: int, stamp: str, log: Any
) -> tuple[str, str]:
    """Upload ``package`` as pipeline ``pipeline_name``, or as a new version of it when it exists;
    the pipeline's id and the version's."""
    pipeline_id = client.get_pipeline_id(pipeline_name)
    if pipeline_id is None:
        pipeline = client.upload_pipeline(
            str(package),
            pipeline_name=pipeline_name,
            description=f"rollpacker: {steps} RL steps of one arm",
        )
        pipeline_id = pipeline.pipeline_id
        versions = client.list_pipeline_versions(pipeline_id, sort_by="created_at desc").pipeline_versions
        if not versions:
            raise SubmitError(f"pipeline {pipeline_name} ({pipeline_id}) was uploaded but has no version")
        version_id = versions[0].pipeline_version_id
        log(f"uploaded pipeline {pipeline_name} ({pipeline_id})")
    else:
        version = client.upload_pipeline_version(
            str(package),
            pipeline_version_name=f"{pipeline_name}-{steps}steps-{stamp}",
            pipeline_id=pipeline_id,
        )
        version_id = version.pipeline_version_id
        log(f"uploaded a new version of pipeline {pipeline_name} ({pipeline_id}, version {version_id})")
    return pipeline_id, version_id


def _start_run(
    client: Any,
    host: str,
    experiment_id: str,
    job_name: str,
    params: dict[str, str],
    pipeline_id: str,
    version_id: str,
    service_account: str,
    log: Any,
) -> SubmittedRun:
    """Start one run of the pipeline version (``params["arm"]`` is its arm) and log its URL."""
    run = client.run_pipeline(
        experiment_id=experiment_id,
        job_name=job_name,
        params=params,
        pipeline_id=pipeline_id,
        version_id=version_id,
        enable_caching=False,
        service_account=service_account or None,
    )
    url = f"{host}/#/runs/details/{run.run_id}"
    log(f"started run {run.run_id} (arm {params['arm']}): {url}")
    return SubmittedRun(arm=params["arm"], run_id=run.run_id, url=url)
