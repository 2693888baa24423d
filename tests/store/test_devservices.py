"""The local services launcher: starts what is missing, reuses what runs, stops only what it started."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from rollpacker import devservices
from rollpacker.devservices import RayPorts, SeaweedPorts, ServicesError
from rollpacker.experiment import check_ray_head
from rollpacker.services.base import ServiceError
from rollpacker.store.s3 import S3Store


@pytest.fixture
def foreign() -> Iterator[subprocess.Popen[bytes]]:
    """A process nobody asked `down` to stop (started in its own session, like the services)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def _alive(pids: tuple[int, ...] | list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def test_seaweed_up_reuse_down(tmp_path: Path, foreign: subprocess.Popen[bytes]) -> None:
    root = tmp_path / "svc"
    ports = SeaweedPorts.free()
    svc = devservices.up(root, bucket="bkt-one", mlflow=False, ray=False, seaweed_ports=ports, timeout_s=30)
    assert svc.started == ("seaweedfs",) and svc.reused == ()
    assert svc.s3_endpoint == f"127.0.0.1:{ports.s3}" and svc.ray_address == "" and svc.tracking_uri == ""
    assert svc.startup_s["seaweedfs"] < 30
    creds = json.loads(svc.credentials_file.read_text())
    assert creds["endpoint"] == svc.s3_endpoint and creds["access_key"] == svc.access_key
    for f in (svc.credentials_file, root / "s3.json"):
        assert f.stat().st_mode & 0o777 == 0o600
    store = S3Store(svc.s3_endpoint, "bkt-one", svc.access_key, svc.secret_key)
    store.check()  # the bucket was created
    store.put_bytes("k", b"v")

    (st,) = [s for s in devservices.status(root) if s.name == "seaweedfs"]
    assert st.running and st.healthy and st.pids and st.address == svc.s3_endpoint
    pids = st.pids
    tmp = root / "tmp" / "seaweedfs"  # the server's temporary files: its own, removed by `down`
    assert f"TMPDIR={tmp.resolve()}".encode() in Path(f"/proc/{pids[0]}/environ").read_bytes()
    (tmp / "left-by-a-killed-process").write_text("x")
    assert not list(root.glob("weed.*")) and list((root / "logs").glob("weed*"))  # its glog files too

    again = devservices.up(root, bucket="bkt-two", mlflow=False, ray=False, seaweed_ports=ports)
    assert again.started == () and again.reused == ("seaweedfs",)
    assert (again.access_key, again.secret_key) == (svc.access_key, svc.secret_key)
    S3Store(svc.s3_endpoint, "bkt-two", svc.access_key, svc.secret_key).check()  # new bucket, same server

    assert devservices.down(root, names=["ray", "mlflow"]) == {}
    assert _alive(pids) == list(pids)
    with pytest.raises(ServicesError, match="unknown service"):
        devservices.down(root, names=["minio"])
    assert devservices.down(root, grace_s=5) == {"seaweedfs": len(pids)}
    assert _alive(pids) == []
    assert _alive([foreign.pid]) == [foreign.pid]  # not ours: untouched
    assert not (root / "pids" / "seaweedfs.json").exists()
    assert not tmp.exists()
    assert not any(s.running for s in devservices.status(root))
    assert devservices.down(root) == {}

    # the data and the keys survive a restart
    svc3 = devservices.up(root, bucket="bkt-one", mlflow=False, ray=False, seaweed_ports=ports, timeout_s=30)
    assert svc3.started == ("seaweedfs",) and svc3.access_key == svc.access_key
    assert S3Store(svc3.s3_endpoint, "bkt-one", svc3.access_key, svc3.secret_key).get_bytes("k") == b"v"
    devservices.down(root, grace_s=5)


def test_without_a_root_up_and_down_use_the_directory_the_clients_read_the_keys_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$ROLLPACKER_SERVICES_DIR names where the store's clients look for the local keys; `up`, `down`
    and the run's own start of the services use it too (they used build/services, so a run with the
    variable set started the store there and then found no keys: seen on a fresh clone)."""
    from rollpacker.store.s3 import SERVICES_DIR_ENV, local_credentials_path

    root = tmp_path / "elsewhere"
    monkeypatch.setenv(SERVICES_DIR_ENV, str(root))
    monkeypatch.chdir(tmp_path)  # build/services would be made here
    svc = devservices.up(mlflow=False, ray=False, seaweed_ports=SeaweedPorts.free(), timeout_s=30)
    try:
        assert svc.root == root and svc.credentials_file == local_credentials_path()
        assert [s.name for s in devservices.status() if s.running] == ["seaweedfs"]
    finally:
        counts = devservices.down(grace_s=1.0)
    assert set(counts) == {"seaweedfs"} and counts["seaweedfs"] >= 1
    assert not (tmp_path / "build").exists()
    assert not [s for s in devservices.status() if s.running]


def test_port_taken_by_a_stranger_is_refused(tmp_path: Path) -> None:
    ports = SeaweedPorts.free()
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.filer))
        s.listen()
        with pytest.raises(ServicesError, match=rf"seaweedfs: 127\.0\.0\.1:{ports.filer} in use"):
            devservices.up(tmp_path, mlflow=False, ray=False, seaweed_ports=ports)
    assert not (tmp_path / "pids" / "seaweedfs.json").exists()


def test_unhealthy_start_is_stopped_and_names_the_log(tmp_path: Path) -> None:
    with pytest.raises(ServicesError, match=r"seaweedfs did not answer .* see .*logs/seaweedfs\.log"):
        devservices.up(tmp_path, mlflow=False, ray=False, seaweed_ports=SeaweedPorts.free(), timeout_s=0.01)
    assert not (tmp_path / "pids" / "seaweedfs.json").exists()
    assert (tmp_path / "logs" / "seaweedfs.log").exists()
    leftovers = [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert _alive(leftovers) == []


def test_stale_record_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    dead.wait()
    stale = {"sid": dead.pid, "leader_create_time": 0.0, "address": "127.0.0.1:1", "log": "x"}
    (tmp_path / "pids" / "seaweedfs.json").write_text(json.dumps(stale))
    svc = devservices.up(tmp_path, mlflow=False, ray=False, seaweed_ports=SeaweedPorts.free(), timeout_s=30)
    try:
        assert svc.started == ("seaweedfs",)
    finally:
        devservices.down(tmp_path, grace_s=5)


@pytest.mark.slow
def test_mlflow_and_ray_up_down(
    tmp_path: Path, foreign: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "svc"
    mlflow_port = devservices.free_ports(1)[0]
    kw = {"seaweed_ports": SeaweedPorts.free(), "mlflow_port": mlflow_port, "ray_ports": RayPorts.free()}
    svc = devservices.up(root, timeout_s=120, **kw)  # type: ignore[arg-type]
    try:
        assert svc.started == ("seaweedfs", "mlflow", "ray")
        assert svc.tracking_uri == f"http://127.0.0.1:{mlflow_port}"
        assert svc.ray_address.startswith("127.0.0.2:")
        with urllib.request.urlopen(svc.tracking_uri + "/health", timeout=5) as r:
            assert r.status == 200
        env = svc.env()
        assert env["RAY_ADDRESS"] == svc.ray_address and env["MLFLOW_TRACKING_URI"] == svc.tracking_uri
        assert devservices.local_ray_address(root) == svc.ray_address
        assert devservices.local_tracking_uri(root) == svc.tracking_uri
        statuses = {s.name: s for s in devservices.status(root)}
        assert all(s.running and s.healthy for s in statuses.values())
        ray_pids = statuses["ray"].pids
        names = {psutil.Process(p).name() for p in ray_pids}
        assert {"gcs_server", "raylet"} <= names  # the daemons `ray start` left behind are recorded
        again = devservices.up(root, **kw)  # type: ignore[arg-type]
        assert again.started == () and again.reused == ("seaweedfs", "mlflow", "ray")

        # a head half killed (GCS alive, raylet dead: a client's ray.init hangs) is not reused
        (raylet,) = [p for p in ray_pids if psutil.Process(p).name() == "raylet"]
        psutil.Process(raylet).kill()
        psutil.Process(raylet).wait(10)
        (ray_status,) = [s for s in devservices.status(root) if s.name == "ray"]
        assert ray_status.running and not ray_status.healthy
        # the runner refuses it at once, naming the command that fixes it (a client's ray.init would
        # hang): the address it hands to the registry and its tasks goes through this check
        monkeypatch.setenv("ROLLPACKER_SERVICES_DIR", str(root))
        with pytest.raises(ServiceError, match=r"lost its raylet.*`make up`"):
            check_ray_head(svc.ray_address)
        check_ray_head("127.0.0.9:1")  # an address `up` did not record is not its to judge
        third = devservices.up(root, **kw)  # type: ignore[arg-type]
        assert third.started == ("ray",) and third.reused == ("seaweedfs", "mlflow")
        assert _alive(ray_pids) == []  # the half-dead head was stopped whole
        statuses = {s.name: s for s in devservices.status(root)}
        assert all(s.running and s.healthy for s in statuses.values())  # a client connects again
    finally:
        counts = devservices.down(root, grace_s=5)
    assert set(counts) == {"seaweedfs", "mlflow", "ray"}
    assert _alive([p for s in statuses.values() for p in s.pids]) == []
    assert _alive([foreign.pid]) == [foreign.pid]
    assert devservices.local_ray_address(root) == ""


def test_unrecorded_leftovers_of_up_are_restarted(tmp_path: Path, foreign: subprocess.Popen[bytes]) -> None:
    """A service `up` started here whose pid file is gone (an interrupted `up`, a deleted
    ``pids/``) is stopped and started again, not refused as a stranger on its ports."""
    ports = SeaweedPorts.free()
    first = devservices.up(tmp_path, mlflow=False, ray=False, seaweed_ports=ports, timeout_s=30)
    (st,) = [s for s in devservices.status(tmp_path) if s.name == "seaweedfs"]
    (tmp_path / "pids" / "seaweedfs.json").unlink()
    try:
        again = devservices.up(tmp_path, mlflow=False, ray=False, seaweed_ports=ports, timeout_s=30)
        assert again.started == ("seaweedfs",) and again.access_key == first.access_key
        assert _alive(st.pids) == []
        assert _alive([foreign.pid]) == [foreign.pid]
    finally:
        devservices.down(tmp_path, grace_s=5)
        for pid in _alive(st.pids):  # on a failure: what this test started
            psutil.Process(pid).kill()


_HEALTH_ONLY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 500)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_mlflow_that_answers_health_but_not_its_api_is_not_healthy(tmp_path: Path) -> None:
    """``/health`` answers while the tracking API fails (a broken backend store): not healthy."""
    (port,) = devservices.free_ports(1)
    proc = subprocess.Popen([sys.executable, "-c", _HEALTH_ONLY, str(port)], start_new_session=True)
    try:
        address = f"http://127.0.0.1:{port}"
        for _ in range(100):
            if devservices._http_ok(address + "/health"):
                break
            time.sleep(0.05)
        (tmp_path / "pids").mkdir()
        rec = {
            "sid": proc.pid,
            "leader_create_time": psutil.Process(proc.pid).create_time(),
            "address": address,
            "log": str(tmp_path / "mlflow.log"),
        }
        (tmp_path / "pids" / "mlflow.json").write_text(json.dumps(rec))
        (st,) = [s for s in devservices.status(tmp_path) if s.name == "mlflow"]
        assert st.running and not st.healthy
    finally:
        proc.kill()
        proc.wait()


def _free_offset() -> int:
    """A ``--port-offset`` whose SeaweedFS and Ray ports are all free now."""
    import random

    for _ in range(200):
        off = random.randrange(100, 9000, 7)
        sw, ray = SeaweedPorts().shifted(off), RayPorts().shifted(off)
        fixed = [*dataclasses.astuple(sw), ray.gcs, ray.client_server, ray.dashboard_agent]
        if max(fixed) < 65536 and not any(
            devservices._port_open(h, p) for h in ("127.0.0.1", "127.0.0.2") for p in fixed
        ):
            return off
    raise AssertionError("no free port offset")


def _ours(root: Path) -> list[int]:
    """Live processes an `up` under ``root`` started (their TMPDIR is under ``root/tmp``)."""
    marker = str((root / "tmp").resolve())
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TMPDIR", "").startswith(marker) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["sigint", "sigkill"])
def test_an_up_interrupted_while_the_ray_head_starts_is_healed_by_the_next_up(
    tmp_path: Path, sig: int
) -> None:
    """Ctrl-C (SIGINT) or SIGKILL of `rollpacker up` while `ray start` runs (what a new user does to
    a silent start): the next `up` ends with every service working, and `down` leaves nothing."""
    root = tmp_path / "svc"
    off = _free_offset()
    cmd = [
        sys.executable,
        "-m",
        "rollpacker.cli",
        "up",
        "--root",
        str(root),
        "--no-mlflow",
        "--port-offset",
        str(off),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (root / "logs" / "ray.log").exists():  # `ray start` is running
            assert proc.poll() is None and time.monotonic() < deadline, "up ended before the Ray head started"
            time.sleep(0.05)
        time.sleep(2.0)  # its GCS server and raylet are starting
        proc.send_signal(sig)
        proc.wait(60)
        kw = {"seaweed_ports": SeaweedPorts().shifted(off), "ray_ports": RayPorts().shifted(off)}
        svc = devservices.up(root, mlflow=False, timeout_s=120, **kw)  # type: ignore[arg-type]
        assert set(svc.started) | set(svc.reused) == {"seaweedfs", "ray"}
        statuses = {s.name: s for s in devservices.status(root)}
        assert statuses["seaweedfs"].healthy and statuses["ray"].healthy  # a client connects
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        devservices.down(root, grace_s=5)
        left = _ours(root)
        for pid in left:  # on a failure too: only what this test's `up`s started
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    assert left == []  # nothing of either `up` is left running
