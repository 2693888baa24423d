"""Calibrate the what-if roofline from a ``bench gpu`` JSON: a measured spec for ``whatif --hardware``.

The roofline (``core.costmodel.RooflineCost``) prices a decode step as
``overhead + max(bytes / (bw * bandwidth_efficiency), flops / (peak * compute_efficiency))``. The
shipped GPU specs assume the efficiencies and the overhead; this fits them (a log-spaced grid search over
the two efficiencies in [0.001, 1], the overhead per pair the median residual, 0 or the base's) to
the profile phase's measured steps, minimising the mean relative error over the points (the
base spec's own values are a candidate: the fit is never worse than them on the mean). Peaks stay
the datasheet's (the shipped spec of the probed GPU), or the probe's measured ceilings where no
spec matches (the CPU). The spec written is the base spec with those three fields replaced and
their ``sources`` saying so; GPUs not measured keep their assumed specs.

``python -m rollpacker.lab.bench.gpu calibrate RESULT.json --out DIR`` (or ``rollpacker lab bench
gpu-calibrate``) writes ``DIR/<name>.yaml`` (and ``DIR/<model>.yaml`` when the model is not a
shipped one) and ``DIR/calibration.json``: the roofline's error per batch size before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from rollpacker.core.costmodel import HardwareSpec, ModelSpec, RooflineCost
from rollpacker.core.errors import RollpackerError
from rollpacker.core.latency import ProfilePoint, ProfileTable

GRID = tuple(10 ** (-3 + 3 * i / 47) for i in range(48))  # efficiencies 0.001 .. 1.0, log-spaced


def errors_by_batch(cost: RooflineCost, points: tuple[ProfilePoint, ...]) -> dict[int, float]:
    """Mean |roofline - measured| / measured per batch size."""
    by: dict[int, list[float]] = {}
    for p in points:
        by.setdefault(p.batch, []).append(abs(cost.decode_s(p.batch, p.tokens) - p.decode_s) / p.decode_s)
    return {b: sum(v) / len(v) for b, v in sorted(by.items())}


def _mean_error(cost: RooflineCost, points: tuple[ProfilePoint, ...]) -> float:
    return sum(abs(cost.decode_s(p.batch, p.tokens) - p.decode_s) / p.decode_s for p in points) / len(points)


def fit(base: HardwareSpec, model: ModelSpec, points: tuple[ProfilePoint, ...]) -> HardwareSpec:
    """``base`` with the efficiencies and step overhead that best fit ``points`` (see the docstring).
    ``base``'s own three values are among the candidates, so the fit is never worse than them on
    the mean error."""
    if not points:
        raise RollpackerError("calibrate: no profile points to fit")
    own = (base.bandwidth_efficiency, base.compute_efficiency)
    best = (_mean_error(RooflineCost(base, model, 1), points), base)
    for bw, fl in [own, *((b, f) for b in GRID for f in GRID)]:
        hw = dataclasses.replace(base, bandwidth_efficiency=bw, compute_efficiency=fl, step_overhead_s=0.0)
        bare = RooflineCost(hw, model, 1)
        median = statistics.median(p.decode_s - bare.decode_s(p.batch, p.tokens) for p in points)
        for over in {max(0.0, median), base.step_overhead_s, 0.0}:
            cand = dataclasses.replace(hw, step_overhead_s=over)
            err = _mean_error(RooflineCost(cand, model, 1), points)
            if err < best[0]:
                best = (err, cand)
    return best[1]


def _base(doc: dict[str, Any]) -> tuple[HardwareSpec, ModelSpec, str]:
    from rollpacker.lab.bench.gpu.analysis import measured_hardware
    from rollpacker.lab.bench.gpu.decode import model_spec
    from rollpacker.lab.bench.whatif.specfiles import load_hardware

    probe = doc["phases"].get("probe", {})
    if probe.get("status") != "ok":
        raise RollpackerError("calibrate: the JSON's probe phase did not run ok; re-run `bench gpu`")
    model = model_spec(bool(doc["tiny"]))
    if probe.get("spec"):
        return load_hardware(probe["spec"]), model, f"{probe['spec']}-measured"
    return measured_hardware(probe, "cpu-measured"), model, "cpu-measured"


def _scalar(v: Any) -> str:
    """JSON scalars are YAML scalars, except that YAML 1.1 reads ``1e-05`` as a string: floats
    always carry a decimal point."""
    if isinstance(v, float) and not isinstance(v, bool):
        mant, _, exp = repr(v).partition("e")
        mant = mant if "." in mant else mant + ".0"
        return mant + (f"e{int(exp):+03d}" if exp else "")
    return json.dumps(v)


def _yaml(d: dict[str, Any], header: str) -> str:
    """A flat spec as YAML (JSON scalars are YAML scalars); ``sources`` as a nested mapping."""
    lines = [f"# {header}"]
    for k, v in d.items():
        if k == "sources":
            lines.append("sources:")
            lines += [f"  {sk}: {json.dumps(sv)}" for sk, sv in v.items()]
        else:
            lines.append(f"{k}: {_scalar(v)}")
    return "\n".join(lines) + "\n"


def calibrate(result: Path, out: Path) -> dict[str, Any]:
    """Fit, write the spec file(s) and ``calibration.json``; returns the calibration report."""
    doc = json.loads(result.read_text())
    prof = doc.get("phases", {}).get("profile", {})
    if prof.get("status") != "ok":
        raise RollpackerError(
            f"{result}: its profile phase did not run ok ({prof.get('status')}); nothing to fit"
        )
    table = ProfileTable.from_dict(prof["table"], str(result))
    points = table.layouts[0].points
    base, model, name = _base(doc)
    fitted = dataclasses.replace(fit(base, model, points), name=name)
    why = f"fitted to {len(points)} decode points of {result.name} (rollpacker lab bench gpu calibrate)"
    fitted = dataclasses.replace(
        fitted,
        sources={
            **fitted.sources,
            **{k: why for k in ("bandwidth_efficiency", "compute_efficiency", "step_overhead_s")},
        },
    )
    out.mkdir(parents=True, exist_ok=True)
    hw_path = out / f"{name}.yaml"
    hw_path.write_text(
        _yaml(dataclasses.asdict(fitted), f"{name}: calibrated from {result} ({table.hardware})")
    )
    model_ref = model.name
    if doc["tiny"]:  # not a shipped model: write its spec beside the hardware's
        fields = [k for k in dataclasses.asdict(model) if k not in ("name", "sources")]
        m = dataclasses.asdict(model) | {
            "sources": dict.fromkeys(fields, "the tiny model of bench/gpu/decode.py")
        }
        model_path = out / f"{model.name}.yaml"
        model_path.write_text(_yaml(m, "the tiny model of rollpacker lab bench gpu --tiny"))
        model_ref = str(model_path)
    before = errors_by_batch(RooflineCost(base, model, 1), points)
    after = errors_by_batch(RooflineCost(fitted, model, 1), points)
    report = {
        "result": str(result),
        "hardware_spec": str(hw_path),
        "model": model_ref,
        "fitted": {
            k: getattr(fitted, k) for k in ("bandwidth_efficiency", "compute_efficiency", "step_overhead_s")
        },
        "assumed": {
            k: getattr(base, k) for k in ("bandwidth_efficiency", "compute_efficiency", "step_overhead_s")
        },
        "error_by_batch": [{"batch": b, "before": before[b], "after": after[b]} for b in before],
        "whatif": f"rollpacker lab whatif --hardware {hw_path} --model {model_ref} --tp 1 --gpus 1",
    }
    (out / "calibration.json").write_text(json.dumps(report, indent=1))
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"{'batch':>5}  {'roofline error before':>21}  {'after':>7}"]
    lines += [f"{r['batch']:>5}  {r['before']:>21.1%}  {r['after']:>7.1%}" for r in report["error_by_batch"]]
    f = report["fitted"]
    lines.append(
        f"fitted: bandwidth_efficiency {f['bandwidth_efficiency']:.3f}, compute_efficiency "
        f"{f['compute_efficiency']:.3f}, step_overhead_s {f['step_overhead_s'] * 1e3:.2f} ms"
    )
    lines.append(f"wrote {report['hardware_spec']}; try: {report['whatif']}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rollpacker.lab.bench.gpu calibrate", description=__doc__)
    p.add_argument("result", type=Path, help="the bench's bench-gpu.json")
    p.add_argument("--out", type=Path, required=True, help="directory for the spec file(s)")
    a = p.parse_args(argv)
    try:
        report = calibrate(a.result, a.out)
    except (RollpackerError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(report))
    return 0
