"""Two Ray nodes on this machine, as a cluster has them: a head and a worker node on loopback
addresses of their own, each in a mount namespace of its own (``unshare --mount``) with a private
``/tmp`` and ``$HOME`` (bind mounts of directories of the test), so a path one node writes does
not exist on the other; node resources named like the manifests' worker groups
(``rollpacker_<group>``, manifests/base/ray/raycluster.yaml). The store and MLflow run on the
host (network services both nodes reach, as in a cluster); the KFP tasks reach Ray through the
Ray client, as the cluster's do (``ray://``).

Every node is started in a session of its own through ``devservices`` (its records, its stop by
session id): ``stop`` ends exactly what ``start`` started, never another Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker import devservices

HEAD_IP, WORKER_IP = "127.0.0.3", "127.0.0.4"
# what each node offers: the rollout group on the head only; one CPU each, so the megatron gang's
# two ranks (one CPU each) land one per node; rewards (the sandbox group) on either
HEAD_RESOURCES = {
    "rollpacker_rollout": 1000,
    "rollpacker_training": 1000,
    "rollpacker_sandbox": 1000,
    "rollpacker_judge": 1000,
}
WORKER_RESOURCES = {"rollpacker_training": 1000, "rollpacker_sandbox": 1000}
# a node's script: its private $HOME and /tmp bound over the host's ($HOME first: its source may
# lie under the host's /tmp), then the command. The Python installation under the host's $HOME
# (pyenv) is bound into the private one first, as an image has its interpreter outside $HOME.
_NODE_SH = (
    'set -e; mkdir -p "$1/.pyenv"; mount --bind "$HOME/.pyenv" "$1/.pyenv"; '
    'mount --rbind "$1" "$HOME"; mount --bind "$2" /tmp; shift 2; exec "$@"'
)


@dataclass
class Node:
    name: str  # its devservices record
    ip: str
    private: Path  # home/ and tmp/: what the node sees as $HOME and /tmp
    resources: dict[str, int]
    worker_ports: tuple[int, int]
    rec: dict[str, Any] = field(default_factory=dict)

    def raylet_pids(self) -> list[int]:
        return [p.pid for p in devservices._members(self.rec) if devservices._name(p) == "raylet"]


@dataclass
class TwoNodes:
    root: Path
    env: dict[str, str]  # the nodes' environment (the store's keys: a cluster pod's Secret)
    gcs_port: int = 0
    client_port: int = 0
    nodes: dict[str, Node] = field(default_factory=dict)

    @property
    def client_address(self) -> str:
        return f"ray://{HEAD_IP}:{self.client_port}"

    def start(self, timeout_s: float = 120.0) -> None:
        self.gcs_port, self.client_port, agent_h, agent_w = devservices.free_ports(4)
        self.nodes["head"] = Node("ray-head", HEAD_IP, self.root / "head", HEAD_RESOURCES, (14100, 14299))
        self.nodes["worker"] = Node(
            "ray-worker", WORKER_IP, self.root / "worker", WORKER_RESOURCES, (14300, 14499)
        )
        self._launch(self.nodes["head"], ["--head", f"--port={self.gcs_port}"], agent_h, timeout_s)
        self._launch(
            self.nodes["worker"], [f"--address={HEAD_IP}:{self.gcs_port}"], agent_w, timeout_s, wait=2
        )

    def restart_worker(self, timeout_s: float = 120.0) -> None:
        """The worker node back (a new raylet on the same address, resources and private dirs)."""
        node = self.nodes["worker"]
        devservices._stop([node.rec], grace_s=3.0)
        agent = devservices.free_ports(1)[0]
        self._launch(node, [f"--address={HEAD_IP}:{self.gcs_port}"], agent, timeout_s, wait=2)

    def kill_worker_raylet(self) -> list[int]:
        pids = self.nodes["worker"].raylet_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def stop(self) -> None:
        devservices._stop([n.rec for n in self.nodes.values() if n.rec], grace_s=3.0)

    def _launch(self, node: Node, role: list[str], agent_port: int, timeout_s: float, wait: int = 1) -> None:
        for d in ("home", "tmp"):
            (node.private / d).mkdir(parents=True, exist_ok=True)
        cmd = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            _NODE_SH,
            node.name,
            str(node.private / "home"),
            str(node.private / "tmp"),
            devservices._bin("ray"),
            "start",
            *role,
            f"--node-ip-address={node.ip}",
            "--num-cpus=1",
            f"--resources={json.dumps(node.resources)}",
            "--disable-usage-stats",
            "--temp-dir=/tmp/ray",
            f"--dashboard-agent-listen-port={agent_port}",
            f"--min-worker-port={node.worker_ports[0]}",  # below the ephemeral range free_ports picks from
            f"--max-worker-port={node.worker_ports[1]}",
        ]
        if role[0] == "--head":
            cmd += [f"--ray-client-server-port={self.client_port}", "--include-dashboard=false"]
        env = {
            **self.env,
            "TMPDIR": "/tmp",
            "RAY_AUTH_MODE": "disabled",
            "RAY_LOGGER_LEVEL": "warning",
            # a Ray client's server process (one per KFP task) took over Ray's 30 s to answer on
            # this loaded 2-core machine, failing the task's connect
            "RAY_CLIENT_SERVER_CHECK_CHANNEL_TIMEOUT_S": "120",
        }
        for d in ("logs", "pids"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        node.rec = devservices._launch_and_wait(
            node.name,
            self.root,
            cmd,
            env,
            f"{node.ip}:{self.gcs_port}",
            lambda _: self._alive_nodes() >= wait,
            timeout_s,
            daemonizes=True,
        )

    def _alive_nodes(self) -> int:
        """Alive nodes as the GCS counts them (asked through a ``ray`` CLI-free probe: the port)."""
        if not _port_open(HEAD_IP, self.gcs_port):
            return 0
        return len(alive_nodes(f"{HEAD_IP}:{self.gcs_port}"))


def alive_nodes(gcs: str) -> list[dict[str, Any]]:
    """The alive nodes the GCS at ``gcs`` knows (IP and resources), read in a subprocess that
    joins nothing (the GCS client only)."""
    import subprocess
    import sys

    code = (
        "import json,sys\n"
        "from ray._private.state import GlobalState\n"
        "from ray._raylet import GcsClientOptions\n"
        "s=GlobalState(); s._initialize_global_state(GcsClientOptions.create("
        f"{gcs!r}, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False))\n"
        "print(json.dumps([{'ip': n['NodeManagerAddress'], 'resources': n['Resources']} "
        "for n in s.node_table() if n['Alive']]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode:
        return []
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
