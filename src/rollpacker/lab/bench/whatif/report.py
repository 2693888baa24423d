"""The what-if report in print (tables at most ``MAX_COLUMNS`` wide, each with a legend) and as a plot
of the tail-batching speedup surface over (eta_p, eta_r)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rollpacker.lab.bench.tables import legend, wrap
from rollpacker.lab.bench.throughput import throughput_table

_POLICY_LEGEND = (
    ("steps", "trained RL steps simulated (each trains P0 prompts x R0 responses)"),
    ("s/step", "simulated rollout seconds per trained step"),
    ("speedup", "sync's s/step / this policy's (> 1 = faster than sync); - = not comparable"),
    ("bubble", "bubble ratio (SortedRL eq. 4): share of the engine's request slots left idle"),
    ("wasted", "tokens generated then thrown away (aborted responses), share of all generated"),
    ("lag", "token-weighted policy lag of the trained tokens (0 = on-policy)"),
    ("preempt", "KV-cache preemptions (the cost model's KV capacity)"),
)

_GRID_LEGEND = (
    ("eta_p/eta_r", "prompt / response speculation factors (1.0 = none)"),
    ("sync s/step", "synchronous baseline, simulated rollout seconds per step"),
    ("tb s/step", "tail batching, simulated rollout seconds per step"),
    ("speedup", "sync s/step / tail-batching s/step"),
    ("ms/sample", "tail-batching rollout milliseconds per trained response (comparable across P0)"),
    ("wasted", "share of tail batching's generated tokens thrown away"),
)


def render(report: dict[str, Any]) -> str:
    t = report["trace"]
    c = report["config"]
    lines = wrap(
        "what-if: SIMULATED rollout (real policies and driver on a virtual clock priced by a cost model); "
        "no second below is a measurement"
    )
    lines += [
        "",
        *wrap(
            f"trace {t['source']}: {t['prompts']} prompts; response length max {t['max']:.0f}, "
            f"P75 {t['p75']:.0f}, median {t['p50']:.0f}"
        ),
        *wrap(
            f"P0={c['p0']} R0={c['r0']} eta_p={c['eta_p']} eta_r={c['eta_r']} "
            f"max_tokens={c['max_tokens']} periods={c['periods']}"
        ),
    ]
    for d in report["deployments"]:
        lines += _deployment_lines(d)
    for name, rows in report["policies"].items():
        lines += ["", f"policies on {name}:", *_policy_table(rows)]
    lines += legend(_POLICY_LEGEND)
    for name, rows in report["policies"].items():
        q = next((d["concurrency_per_replica"] for d in report["deployments"] if d["name"] == name), "?")
        lines += ["", *throughput_table(rows, f"throughput on {name} (SIMULATED; Q = {q} per replica):")]
    lines += ["", *_grid_lines(report["best_eta"], report["recommended"], report["tp_ranking"])]
    lines += ["", f"runtime {report['runtime_s']:.1f} s"]
    return "\n".join(lines)


def _deployment_lines(d: dict[str, Any]) -> list[str]:
    curve = ", ".join(f"B={p['batch']} {p['step_ms']:.2f} ms" for p in d["decode_curve"])
    return [
        "",
        *wrap(
            f"{d['name']}: {d['cost_model']}; {d['dp']} replica(s) x {d['concurrency_per_replica']} slots, "
            f"KV {d['kv_capacity_tokens_per_replica']:,} tokens per replica",
        ),
        *wrap(f"decode step per replica (1024 context tokens a request): {curve}", indent="  "),
    ]


def _policy_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    hdr = (
        f"{'policy':<14}  {'steps':>5}  {'s/step':>9}  {'speedup':>7}  {'bubble':>6}  {'wasted':>6}  "
        f"{'lag':>5}  {'preempt':>7}"
    )
    lines = [hdr, "-" * len(hdr)]
    for name, r in rows.items():
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        lines.append(
            f"{name:<14}  {r['steps']:>5}  {r['rollout_s_per_step']:>9.3f}  {sp:>7}  "
            f"{r['bubble_ratio']:>6.1%}  "
            f"{r['wasted_share']:>6.1%}  {r['policy_lag']:>5.2f}  {r['preemptions']:>7}"
        )
    notes = [f"note: {n}: {r['speedup_note']}" for n, r in rows.items() if r["speedup_note"]]
    return lines + [x for n in notes for x in wrap(n)]


def _grid_lines(
    best: Sequence[dict[str, Any]], rec: dict[str, Any], ranking: Sequence[dict[str, Any]]
) -> list[str]:
    hdr = (
        f"{'deployment':<10}  {'P0':>4}  {'eta_p/eta_r':>11}  {'sync s/step':>11}  {'tb s/step':>9}  "
        f"{'speedup':>7}  {'ms/sample':>9}  {'wasted':>6}"
    )
    lines = ["best speculation per deployment and P0 (grid):", hdr, "-" * len(hdr)]
    for c in best:
        lines.append(
            f"{c['deployment']:<10}  {c['p0']:>4}  {c['eta_p']:>5}/{c['eta_r']:<5}  "
            f"{c['sync_s_per_step']:>11.3f}  "
            f"{c['rollout_s_per_step']:>9.3f}  {c['speedup']:>6.2f}x  {1e3 * c['s_per_sample']:>9.2f}  "
            f"{c['wasted_share']:>6.1%}"
        )
    lines += legend(_GRID_LEGEND)
    ranks = ", ".join(f"TP {r['tp']} {r['mean_tb_s_per_step']:.3g} s" for r in ranking)
    lines += ["", *wrap(f"TPs by tail batching's mean s/step over the grid at the given P0: {ranks}")]
    lines += wrap(f"recommended: {rec['why']}")
    return lines


def plot(report: dict[str, Any], path: Path) -> Path:
    """Heat maps of tail batching's simulated speedup over (eta_p, eta_r): one panel per deployment
    and P0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["grid"]
    panels = sorted({(c["deployment"], c["p0"]) for c in cells})
    eps = sorted({c["eta_p"] for c in cells})
    ers = sorted({c["eta_r"] for c in cells})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (dep, p0) in zip(axes[0], panels, strict=True):
        z = [[_speedup_at(cells, dep, p0, ep, er) for er in ers] for ep in eps]
        im = ax.imshow(z, origin="lower", cmap="viridis", aspect="auto")
        for i, row in enumerate(z):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w", fontsize=9)
        ax.set_xticks(range(len(ers)), [str(x) for x in ers])
        ax.set_yticks(range(len(eps)), [str(x) for x in eps])
        ax.set(xlabel="eta_r", ylabel="eta_p", title=f"{dep}, P0={p0}")
        fig.colorbar(im, ax=ax, label="tail-batching speedup over sync")
    fig.suptitle("what-if (simulated): rollout speedup surface", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _speedup_at(cells: Sequence[dict[str, Any]], dep: str, p0: int, ep: float, er: float) -> float:
    for c in cells:
        if (c["deployment"], c["p0"], c["eta_p"], c["eta_r"]) == (dep, p0, ep, er):
            return float(c["speedup"] or 0.0)
    return float("nan")
