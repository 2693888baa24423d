"""The soak: N RL steps of a small config through the one step path, watching for slow leaks.

``rollpacker lab soak`` runs one arm of a config (``default`` made small: 4 prompts x 2 responses,
64 tokens, no validation) for ``--steps`` steps through the stages (``run_step``, as ``rollpacker
train`` does; services in this process, or Ray actors with ``--services ray``). After every step it
samples, with psutil, each service process's resident memory, threads and open file descriptors
(sockets and pipes included), and the object store's objects and bytes under the arm's prefix,
split by part (``state/`` documents, ``steps/`` blobs, ``ckpt/`` checkpoints, ``batches/``,
``buffers/``).

Which processes are the services: with ``inline`` services, this process (the stages and every
service object) and its long-lived children (the vLLM engine core, reward workers); with ``ray``,
also every ``ray::<Service>`` actor process under the raylet of the soak's Ray cluster on this
machine, and their children (another cluster's actors on the same machine are left out). A jailed
sandbox run (uid 65534, or ``nsjail`` itself) lives for one reward and is not a service: it is
left out.

Growth is measured after a warm-up (``--warmup``, default a quarter of the steps: allocators,
caches and the first compiled graphs settle first): ``per_100`` is the least-squares slope of a
series over the steps after the warm-up, times 100; ``change_pct`` is the change from the start of
the measured stretch to its end (e.g. step 50 to step 200), each end the median of a window
of ``window`` samples (up to 10: RSS moves by tens of MB from one step to the next as the allocator
returns and takes pages, a single sample would measure that noise). A series ``holds`` when
``change_pct`` is below ``--max-growth-pct`` (5 %).

The store's checkpoints, batches and buffers are garbage-collected by the commit stage
(``stages/commit.py``: only the two newest states' checkpoint and batch are kept), so they stay
bounded; state documents and per-step blobs (``groups.json``, what exactly-once checks read) are
kept by design and grow by a constant amount per step, which the report gives in bytes per step.

Invariants (tests/lab/bench/test_soak.py):
- one sample per step run, in step order, each with every process found and the store's usage;
- ``per_100`` of a constant series is 0, of a series growing by ``g`` per step is ``100 g``;
- ``change_pct`` of a series that grows by more than the limit between the warm-up and the end
  does not hold, whatever one noisy sample says;
- ``bounded`` parts of the store (ckpt, batches, buffers) are reported as bounded only when their
  bytes after the warm-up never exceed their maximum during it by more than ``max_growth_pct``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.lab.bench.tables import clip, legend, wrap

# `default` made small enough for hundreds of steps on two cores.
SOAK_OVERRIDES: dict[str, object] = {
    "task.num_examples": 4000,
    "task.val_size": 8,
    "rollout.prompts_per_step": 4,
    "rollout.responses_per_prompt": 2,
    "rollout.max_tokens": 64,
    "engine.max_num_seqs": 32,
    "engine.max_model_len": 200,
    "validation.every": 100000,
    "validation.max_tokens": 32,
}
STORE_PARTS = ("state", "steps", "ckpt", "batches", "buffers")
BOUNDED_PARTS = ("ckpt", "batches", "buffers")  # garbage-collected at every commit
SERVICE_NAMES = ("RolloutService", "RewardService", "TrainerService", "TrackingService")
PROC_KEYS = ("rss_mb", "threads", "fds", "py_objects")


@dataclass(frozen=True)
class ProcSample:
    name: str  # role: "driver", "ray::RolloutService", "<child name>", unique within a sample
    pid: int
    rss_mb: float
    threads: int
    fds: int
    py_objects: int = 0  # the driver only: objects the garbage collector tracks (0: not counted)
    # its threads by name (the kernel's, /proc/<pid>/task/*/comm: native threads too), so that a
    # change in the count can be traced to what started them
    thread_names: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepSample:
    step: int  # the committed step
    step_s: float  # wall seconds of the step
    procs: tuple[ProcSample, ...]
    store_objects: dict[str, int]  # by part (STORE_PARTS and "other")
    store_bytes: dict[str, int]
    state_doc_bytes: int = 0  # the size of this step's state document


@dataclass
class SoakReport:
    config: str
    services: str
    steps: int
    warmup: int
    max_growth_pct: float
    samples: list[StepSample] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "services": self.services,
            "steps": self.steps,
            "warmup": self.warmup,
            "max_growth_pct": self.max_growth_pct,
            "wall_s": self.wall_s,
            "growth": growth_table(self),
            "store": store_growth(self),
            "samples": [asdict(s) for s in self.samples],
        }


# -- sampling --------------------------------------------------------------------------------------


def service_processes(services: str, ray_address: str = "") -> list[Any]:
    """The processes that hold the services (see the module docstring), this process first. With
    ``ray_address``, only the service actors of that Ray cluster's raylet on this machine (the
    workers are the raylet's children): another cluster's actors here are not sampled."""
    import psutil

    me = psutil.Process()
    roots = [me]
    if services == "ray":
        candidates = _raylet_descendants(ray_address) if ray_address else None
        if candidates is None:
            candidates = list(psutil.process_iter(["cmdline", "uids"]))
        for p in candidates:
            try:
                cmd = " ".join(p.cmdline() or [])
            except psutil.Error:
                continue
            if cmd.startswith("ray::") and any(n in cmd for n in SERVICE_NAMES):
                roots.append(p)
    out: list[Any] = []
    seen: set[int] = set()
    for r in roots:
        try:
            tree = [r, *r.children(recursive=True)]
        except psutil.Error:
            continue
        for p in tree:
            if p.pid not in seen and _long_lived(p):
                seen.add(p.pid)
                out.append(p)
    return out


def _long_lived(p: Any) -> bool:
    """Not a sandbox run: jailed (uid 65534) or nsjail itself, which live for one reward."""
    import psutil

    from rollpacker.rewards.sandbox import JAIL_UID

    try:
        return JAIL_UID not in p.uids() and p.name() != "nsjail" and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def sample_processes(procs: Sequence[Any]) -> tuple[ProcSample, ...]:
    """RSS, threads and fds of each process, named by role (``driver`` for this process, which
    also counts its Python objects: a leak of objects and one of native memory look alike in RSS)."""
    import psutil

    out: list[ProcSample] = []
    counts: dict[str, int] = {}
    me = os.getpid()
    for p in procs:
        try:
            with p.oneshot():
                name = "driver" if p.pid == me else _role(p)
                rss, threads, fds = p.memory_info().rss, p.num_threads(), p.num_fds()
        except psutil.Error:
            continue  # gone between listing and sampling
        n = counts.get(name, 0)
        counts[name] = n + 1
        objs = len(gc.get_objects()) if p.pid == me else 0
        label = name if n == 0 else f"{name}#{n}"
        out.append(ProcSample(label, p.pid, rss / 2**20, threads, fds, objs, thread_names(p.pid)))
    return tuple(out)


def thread_names(pid: int) -> dict[str, int]:
    """The threads of process ``pid`` counted by name (empty when /proc cannot tell)."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # ended between listing and reading
        out[name] = out.get(name, 0) + 1
    return dict(sorted(out.items()))


def threads_changed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Threads by name whose count differs between two samples (positive: more after)."""
    return {
        k: after.get(k, 0) - before.get(k, 0)
        for k in sorted({*before, *after})
        if after.get(k, 0) != before.get(k, 0)
    }


def _role(p: Any) -> str:
    try:
        cmd = p.cmdline()
    except Exception:
        cmd = []
    head = cmd[0] if cmd else ""
    if head.startswith("ray::"):
        return head.split()[0]
    return str(p.name())


def store_usage(store: Any, prefix: str) -> tuple[dict[str, int], dict[str, int]]:
    """Objects and bytes under ``prefix`` by part (``STORE_PARTS``, else ``other``). A file store's
    sizes come from the file system; any other store's from reading the objects."""
    objects = dict.fromkeys((*STORE_PARTS, "other"), 0)
    size = dict.fromkeys((*STORE_PARTS, "other"), 0)
    for key in store.list(prefix):
        part = key[len(prefix) :].split("/", 1)[0]
        part = part if part in STORE_PARTS else "other"
        objects[part] += 1
        size[part] += object_bytes(store, key)
    return objects, size


def object_bytes(store: Any, key: str) -> int:
    """The size of one object (a file store's from the file system, any other's by reading it)."""
    from rollpacker.store.local import FileStore

    if isinstance(store, FileStore):
        return store.root.joinpath(*key.split("/")).stat().st_size
    return len(store.get_bytes(key))


# -- the run ---------------------------------------------------------------------------------------


def soak_config(
    config_path: Path, overrides: dict[str, object], steps: int, out_dir: Path, make_store: bool = True
) -> str:
    """The single-arm config text of a soak: the small overrides, then the caller's, ``steps``,
    and, unless the overrides name them, the state and MLflow under ``out_dir`` (its store's
    directory made unless ``make_store`` is False). The config is checked as ``train`` checks it."""
    from rollpacker.experiment import train_config

    merged: dict[str, object] = {
        **SOAK_OVERRIDES,
        "out_dir": str(out_dir),
        "tracking_uri": f"sqlite:///{out_dir.resolve() / 'mlflow.db'}",
        "experiment": "rollpacker-soak",
        **overrides,
        "steps": steps,
    }
    text, _ = train_config(config_path, merged, run_name="soak", make_store=make_store)
    return text


def check_soak(
    config_path: Path,
    steps: int,
    out_dir: Path,
    overrides: dict[str, object] | None = None,
    services: str = "inline",
    warmup: int | None = None,
) -> tuple[str, int]:
    """``ConfigError`` for a soak that could not run as asked, before any service, warm-up or
    output (its settings, and its config as ``train`` checks it); else its config text and the
    steps before growth is measured."""
    from rollpacker.core.errors import ConfigError

    if services not in ("inline", "ray"):
        raise ConfigError(f"--services {services!r}: use 'inline' (this process) or 'ray' (actors)")
    if steps < 2:
        raise ConfigError(f"--steps {steps}: a soak needs at least 2 steps")
    warm = warmup if warmup is not None else steps // 4
    if not 0 <= warm < steps - 1:
        raise ConfigError(f"--warmup {warm}: must leave at least 2 steps after it (of {steps})")
    return soak_config(config_path, overrides or {}, steps, out_dir, make_store=False), warm


def _raylet_descendants(address: str) -> list[Any] | None:
    """The processes under the raylet of the Ray cluster whose GCS is at ``address`` (None when no
    such raylet runs on this machine)."""
    import psutil

    flag = f"--gcs-address={address.removeprefix('ray://')}"
    out: list[Any] = []
    found = False
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if cmd and cmd[0].endswith("raylet") and flag in cmd:
            found = True
            with contextlib.suppress(psutil.Error):
                out.extend(p.children(recursive=True))
    return out if found else None


def run_soak(
    config_path: Path,
    steps: int,
    out_dir: Path,
    overrides: dict[str, object] | None = None,
    services: str = "inline",
    warmup: int | None = None,
    max_growth_pct: float = 5.0,
    say: Callable[[str], None] = lambda s: None,
) -> SoakReport:
    """Run ``steps`` fresh steps and sample after each (see the module docstring)."""
    from rollpacker.core.config import config_from_text
    from rollpacker.core.types import ServicesMode
    from rollpacker.experiment import reset_arms
    from rollpacker.services.registry import ServiceRegistry
    from rollpacker.stages.context import StageContext
    from rollpacker.stages.run import run_step
    from rollpacker.tasks.prepare import prepare_arm
    from rollpacker.tracking import ExperimentTracker

    _, warm = check_soak(config_path, steps, out_dir, overrides, services, warmup)
    text = soak_config(config_path, overrides or {}, steps, out_dir)
    cfg = config_from_text(text)
    (arm,) = cfg.arm_names
    report = SoakReport(str(config_path), services, steps, warm, max_growth_pct)
    t0 = time.perf_counter()
    ray_address = ""
    if services == "ray":
        from rollpacker.devservices import local_ray_address

        ray_address = cfg.services.ray_address or os.environ.get("RAY_ADDRESS", "") or local_ray_address()
    # the registry gets the address
    ctx = StageContext.create(text, arm, ServicesMode(services), ray_address=ray_address)
    ctx.store.check()
    ExperimentTracker(cfg.tracking_uri, cfg.experiment).check()
    reset_arms(cfg, [arm], say)  # a soak always starts from step 0
    prepare_arm(cfg, ctx.store, arm, quiet=True)  # the plan takes the start model from the store
    try:
        for i in range(steps):
            s0 = time.perf_counter()
            out = run_step(ctx)
            step_s = time.perf_counter() - s0
            gc.collect()  # what is sampled is what is still referenced, not garbage not yet freed
            procs = sample_processes(service_processes(services, ray_address))
            objects, size = store_usage(ctx.store, ctx.states.prefix)
            doc = object_bytes(ctx.store, ctx.states.state_key(out.step))
            report.samples.append(StepSample(out.step, step_s, procs, objects, size, doc))
            driver = next((p for p in procs if p.name == "driver"), None)
            rss = f"{driver.rss_mb:.0f} MB" if driver else "-"
            say(f"[soak] step {i + 1}/{steps} in {step_s:.1f} s: driver {rss}, store {sum(size.values())} B")
    finally:
        if services == "inline":
            ServiceRegistry.close_inline()
        else:
            ctx.services.kill_all()
    report.wall_s = time.perf_counter() - t0
    return report


# -- growth ----------------------------------------------------------------------------------------


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0 with fewer than two distinct xs)."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _series(report: SoakReport, name: str, key: str) -> list[tuple[int, float]]:
    out = []
    for i, s in enumerate(report.samples):
        for p in s.procs:
            if p.name == name:
                out.append((i, float(getattr(p, key))))
    return out


def window(n: int) -> int:
    """Samples at each end of a measured stretch of ``n`` whose median is compared."""
    return max(1, min(10, n // 4))


def growth_table(report: SoakReport) -> list[dict[str, Any]]:
    """Per process and measure: first, at warm-up, last (window medians), growth per 100 steps,
    change since the warm-up (%), and whether it holds (below ``max_growth_pct``)."""
    import statistics

    names: list[str] = []
    for s in report.samples:
        names += [p.name for p in s.procs if p.name not in names]
    rows = []
    for name in names:
        for key in PROC_KEYS:
            pts = _series(report, name, key)
            after = [(i, v) for i, v in pts if i >= report.warmup]
            if len(after) < 2 or not any(v for _, v in pts):
                continue  # did not live through the soak (noted by its absence), or not measured
            k = window(len(after))
            base = statistics.median(v for _, v in after[:k])
            last = statistics.median(v for _, v in after[-k:])
            change = 100.0 * (last - base) / base if base else 0.0
            rows.append(
                {
                    "process": name,
                    "measure": key,
                    "first": pts[0][1],
                    "at_warmup": base,
                    "last": last,
                    "per_100": 100.0 * slope([i for i, _ in after], [v for _, v in after]),
                    "change_pct": change,
                    "holds": change < report.max_growth_pct,
                    "samples": len(pts),
                    "window": k,
                }
            )
            if key == "threads":  # which threads came or went between the warm-up and the end
                first, end = _proc(report, name, after[0][0]), _proc(report, name, after[-1][0])
                if first is not None and end is not None:
                    rows[-1]["names_changed"] = threads_changed(first.thread_names, end.thread_names)
    return rows


def _proc(report: SoakReport, name: str, i: int) -> ProcSample | None:
    return next((p for p in report.samples[i].procs if p.name == name), None)


def store_growth(report: SoakReport) -> dict[str, Any]:
    """The store per part: bytes at the warm-up and at the end, bytes per step after it, and for
    the garbage-collected parts whether they stayed bounded."""
    out: dict[str, Any] = {}
    w = report.warmup
    for part in (*STORE_PARTS, "other"):
        ys = [float(s.store_bytes.get(part, 0)) for s in report.samples]
        objs = [s.store_objects.get(part, 0) for s in report.samples]
        if not any(ys):
            continue
        xs = list(range(len(ys)))
        entry: dict[str, Any] = {
            "objects_last": objs[-1],
            "bytes_at_warmup": ys[w],
            "bytes_last": ys[-1],
            "bytes_max": max(ys),
            "bytes_per_step": slope(xs[w:], ys[w:]),
        }
        if part in BOUNDED_PARTS:
            cap = max(ys[: w + 1]) * (1 + report.max_growth_pct / 100.0)
            entry["bounded"] = max(ys[w:]) <= cap
        out[part] = entry
    docs = [float(s.state_doc_bytes) for s in report.samples]
    out["state_doc"] = {
        "bytes_at_warmup": docs[w],
        "bytes_last": docs[-1],
        "bytes_per_step": slope(list(range(len(docs)))[w:], docs[w:]),
    }
    total = [float(sum(s.store_bytes.values())) for s in report.samples]
    out["total"] = {
        "bytes_at_warmup": total[w],
        "bytes_last": total[-1],
        "bytes_per_step": slope(list(range(len(total)))[w:], total[w:]),
    }
    return out


# -- the table -------------------------------------------------------------------------------------


_LEGEND = (
    ("process", "driver: this process (stages and inline services); others by name, #n for repeats"),
    (
        "measure",
        "rss_mb: resident memory (MiB); threads; fds: open file descriptors (files, sockets, pipes); "
        "py_objects: objects Python's garbage collector tracks (driver only)",
    ),
    ("first", "after the first step"),
    ("warm", "median of the first samples after the warm-up (the window): the baseline of the change"),
    ("last", "median of the last samples (the window)"),
    ("per 100", "least-squares growth per 100 steps after the warm-up"),
    ("change %", "last over warm, in percent; ok: below the limit"),
    ("B/step", "store bytes added per step after the warm-up (least squares)"),
)


def render(d: dict[str, Any]) -> str:
    """The growth table (one row per process and measure), the store, a legend."""
    lines = wrap(
        f"soak: {len(d['samples'])} of {d['steps']} steps ({d['services']} services, {d['config']}) in "
        f"{d['wall_s']:.0f} s; growth measured after a warm-up of {d['warmup']} steps; limit "
        f"{d['max_growth_pct']:g} %"
    )
    hdr = (
        f"{'process':<28}  {'measure':<10}  {'first':>9}  {'warm':>9}  {'last':>9}  {'per 100':>9}  change %"
    )
    lines += [hdr, "-" * len(hdr)]
    for r in d["growth"]:
        ok = "ok" if r["holds"] else "GROWS"
        lines.append(
            f"{clip(r['process'], 28):<28}  {r['measure']:<10}  {r['first']:>9.1f}  {r['at_warmup']:>9.1f}  "
            f"{r['last']:>9.1f}  {r['per_100']:>+9.2f}  {r['change_pct']:>+7.2f} {ok}"
        )
        if r.get("names_changed"):
            named = ", ".join(f"{k} {v:+d}" for k, v in r["names_changed"].items())
            lines.append(f"{'':<30}threads by name, warm-up to end: {named}")
    shdr = (
        f"{'store part':<12}  {'objects':>8}  {'bytes warm':>12}  {'bytes last':>12}  {'B/step':>10}  bounded"
    )
    lines += ["", shdr, "-" * len(shdr)]
    for part, e in d["store"].items():
        if part == "state_doc":
            continue
        bounded = {True: "yes", False: "NO"}.get(e.get("bounded"), "-") if part != "total" else ""
        objs = e.get("objects_last", "")
        lines.append(
            f"{part:<12}  {objs:>8}  {e['bytes_at_warmup']:>12.0f}  {e['bytes_last']:>12.0f}  "
            f"{e['bytes_per_step']:>10.0f}  {bounded}"
        )
    doc = d["store"]["state_doc"]
    lines += wrap(
        f"one state document per step, kept: the newest is {doc['bytes_last']:.0f} B, "
        f"{doc['bytes_at_warmup']:.0f} B after the warm-up ({doc['bytes_per_step']:+.0f} B per step: the "
        "history it carries grows with the steps)"
    )
    return "\n".join(lines + legend(_LEGEND))
