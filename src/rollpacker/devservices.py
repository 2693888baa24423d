"""The embedded local services of one machine: SeaweedFS (S3), an MLflow server, a Ray head.

``rollpacker up`` (``make up``) starts what is not already running and healthy, and ``rollpacker
down`` stops what ``up`` started, by PID, and nothing else (never ``ray stop``, which kills every Ray
process on the machine). Everything lives under one directory, ``build/services`` by default::

    credentials.json   the local S3 keys (mode 0600; S3Store falls back to them)
    s3.json            SeaweedFS identities (the same keys, mode 0600)
    s3/                SeaweedFS data          mlflow.db     MLflow's sqlite backend store
    logs/<name>.log    each service's output   pids/<name>.json  what was started: session, PIDs, address
    tmp/<name>/        each service's temporary files (Ray's: its workers'); `down` removes them

Each service is started in a new session (``setsid``); its record holds the session id and the
session leader's start time. ``ray start`` daemonizes, but the GCS server, raylet, agents and
every worker it spawns stay in that session, so ``down`` finds them all by session id, including
workers started after ``up``. A session id is only trusted while its leader is either gone or is
the very process recorded (same start time), so a recycled PID is never killed.

Healthy means "works" the way its users use it: SeaweedFS answers a bucket operation, MLflow an API
call on its backend store, the Ray head has its GCS server and raylet alive and takes a real client
connection (``ray.init`` in a child process). A service that fails this is stopped and started again,
whatever its pid file says: processes an ``up`` under the same root started (their ``TMPDIR`` is its
``tmp/<name>``) that still hold the service's ports are stopped even when no pid file names them.

Invariants (tests/store/test_devservices.py):
- ``up`` is idempotent: a running, healthy service is reused, not restarted;
- a service that does not work (a Ray head whose raylet died, an MLflow whose API fails) is not
  reused: it is stopped whole and started again, with or without its pid file;
- ``down`` stops exactly the processes of the sessions ``up`` started, and removes their
  temporary directories;
- a service that does not become healthy in time is stopped again and the error names its log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.core.errors import RollpackerError
from rollpacker.store.base import StoreError
from rollpacker.store.s3 import (
    CREDENTIALS_FILE,
    DEFAULT_SERVICES_DIR,
    SERVICES_DIR_ENV,
    S3Store,
)

DEFAULT_ROOT = DEFAULT_SERVICES_DIR
SERVICE_NAMES = ("seaweedfs", "mlflow", "ray")
HOST = "127.0.0.1"
RAY_HOST = "127.0.0.2"  # Ray rewrites 127.0.0.1 to the machine's external address
DEFAULT_BUCKET = "rollpacker"
RAY_CLIENT_TIMEOUT_S = 60.0  # a client connection to a working head takes a few seconds

# Popen objects of the services this process started (kept so that they are reaped, not warned about).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


class ServicesError(RollpackerError, RuntimeError):
    """A local service cannot start (port taken, binary missing, unhealthy) or stop."""


@dataclass(frozen=True)
class SeaweedPorts:
    """Every port ``weed mini`` listens on (its defaults; the admin server listens even with
    ``-admin.ui=false``)."""

    s3: int = 8333
    s3_grpc: int = 18333
    master: int = 9333
    master_grpc: int = 19333
    volume: int = 9340
    volume_grpc: int = 19340
    filer: int = 8888
    filer_grpc: int = 18888
    admin: int = 23646
    admin_grpc: int = 33646

    @classmethod
    def free(cls) -> SeaweedPorts:
        """Ports free right now (for tests beside a running default instance). Each gRPC port is its
        HTTP port + 10000, as weed expects: its built-in worker dials the admin server there whatever
        ``-admin.port.grpc`` says."""
        s3, master, volume, filer, admin = _free_port_pairs(5, offset=10000)
        return cls(
            s3=s3,
            s3_grpc=s3 + 10000,
            master=master,
            master_grpc=master + 10000,
            volume=volume,
            volume_grpc=volume + 10000,
            filer=filer,
            filer_grpc=filer + 10000,
            admin=admin,
            admin_grpc=admin + 10000,
        )

    def shifted(self, offset: int) -> SeaweedPorts:
        """Every port moved by ``offset`` (a second instance beside the default one)."""
        return SeaweedPorts(*(p + offset for p in dataclasses.astuple(self)))

    def args(self) -> list[str]:
        return [
            f"-s3.port={self.s3}",
            f"-s3.port.grpc={self.s3_grpc}",
            f"-master.port={self.master}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-admin.port={self.admin}",
            f"-admin.port.grpc={self.admin_grpc}",
        ]


@dataclass(frozen=True)
class RayPorts:
    """The fixed ports of the local Ray head; the rest are picked free by Ray. Workers bind in
    ``min_worker..max_worker``, kept clear of SeaweedFS's gRPC ports (18333-19340)."""

    gcs: int = 6380
    client_server: int = 10001
    dashboard_agent: int = 52365
    min_worker: int = 20002
    max_worker: int = 29999

    @classmethod
    def free(cls) -> RayPorts:
        gcs, client, agent = free_ports(3)
        return cls(gcs=gcs, client_server=client, dashboard_agent=agent)

    def shifted(self, offset: int) -> RayPorts:
        """The fixed ports moved by ``offset`` (the worker range stays)."""
        return dataclasses.replace(
            self,
            gcs=self.gcs + offset,
            client_server=self.client_server + offset,
            dashboard_agent=self.dashboard_agent + offset,
        )


@dataclass(frozen=True)
class Services:
    """The addresses of the local services, and what ``up`` did."""

    root: Path
    s3_endpoint: str  # host:port, as store.endpoint takes it
    bucket: str
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    tracking_uri: str = ""  # "" when MLflow was not asked for
    ray_address: str = ""  # "" when Ray was not asked for
    started: tuple[str, ...] = ()
    reused: tuple[str, ...] = ()
    startup_s: dict[str, float] = field(default_factory=dict)

    @property
    def credentials_file(self) -> Path:
        return self.root / CREDENTIALS_FILE

    def env(self) -> dict[str, str]:
        """The environment a client of these services needs."""
        out = {"ROLLPACKER_S3_ACCESS_KEY": self.access_key, "ROLLPACKER_S3_SECRET_KEY": self.secret_key}
        if self.ray_address:
            out["RAY_ADDRESS"] = self.ray_address
        if self.tracking_uri:
            out["MLFLOW_TRACKING_URI"] = self.tracking_uri
        if self.root.resolve() != DEFAULT_ROOT.resolve():
            out[SERVICES_DIR_ENV] = str(self.root)
        return out


@dataclass(frozen=True)
class ServiceStatus:
    name: str
    running: bool  # processes of its recorded session are alive
    healthy: bool  # and it answers
    address: str
    pids: tuple[int, ...]
    log: str


# -- public API ----------------------------------------------------------------------------------


def up(
    root: Path | str | None = None,
    *,
    bucket: str = DEFAULT_BUCKET,
    s3: bool = True,
    mlflow: bool = True,
    ray: bool = True,
    seaweed_ports: SeaweedPorts | None = None,
    mlflow_port: int = 5000,
    ray_ports: RayPorts | None = None,
    ray_num_cpus: int = 2,
    timeout_s: float = 90.0,
    log: Callable[[str], None] | None = None,
) -> Services:
    """Start the local services that are not already running and healthy (concurrently), wait
    until each answers, and return their addresses. MLflow keeps artifacts in the S3 store, so
    asking for MLflow starts SeaweedFS too. ``root``: default ``services_dir()``
    ($ROLLPACKER_SERVICES_DIR, else build/services), where the clients look for the credentials."""
    root = Path(root) if root is not None else services_dir()
    sw_ports = seaweed_ports or SeaweedPorts()
    r_ports = ray_ports or RayPorts()
    s3 = s3 or mlflow
    say = log or (lambda s: None)
    for sub in ("logs", "pids"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    with _lock(root):
        creds = _read_credentials(root)
        wanted = [n for n, on in (("seaweedfs", s3), ("mlflow", mlflow), ("ray", ray)) if on]
        addresses, ports = _addresses_and_ports(sw_ports, mlflow_port, r_ports)
        reused = _reuse_healthy(root, wanted, addresses, ports, creds, bucket, say)
        endpoint = addresses["seaweedfs"]
        creds = _ensure_credentials(root, endpoint, bucket)
        if "seaweedfs" in reused:  # the bucket asked for now may be new
            _s3_client(endpoint, creds, bucket, root).create_bucket()
        starters: dict[str, Callable[[], dict[str, Any]]] = {
            "seaweedfs": lambda: _start_seaweed(root, sw_ports, creds, bucket, timeout_s),
            "mlflow": lambda: _start_mlflow(root, mlflow_port, endpoint, creds, bucket, timeout_s),
            "ray": lambda: _start_ray(root, r_ports, ray_num_cpus, timeout_s),
        }
        results = _start_all(root, {n: starters[n] for n in wanted if n not in reused})
        startup = {}
        for name, rec in results.items():
            _write_record(root, name, rec)
            startup[name] = rec["startup_s"]
            say(f"{name}: started in {rec['startup_s']:.1f} s at {rec['address']} (log {rec['log']})")
    order = [n for n in SERVICE_NAMES if n in results]
    return Services(
        root=root,
        s3_endpoint=endpoint if s3 else "",
        bucket=bucket,
        access_key=creds["access_key"],
        secret_key=creds["secret_key"],
        tracking_uri=addresses["mlflow"] if mlflow else "",
        ray_address=addresses["ray"] if ray else "",
        started=tuple(order),
        reused=tuple(n for n in SERVICE_NAMES if n in reused),
        startup_s=startup,
    )


def _addresses_and_ports(
    sw_ports: SeaweedPorts, mlflow_port: int, r_ports: RayPorts
) -> tuple[dict[str, str], dict[str, list[tuple[str, int]]]]:
    """Each service's address, and the (host, port) pairs it listens on."""
    addresses = {
        "seaweedfs": f"{HOST}:{sw_ports.s3}",
        "mlflow": f"http://{HOST}:{mlflow_port}",
        "ray": f"{RAY_HOST}:{r_ports.gcs}",
    }
    ports = {
        "seaweedfs": [(HOST, p) for p in dataclasses.astuple(sw_ports)],
        "mlflow": [(HOST, mlflow_port)],
        "ray": [
            (RAY_HOST, r_ports.gcs),
            (RAY_HOST, r_ports.client_server),
            (RAY_HOST, r_ports.dashboard_agent),
        ],
    }
    return addresses, ports


def _reuse_healthy(
    root: Path,
    wanted: list[str],
    addresses: dict[str, str],
    ports: dict[str, list[tuple[str, int]]],
    creds: dict[str, str] | None,
    bucket: str,
    say: Callable[[str], None],
) -> list[str]:
    """The wanted services already running and healthy (their recorded address goes into
    ``addresses``). A recorded but unhealthy one is stopped; a port that another process holds
    is a ``ServicesError``."""
    reused: list[str] = []
    for name in wanted:
        rec = _read_record(root, name)
        if rec is not None:
            if _members(rec) and _healthy(name, rec, creds, bucket):
                say(f"{name}: running (pid file {_pid_file(root, name)}), reused")
                addresses[name] = rec["address"]
                reused.append(name)
                continue
            say(f"{name}: recorded but not working; stopping it and starting it again")
            _stop([rec], grace_s=5.0)
            _pid_file(root, name).unlink(missing_ok=True)
        if _stop_unrecorded(root, name, ports[name]):
            say(f"{name}: stopped processes an earlier `up` here started that no pid file named")
        taken = [f"{h}:{p}" for h, p in ports[name] if _port_open(h, p)]
        if taken:
            raise ServicesError(
                f"{name}: {', '.join(taken)} in use by a process `rollpacker up` did not start "
                f"(no live record in {root / 'pids'}); stop that process or pick other ports "
                "(`rollpacker up --port-offset N` moves them all)"
            )
    return reused


def _stop_unrecorded(root: Path, name: str, ports: list[tuple[str, int]]) -> int:
    """Stop the sessions of processes that an ``up`` under ``root`` started for ``name`` (their
    ``TMPDIR`` is its ``tmp/<name>``) and that still listen on its ports although no live record
    names them (a pid file removed or overwritten, a Ray head's daemons outliving their session's
    recorded leader); the number of sessions stopped."""
    import psutil

    marker = str((root / "tmp" / name).resolve())
    wanted = {p for _, p in ports}
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return 0
    sids: dict[int, float] = {}
    for c in conns:
        if not c.pid or c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port not in wanted:
            continue
        try:
            if psutil.Process(c.pid).environ().get("TMPDIR") != marker:
                continue  # not ours: the caller's port check names it
            sid = os.getsid(c.pid)
        except (OSError, psutil.Error):
            continue
        sids[sid] = _create_time(sid) if psutil.pid_exists(sid) else 0.0
    _stop([{"sid": sid, "leader_create_time": t} for sid, t in sids.items()], grace_s=5.0)
    return len(sids)


def _start_all(root: Path, starters: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Run every starter concurrently; their records by name. If any fails, the ones that started
    are stopped again and the error is raised (one ``RollpackerError`` as is, else a
    ``ServicesError`` naming each)."""
    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, BaseException] = {}

    def run(name: str, start: Callable[[], dict[str, Any]]) -> None:
        try:
            results[name] = start()
        except BaseException as e:
            errors[name] = e

    threads = [threading.Thread(target=run, args=(n, start), daemon=True) for n, start in starters.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        _stop([r for r in results.values()], grace_s=5.0)
        for name in results:
            _pid_file(root, name).unlink(missing_ok=True)
        first = next(iter(errors.values()))
        if isinstance(first, RollpackerError) and len(errors) == 1:
            raise first
        raise ServicesError("; ".join(f"{n}: {e}" for n, e in errors.items())) from first
    return results


def down(
    root: Path | str | None = None, *, grace_s: float = 5.0, names: Iterable[str] | None = None
) -> dict[str, int]:
    """Stop what ``up`` started under ``root`` (SIGTERM, then SIGKILL after ``grace_s``), remove
    the pid files; returns how many processes each service had. Data and credentials stay.
    ``names`` limits it to some services (e.g. ``Services.started``: only what one ``up`` started).
    ``root``: default ``services_dir()``."""
    root = Path(root) if root is not None else services_dir()
    wanted = SERVICE_NAMES if names is None else tuple(names)
    unknown = sorted(set(wanted) - set(SERVICE_NAMES))
    if unknown:
        raise ServicesError(f"down: unknown service(s) {unknown}; the services are {list(SERVICE_NAMES)}")
    recs = {n: r for n in SERVICE_NAMES if n in wanted and (r := _read_record(root, n)) is not None}
    with _lock(root) if root.is_dir() else contextlib.nullcontext():
        counts = {n: len(_members(r)) for n, r in recs.items()}
        _stop(list(recs.values()), grace_s=grace_s)
        for n in recs:
            _pid_file(root, n).unlink(missing_ok=True)
            shutil.rmtree(root / "tmp" / n, ignore_errors=True)  # its processes are gone
    return counts


@contextlib.contextmanager
def running(root: Path | str, *, grace_s: float = 3.0, **kw: Any) -> Iterator[Services]:
    """``up(root, **kw)`` for the block and ``down(root)`` after it (tests, benchmarks)."""
    svc = up(root, **kw)
    try:
        yield svc
    finally:
        down(root, grace_s=grace_s)


def status(root: Path | str | None = None) -> list[ServiceStatus]:
    """What ``up`` recorded under ``root`` (default ``services_dir()``), and whether it is alive and
    answering."""
    root = Path(root) if root is not None else services_dir()
    creds = _read_credentials(root)
    out = []
    for name in SERVICE_NAMES:
        rec = _read_record(root, name)
        if rec is None:
            out.append(ServiceStatus(name, False, False, "", (), str(root / "logs" / f"{name}.log")))
            continue
        members = _members(rec)
        healthy = bool(members) and _healthy(name, rec, creds, rec.get("bucket", DEFAULT_BUCKET))
        out.append(
            ServiceStatus(
                name, bool(members), healthy, rec["address"], tuple(p.pid for p in members), rec["log"]
            )
        )
    return out


def services_dir(env: dict[str, str] | None = None) -> Path:
    env = dict(os.environ) if env is None else env
    return Path(env.get(SERVICES_DIR_ENV) or DEFAULT_ROOT)


def local_ray_address(root: Path | str | None = None) -> str:
    """The address of the Ray head `rollpacker up` started, or "" when none is running."""
    rec = _read_record(Path(root) if root is not None else services_dir(), "ray")
    return str(rec["address"]) if rec is not None and _members(rec) else ""


def local_ray_head_broken(address: str, root: Path | str | None = None) -> bool:
    """Whether ``address`` is the Ray head `rollpacker up` started and that head lost its GCS server
    or raylet (a client's ``ray.init`` there hangs instead of failing); a cheap process check."""
    rec = _read_record(Path(root) if root is not None else services_dir(), "ray")
    if rec is None or str(rec["address"]) != address.removeprefix("ray://"):
        return False
    return bool(_members(rec)) and not _ray_daemons_alive(rec)


def local_tracking_uri(root: Path | str | None = None) -> str:
    """The MLflow server `rollpacker up` started, or "" when none is running."""
    rec = _read_record(Path(root) if root is not None else services_dir(), "mlflow")
    return str(rec["address"]) if rec is not None and _members(rec) else ""


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_port_pairs(n: int, offset: int) -> list[int]:
    """``n`` ports ``p`` with both ``p`` and ``p + offset`` free on 127.0.0.1 right now."""
    held: list[socket.socket] = []
    out: list[int] = []
    try:
        for _ in range(2000):
            if len(out) == n:
                return out
            a = socket.socket()
            a.bind((HOST, 0))
            held.append(a)
            port = a.getsockname()[1]
            if port + offset > 65535:
                continue
            b = socket.socket()
            try:
                b.bind((HOST, port + offset))
            except OSError:
                b.close()
                continue
            held.append(b)
            out.append(port)
        raise ServicesError(f"could not find {n} free port pairs (p, p+{offset}) on {HOST}")
    finally:
        for sock in held:
            sock.close()


# -- the three services --------------------------------------------------------------------------


READY_PROBE_KEY = ".rollpacker-ready-probe"


def _start_seaweed(
    root: Path, ports: SeaweedPorts, creds: dict[str, str], bucket: str, timeout_s: float
) -> dict[str, Any]:
    data = root / "s3"
    data.mkdir(parents=True, exist_ok=True)
    config = root / "s3.json"
    identity = {
        "name": "rollpacker",
        "credentials": [{"accessKey": creds["access_key"], "secretKey": creds["secret_key"]}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    _write_private(config, json.dumps({"identities": [identity]}, indent=1))
    cmd = [
        _bin("weed"),
        f"-logdir={(root / 'logs').resolve()}",  # glog's files, else they pile up in the temp dir
        "mini",
        f"-dir={data.resolve()}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config.resolve()}",
        *ports.args(),
    ]
    address = f"{HOST}:{ports.s3}"
    store = _s3_client(address, creds, bucket, root)

    def ready(_: dict[str, Any]) -> bool:
        """The bucket answers, and an object can be written and read back: the filer answers bucket
        calls before the volume server has registered, and reads in that window fail (InternalError,
        seen on a restart with data under load)."""
        try:
            store.create_bucket()
            store.put_bytes(READY_PROBE_KEY, b"ok")
            ok = store.get_bytes(READY_PROBE_KEY) == b"ok"
            store.delete(READY_PROBE_KEY)
        except StoreError:
            return False
        return ok

    return _launch_and_wait("seaweedfs", root, cmd, {}, address, ready, timeout_s, bucket=bucket)


def _start_mlflow(
    root: Path, port: int, s3_endpoint: str, creds: dict[str, str], bucket: str, timeout_s: float
) -> dict[str, Any]:
    db = (root / "mlflow.db").resolve()
    cmd = [
        _bin("mlflow"),
        "server",
        "-w",
        "1",
        "--host",
        HOST,
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{db}",
        "--artifacts-destination",
        f"s3://{bucket}/mlartifacts",
    ]
    env = {
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "MLFLOW_S3_ENDPOINT_URL": f"http://{s3_endpoint}",
        "AWS_ACCESS_KEY_ID": creds["access_key"],
        "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
    }
    address = f"http://{HOST}:{port}"
    return _launch_and_wait(
        "mlflow", root, cmd, env, address, lambda _: _mlflow_ok(address), timeout_s, bucket=bucket
    )


def _start_ray(root: Path, ports: RayPorts, num_cpus: int, timeout_s: float) -> dict[str, Any]:
    # A temp dir of our own (short: Ray's unix sockets live under it) keeps this head's session apart
    # from any other Ray on the machine.
    tag = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:10]
    temp_dir = Path(tempfile.gettempdir()) / f"rollpacker-ray-{tag}"
    cmd = [
        _bin("ray"),
        "start",
        "--head",
        f"--node-ip-address={RAY_HOST}",
        f"--port={ports.gcs}",
        f"--num-cpus={num_cpus}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={ports.client_server}",
        f"--dashboard-agent-listen-port={ports.dashboard_agent}",
        f"--min-worker-port={ports.min_worker}",
        f"--max-worker-port={ports.max_worker}",
    ]
    address = f"{RAY_HOST}:{ports.gcs}"
    return _launch_and_wait(
        "ray",
        root,
        cmd,
        # RAY_LOGGER_LEVEL: Ray's Python components log at INFO every runtime env they create, its
        # env_vars included (tests/test_secrets.py). The services directory goes to this node's
        # processes (the services' actors find the local store's credentials file through it): the
        # node's own setting, not a path a client forwards (services/registry.py)
        {"RAY_AUTH_MODE": "disabled", "RAY_LOGGER_LEVEL": "warning", SERVICES_DIR_ENV: str(root.resolve())},
        address,
        # the daemons up, then one real client connection (the check `up` reuses a head by)
        lambda rec: _port_open(RAY_HOST, ports.gcs) and _ray_daemons_alive(rec) and _ray_client_ok(address),
        timeout_s,
        daemonizes=True,
        temp_dir=str(temp_dir),
    )


def _healthy(name: str, rec: dict[str, Any], creds: dict[str, str] | None, bucket: str) -> bool:
    """Whether a recorded service works, checked the way its users use it: S3 with a bucket
    operation, MLflow with an API call on its backend store, Ray with its daemons alive (GCS server
    and raylet) and a real client connection (``ray.init`` on a head whose raylet died hangs)."""
    address = str(rec["address"])
    if name == "seaweedfs":
        if creds is None:
            return False
        try:
            S3Store(address, bucket, creds["access_key"], creds["secret_key"]).create_bucket()
        except StoreError:
            return False
        return True
    if name == "mlflow":
        return _mlflow_ok(address)
    return _ray_daemons_alive(rec) and _ray_client_ok(address)


def _mlflow_ok(address: str) -> bool:
    """An MLflow REST call that reads its backend store (``/health`` answers without it)."""
    return _http_ok(address + "/api/2.0/mlflow/experiments/search?max_results=1")


def _ray_daemons_alive(rec: dict[str, Any]) -> bool:
    """The head's GCS server and raylet are both alive in the recorded session."""
    names = {_name(p) for p in _members(rec)}
    return {"gcs_server", "raylet"} <= names


# a driver that joins the cluster and sees a live node: what `rollpacker run` does first
_RAY_CLIENT_PROBE = (
    "import sys, ray\n"
    "ray.init(address=sys.argv[1], logging_level='ERROR', log_to_driver=False)\n"
    "sys.exit(0 if any(n['Alive'] for n in ray.nodes()) else 3)\n"
)


def _ray_client_ok(address: str, timeout_s: float = RAY_CLIENT_TIMEOUT_S) -> bool:
    """A real client connection to the Ray head at ``address``, in a child process of its own
    session (killed whole when it hangs past ``timeout_s``)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_LOGGER_LEVEL": "warning"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", _RAY_CLIENT_PROBE, address],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False


# -- processes -----------------------------------------------------------------------------------


def _launch_and_wait(
    name: str,
    root: Path,
    cmd: list[str],
    extra_env: dict[str, str],
    address: str,
    ready: Callable[[dict[str, Any]], bool],
    timeout_s: float,
    *,
    daemonizes: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Start ``cmd`` in a new session with its output in ``logs/<name>.log``; wait until ``ready()``.
    ``ready`` gets the service's record (its session). A daemonizing command (``ray start``) must exit
    0 first. On failure the session is stopped."""
    log = root / "logs" / f"{name}.log"
    # the service's temporary files (a Ray head's: its workers', the actors') in a directory of its
    # own, not its caller's (which may be a run's, deleted while the service lives on); `down`
    # removes it, with what a killed process could not clean up (vLLM's rendezvous file, ...)
    tmp = root / "tmp" / name
    tmp.mkdir(parents=True, exist_ok=True)
    extra_env = {"TMPDIR": str(tmp.resolve()), **extra_env}
    proc, t0 = _spawn(cmd, extra_env, log)
    rec: dict[str, Any] = {
        "name": name,
        "sid": proc.pid,
        "leader_create_time": _create_time(proc.pid),
        "address": address,
        "log": str(log),
        "cmd": cmd,
        "started_at": time.time(),
        **extra,
    }
    _write_record(root, name, rec)  # at once: an interrupted `up` leaves nothing `down` cannot find
    deadline = time.monotonic() + timeout_s
    try:
        if daemonizes:
            _wait_daemonized(name, proc, cmd, log, timeout_s)
        while not ready(rec):
            if not daemonizes and proc.poll() is not None:
                raise ServicesError(
                    f"{name} exited with code {proc.returncode} while starting; see {log}:\n{_tail(log)}"
                )
            if time.monotonic() > deadline:
                raise ServicesError(
                    f"{name} did not answer at {address} within {timeout_s:.0f} s; see {log}:\n{_tail(log)}"
                )
            time.sleep(0.1)
    except BaseException:
        _stop([rec], grace_s=3.0)
        _pid_file(root, name).unlink(missing_ok=True)
        raise
    rec["startup_s"] = round(time.perf_counter() - t0, 2)
    rec["pids"] = [[p.pid, p.create_time()] for p in _members(rec)]
    return rec


def _spawn(cmd: list[str], extra_env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], float]:
    """Start ``cmd`` in a new session, its output appended to ``log`` after a header line; the
    process (kept in ``_CHILDREN``) and the ``perf_counter`` time it was started at."""
    with open(log, "ab") as f:
        f.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n".encode())
        f.flush()
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **extra_env},
            start_new_session=True,
        )
    _CHILDREN[proc.pid] = proc
    return proc, t0


def _create_time(pid: int) -> float:
    """A process's start time (now, when it cannot be read)."""
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return time.time()


def _wait_daemonized(
    name: str, proc: subprocess.Popen[bytes], cmd: list[str], log: Path, timeout_s: float
) -> None:
    """Wait for a daemonizing command (``ray start``) to exit; a ``ServicesError`` unless it exits 0
    within ``timeout_s``."""
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ServicesError(
            f"{name}: `{' '.join(cmd[:2])}` did not finish within {timeout_s:.0f} s; see {log}"
        ) from None
    _CHILDREN.pop(proc.pid, None)
    if rc != 0:
        raise ServicesError(f"{name}: `{' '.join(cmd[:2])}` failed (exit {rc}); see {log}:\n{_tail(log)}")


def _members(rec: dict[str, Any]) -> list[Any]:
    """The live processes of a record's session (see the module docstring for why this is safe)."""
    import psutil

    sid = int(rec["sid"])
    try:
        leader = psutil.Process(sid)
        if abs(leader.create_time() - float(rec["leader_create_time"])) > 0.5:
            return []  # the session id now belongs to another process: none of ours can be left
    except psutil.NoSuchProcess:
        pass
    except psutil.Error:
        return []
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _stop(recs: list[dict[str, Any]], grace_s: float) -> None:
    """SIGTERM the records' processes, SIGKILL what is left after ``grace_s``. Raylets go first: a
    raylet takes its workers and agents with it, while a GCS or raylet terminated together hang."""
    import psutil

    def terminate(procs: list[Any]) -> None:
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5.0)

    terminate([p for r in recs for p in _members(r) if _name(p) in _STOP_FIRST])
    terminate([p for r in recs for p in _members(r)])
    for r in recs:  # reap what this process started itself
        proc = _CHILDREN.pop(int(r["sid"]), None)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1.0)


# -- files ---------------------------------------------------------------------------------------


_STOP_FIRST = frozenset({"raylet"})


def _name(p: Any) -> str:
    try:
        return str(p.name())
    except Exception:
        return ""


def _pid_file(root: Path, name: str) -> Path:
    return root / "pids" / f"{name}.json"


def _read_record(root: Path, name: str) -> dict[str, Any] | None:
    path = _pid_file(root, name)
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # a torn or foreign file: nothing we can safely act on
    if not isinstance(rec, dict) or not {"sid", "leader_create_time", "address", "log"} <= set(rec):
        return None
    return rec


def _write_record(root: Path, name: str, rec: dict[str, Any]) -> None:
    path = _pid_file(root, name)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    tmp.replace(path)


def _read_credentials(root: Path) -> dict[str, str] | None:
    try:
        data = json.loads((root / CREDENTIALS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("access_key") or not data.get("secret_key"):
        return None
    return {k: str(v) for k, v in data.items()}


def _ensure_credentials(root: Path, endpoint: str, bucket: str) -> dict[str, str]:
    """The local store's keys: generated on the first ``up``, kept afterwards (the data in ``s3/``
    belongs to them); the endpoint and bucket are updated to this ``up``'s."""
    creds = _read_credentials(root) or {
        "access_key": "RP" + secrets.token_hex(9).upper(),
        "secret_key": secrets.token_urlsafe(30),
    }
    creds = {**creds, "endpoint": endpoint, "bucket": bucket}
    _write_private(root / CREDENTIALS_FILE, json.dumps(creds, indent=1))
    return creds


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


@contextlib.contextmanager
def _lock(root: Path) -> Iterator[None]:
    with open(root / ".lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


# -- small helpers -------------------------------------------------------------------------------


def _s3_client(address: str, creds: dict[str, str], bucket: str, root: Path) -> S3Store:
    return S3Store(
        address,
        bucket,
        creds["access_key"],
        creds["secret_key"],
        credentials_source=str(root / CREDENTIALS_FILE),
    )


def _bin(name: str) -> str:
    """The executable beside this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise ServicesError(f"`{name}` not found beside {sys.executable} or on PATH; run `make setup`")
    return found


def _port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as r:
            return bool(r.status == 200)
    except (OSError, ValueError):
        return False


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
