"""``rollpacker up`` / ``rollpacker down``: the local services (S3 store, MLflow server, Ray head)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Annotated

import typer

from .common import Done, command, shown

services_app = typer.Typer()


@command(services_app, "up")
def services_up(
    root: Annotated[
        Path | None,
        shown(
            "Directory of the services' data, logs, pid files and credentials.",
            "$ROLLPACKER_SERVICES_DIR, else build/services",
        ),
    ] = None,
    bucket: Annotated[str, typer.Option(help="S3 bucket to create (store.bucket).")] = "rollpacker",
    port_offset: Annotated[
        int, typer.Option(help="Move every default port by N, e.g. 100 (a second set beside a running one).")
    ] = 0,
    s3_port: Annotated[
        int | None,
        typer.Option(help="SeaweedFS S3 port (store.endpoint 127.0.0.1:PORT).", show_default="8333 + offset"),
    ] = None,
    mlflow_port: Annotated[
        int | None, typer.Option(help="MLflow server port.", show_default="5000 + offset")
    ] = None,
    ray_port: Annotated[
        int | None, typer.Option(help="Ray head (GCS) port on 127.0.0.2.", show_default="6380 + offset")
    ] = None,
    mlflow: Annotated[bool, typer.Option(help="Start the MLflow server.")] = True,
    ray: Annotated[bool, typer.Option(help="Start the Ray head.")] = True,
    timeout_s: Annotated[float, typer.Option(help="Longest wait for each service to answer.")] = 90.0,
) -> Done:
    """Start the local services: SeaweedFS (S3 store), an MLflow server, a Ray head.

    Services already running and healthy are reused. Prints the addresses (to stderr) and the
    `export` lines a client needs (to stdout), so `eval "$(rollpacker up)"` sets them. The S3 keys
    are generated on the first run and kept in ROOT/credentials.json (mode 0600), which rollpacker
    also reads when $ROLLPACKER_S3_ACCESS_KEY / $ROLLPACKER_S3_SECRET_KEY are unset.
    Stop them with `rollpacker down`.
    """
    from rollpacker import devservices
    from rollpacker.core.paths import writable_dir

    root = root if root is not None else devservices.services_dir()
    sw_ports = devservices.SeaweedPorts().shifted(port_offset)
    ray_ports = devservices.RayPorts().shifted(port_offset)
    writable_dir(root, "--root")
    svc = devservices.up(
        root,
        bucket=bucket,
        mlflow=mlflow,
        ray=ray,
        seaweed_ports=dataclasses.replace(sw_ports, s3=s3_port or sw_ports.s3),
        mlflow_port=mlflow_port or 5000 + port_offset,
        ray_ports=dataclasses.replace(ray_ports, gcs=ray_port or ray_ports.gcs),
        timeout_s=timeout_s,
        log=lambda s: typer.echo(f"[up] {s}", err=True),
    )
    lines = [f"S3 store      {svc.s3_endpoint}  bucket {svc.bucket}  (keys in {svc.credentials_file})"]
    if svc.tracking_uri:
        lines.append(f"MLflow        {svc.tracking_uri}  (UI in a browser)")
    if svc.ray_address:
        lines.append(f"Ray head      {svc.ray_address}")
    lines.append(f"started: {', '.join(svc.started) or '-'}   reused: {', '.join(svc.reused) or '-'}")
    default_root = root.resolve() == devservices.services_dir().resolve()
    lines.append(
        "stop with: rollpacker down" if default_root else f"stop with: rollpacker down --root {root}"
    )
    typer.echo("\n".join(lines), err=True)
    return Done("\n".join(f"export {key}={shlex.quote(value)}" for key, value in svc.env().items()))


@command(services_app, "down")
def services_down(
    root: Annotated[
        Path | None, shown("Directory `rollpacker up` used.", "$ROLLPACKER_SERVICES_DIR, else build/services")
    ] = None,
    grace_s: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL.")] = 5.0,
) -> Done:
    """Stop the local services `rollpacker up` started (by PID; nothing else is touched).

    Data (S3 objects, the MLflow database) and credentials stay in ROOT for the next `up`.
    """
    from rollpacker import devservices

    root = root if root is not None else devservices.services_dir()
    counts = devservices.down(root, grace_s=grace_s)
    lines = [] if counts else [f"nothing to stop: no services recorded in {root / 'pids'}"]
    lines += [f"{name}: stopped ({n} process{'es' if n != 1 else ''})" for name, n in counts.items()]
    return Done("\n".join(lines))
