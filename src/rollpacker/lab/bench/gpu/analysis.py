"""The policies and predictor phases: what the measured profile says, priced by rollpacker's own code.

``policies``: the what-if simulator (``bench.whatif.run.simulate``: the real policies and round
driver on a virtual clock) on a paper-like trace, once priced by the measured profile (the
``ProfileCost`` of ``whatif --hardware cpu-profile:profile.json``) and once by the roofline of the
same model on the same GPU's shipped spec (``h100``/``h200``; on the CPU a spec built from the
probe's ceilings with the shipped GPUs' assumed efficiencies). Per policy: seconds per step and the
speedup over sync under each, and their ratio. The replay on the measurement engine itself is not
run (that engine is not behind the engine port).

``predictor``: the latency predictor (``core.latency.Predictor``) fitted on part of the measured
points predicts the others: interior contexts of each batch (interpolation in context tokens) and
interior batch sizes (interpolation across batches). PAT reports 3-4 % mean error.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rollpacker.core.costmodel import HardwareSpec, RooflineCost
from rollpacker.core.latency import LayoutProfile, Predictor, ProfilePoint, ProfileTable
from rollpacker.lab.bench.gpu.context import Context

ASSUMED_FROM = "h100"  # efficiencies and overheads a CPU-built spec borrows (labelled as such)


def measured_hardware(probe: dict[str, Any], name: str) -> HardwareSpec:
    """A spec whose peaks are the probe's measured ceilings (no datasheet for this device), with the
    shipped GPU spec's assumed efficiencies: what the roofline would say without calibration."""
    from rollpacker.lab.bench.whatif.specfiles import load_hardware

    base = load_hardware(ASSUMED_FROM)
    c = probe["ceilings"]
    mem = probe.get("gpu_memory_bytes") or 8 << 30
    return dataclasses.replace(
        base,
        name=name,
        memory_gib=mem / 2**30,
        memory_bandwidth_gb_s=c["copy_gb_s"],
        peak_bf16_tflops=c["gemm_tflops"],
        devices_per_node=1,
        sources={
            **base.sources,
            "memory_gib": "measured: the probe's device memory",
            "memory_bandwidth_gb_s": "measured: the probe's copy traffic (rollpacker lab bench gpu)",
            "peak_bf16_tflops": "measured: the probe's GEMM (rollpacker lab bench gpu)",
            "devices_per_node": "one device measured",
        },
    )


def roofline_hardware(ctx: Context) -> tuple[HardwareSpec, str]:
    """The shipped spec of the probed GPU (datasheet + assumed efficiencies), or a measured one."""
    from rollpacker.lab.bench.whatif.specfiles import load_hardware

    probe = ctx.needs("probe", "ceilings") and ctx.results["probe"]
    if probe.get("spec"):
        return load_hardware(probe["spec"]), f"shipped spec {probe['spec']} (datasheet, assumed efficiencies)"
    return measured_hardware(probe, "cpu-measured"), (
        f"probe's measured ceilings with {ASSUMED_FROM}'s assumed efficiencies (no datasheet spec)"
    )


def policies(ctx: Context) -> dict[str, Any]:
    from rollpacker.lab.bench.gpu.decode import model_spec
    from rollpacker.lab.bench.whatif.run import WhatIfConfig, simulate
    from rollpacker.lab.bench.whatif.specfiles import Deployment, deployments
    from rollpacker.lab.bench.whatif.traces import load

    path = ctx.needs("profile", "profile_path")
    if ctx.tiny:
        cfg = WhatIfConfig(p0=8, r0=4, max_tokens=512, concurrency=64, periods=1)
    else:
        cfg = WhatIfConfig(p0=32, r0=8, max_tokens=8192, concurrency=256, periods=1)
    preset = "paper-8k"
    records, source = load(None, preset, cfg.seed, r0=cfg.r0, responses=cfg.responses_needed)
    measured = deployments(f"cpu-profile:{path}", None, (1,), None)[0]
    hw, hw_label = roofline_hardware(ctx)
    roof = Deployment(RooflineCost(hw, model_spec(ctx.tiny), 1), 1)
    by: dict[str, dict[str, Any]] = {}
    for name, dep in (("measured", measured), ("roofline", roof)):
        by[name] = simulate(records, dep, cfg.rollout(), cfg, cfg.policies, cfg.periods, source)
    rows = {
        pol: {
            "measured_s_per_step": by["measured"][pol]["rollout_s_per_step"],
            "roofline_s_per_step": by["roofline"][pol]["rollout_s_per_step"],
            "measured_speedup": by["measured"][pol]["speedup"],
            "roofline_speedup": by["roofline"][pol]["speedup"],
            "roofline_over_measured": by["roofline"][pol]["rollout_s_per_step"]
            / by["measured"][pol]["rollout_s_per_step"],
        }
        for pol in cfg.policies
    }
    tb = rows["tail_batching"]
    return {
        "trace": source,
        "config": {k: getattr(cfg, k) for k in ("p0", "r0", "eta_p", "eta_r", "max_tokens", "concurrency")},
        "roofline": hw_label,
        "policies": rows,
        "real_replay": "not run: the measurement engine is not behind the engine port",
        "headline": f"tail batching {tb['measured_speedup']:.2f}x over sync on the measured profile "
        f"(roofline: {tb['roofline_speedup']:.2f}x)",
    }


def split_points(points: tuple[ProfilePoint, ...]) -> tuple[list[ProfilePoint], list[ProfilePoint], str]:
    """(fit, held out, how): interior contexts at odd positions of each batch when there are three
    or more contexts, else interior batch sizes at odd positions (all their contexts)."""
    contexts = sorted({p.context for p in points})
    batches = sorted({p.batch for p in points})
    if len(contexts) >= 3:
        held = {c for i, c in enumerate(contexts[:-1]) if i % 2 == 1}
        out = [p for p in points if p.context in held]
        how = f"contexts {sorted(held)} of every batch, from the others"
    else:
        held = {b for i, b in enumerate(batches[:-1]) if i % 2 == 1}
        out = [p for p in points if p.batch in held]
        how = f"batch sizes {sorted(held)}, from the neighbouring batches"
    return [p for p in points if p not in out], out, how


def predictor(ctx: Context) -> dict[str, Any]:
    table = ProfileTable.from_dict(ctx.needs("profile", "table"), "the profile phase")
    lp = table.layouts[0]
    fit, held, how = split_points(lp.points)
    if not held or not fit:
        from rollpacker.lab.bench.gpu.context import Skip

        raise Skip(f"{len(lp.points)} measured points: too few to hold some out")
    part = dataclasses.replace(table, layouts=(LayoutProfile(lp.layout, tuple(fit), lp.kv_capacity_tokens),))
    pred = Predictor(part)
    errs = [abs(pred.decode_step_s(lp.layout, p.batch, p.tokens) - p.decode_s) / p.decode_s for p in held]
    per = [
        {"batch": p.batch, "context": p.context, "measured_ms": 1e3 * p.decode_s, "error": e}
        for p, e in zip(held, errs, strict=True)
    ]
    mean = sum(errs) / len(errs)
    return {
        "held_out": how,
        "fit_points": len(fit),
        "held_out_points": len(held),
        "mean_abs_error": mean,
        "max_abs_error": max(errs),
        "points": per,
        "headline": f"{mean:.1%} mean error on {len(held)} held-out points (PAT reports 3-4 %)",
    }
