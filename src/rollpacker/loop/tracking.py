"""MLflow tracking for local runs: params, per-step metrics, the groups log, the run summary.

Uses ``MlflowClient`` with an explicit run id (no global active run), so several runs can be
tracked from one process (the learning benchmark) and a resumed run keeps logging into the same
MLflow run. Any tracking URI works; the default is a SQLite file under ``build/`` (MLflow's plain
file store is disabled in 3.x), with artifacts in ``build/mlartifacts``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollpacker.core.config import ExperimentConfig
from rollpacker.core.errors import ConfigError
from rollpacker.tracking import artifact_root
from rollpacker.tracking import flatten_params as _flatten


class Tracker:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, run_id: str | None = None) -> None:
        import logging

        logging.getLogger("alembic").setLevel(logging.WARNING)
        from mlflow.tracking import MlflowClient

        self.run_dir = run_dir
        root = artifact_root(cfg.tracking_uri)
        try:
            self.client = MlflowClient(tracking_uri=cfg.tracking_uri)
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = (
                exp.experiment_id
                if exp
                else self.client.create_experiment(cfg.experiment, artifact_location=root)
            )
        except Exception as e:  # MLflow raises many types; name the URI
            raise ConfigError(f"tracking_uri = {cfg.tracking_uri!r}: MLflow could not be reached: {e}") from e
        self.tracking_uri = cfg.tracking_uri
        self.experiment_id = exp_id
        if run_id is None:
            run = self.client.create_run(
                exp_id,
                run_name=run_dir.name,
                tags={"rollpacker.policy": cfg.rollout.policy.value, "rollpacker.seed": str(cfg.seed)},
            )
            run_id = run.info.run_id
            params = _flatten(cfg)
            from mlflow.entities import Param

            items = [Param(k, v[:6000]) for k, v in sorted(params.items())]
            for i in range(0, len(items), 100):
                self.client.log_batch(run_id, params=items[i : i + 100])
            (run_dir / "groups.jsonl").unlink(missing_ok=True)
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), ts, step) for k, v in metrics.items()]
        )

    def append_groups(self, rec: Any) -> None:
        line = {
            "step": rec.step,
            "round_kind": rec.round_kind,
            "trained": rec.trained_prompts,
            "deferred": rec.deferred_prompts,
            "from_queue": rec.from_queue,
        }
        with (self.run_dir / "groups.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def finish(self, summary: Any) -> None:
        data = asdict(summary)
        data.pop("records", None)
        (self.run_dir / "summary.json").write_text(json.dumps(data, indent=2))
        for name in ("groups.jsonl", "summary.json"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        self.client.set_terminated(self.run_id)
