#!/usr/bin/env python3
"""Container health check: every URL in $ROLLPACKER_HEALTH_URLS (comma-separated) answers 2xx, and on
a GPU image the node can run the image's CUDA wheels.

Installed as /usr/local/bin/rollpacker-healthcheck in every image and used by its HEALTHCHECK and by
the manifests' exec probes. Each image sets the default for the process it serves (the MLflow
server's /health, a Ray node's raylet health endpoint); a pod overrides it through the environment.
Standard library only, so it works before and without the image's virtual environment.

GPU preflight: where the image's torch is a CUDA build (``$VIRTUAL_ENV/lib/python3*/site-packages/
torch/version.py`` names a CUDA version) and an NVIDIA driver is visible (/proc/driver/nvidia/version,
else ``nvidia-smi``), the driver must be at least the minimum of that CUDA major release (NVIDIA's
minor version compatibility: CUDA 13.x needs >= 580, 12.x >= 525), and a C compiler must be on PATH
(Triton builds its launcher with one at the first kernel launch). The message names both versions.
No CUDA torch (controller, sandbox, the cpu flavor) or no visible driver: nothing to compare.

Exit status 0: healthy; 1: a URL or the GPU preflight failed (the reason is printed); 2: nothing to check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ENV = "ROLLPACKER_HEALTH_URLS"
NVIDIA_VERSION_FILE = "/proc/driver/nvidia/version"
# the oldest driver branch each CUDA major release runs on (NVIDIA, "CUDA minor version compatibility")
MIN_DRIVER_FOR_CUDA = {13: 580, 12: 525, 11: 450}
C_COMPILERS = ("cc", "gcc", "clang")


def check(url: str, timeout_s: float) -> str | None:
    """None if ``url`` answers 2xx within ``timeout_s``, else why not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if 200 <= resp.status < 300:
                return None
            return f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"


def driver_version(version_file: str = NVIDIA_VERSION_FILE, nvidia_smi: str | None = None) -> str | None:
    """The NVIDIA kernel driver's version ("580.65.06"), or None where no driver is visible."""
    try:
        m = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", Path(version_file).read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        res = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=3,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"\s*(\d+\.\d+(?:\.\d+)?)", res.stdout) if res.returncode == 0 else None
    return m.group(1) if m else None


def wheel_cuda_version(venv: str) -> str | None:
    """The CUDA version the venv's torch wheel was built for ("13.0"); None: no torch or a CPU build."""
    for version_py in sorted(Path(venv).glob("lib/python3*/site-packages/torch/version.py")):
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"](\d+\.\d+)", version_py.read_text(), re.M)
        return m.group(1) if m else None
    return None


def gpu_preflight(driver: str | None, cuda: str | None, compiler: str | None) -> list[str]:
    """Why a node cannot run the image's CUDA wheels (empty: it can, or there is nothing to compare)."""
    if cuda is None or driver is None:
        return []
    problems = []
    cuda_major, driver_major = int(cuda.split(".")[0]), int(driver.split(".")[0])
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    if need is None:
        problems.append(
            f"the image's wheels are built for CUDA {cuda}, whose minimum driver is not known here"
        )
    elif driver_major < need:
        problems.append(
            f"NVIDIA driver {driver} is too old for the image's CUDA {cuda} wheels (CUDA {cuda_major}.x "
            f"needs driver >= {need}): upgrade the node's driver or use images built for an older CUDA"
        )
    if compiler is None:
        problems.append(
            f"no C compiler ({', '.join(C_COMPILERS)}) on PATH: Triton builds its launcher with one at the "
            "first kernel launch; build the image from images/<name>/Dockerfile (it installs gcc)"
        )
    return problems


def _gpu_problems() -> list[str]:
    cuda = wheel_cuda_version(os.environ.get("VIRTUAL_ENV", "/opt/venv"))
    if cuda is None:
        return []
    driver = driver_version(os.environ.get("ROLLPACKER_NVIDIA_VERSION_FILE", NVIDIA_VERSION_FILE))
    compiler = next((c for c in C_COMPILERS if shutil.which(c)), None)
    return gpu_preflight(driver, cuda, compiler)


def main(argv: list[str]) -> int:
    urls = [u.strip() for u in (argv or os.environ.get(ENV, "").split(",")) if u.strip()]
    if not urls:
        print(f"unhealthy: no URL to check (set ${ENV} or pass URLs)", file=sys.stderr)
        return 2
    timeout_s = float(os.environ.get("ROLLPACKER_HEALTH_TIMEOUT_S", "3"))
    failures = [*_gpu_problems(), *(f for f in (check(u, timeout_s) for u in urls) if f)]
    for f in failures:
        print(f"unhealthy: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
