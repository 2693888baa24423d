"""The throughput table every rollout benchmark prints (``rollout-replay``, ``whatif``, ``whatif-papers``):
both throughputs side by side, named so that neither is read as the other (``core.metrics.Throughput``).

- **out tok/s (all)**: every token the engine generated per rollout second, terminated, scavenged
  and cached ones included: SortedRL's "output tokens per second" (arXiv:2603.23414, section 4.4.1);
- **trained tok/s**: the tokens of the trained responses per rollout second, and **s/trained step**:
  what rollpacker's speedups compare;
- **bubble (Q)**: SortedRL's eq. 4 with Q = the engine's running capacity (``max_num_seqs`` per replica);
- **wasted**: the share of the generated tokens thrown away.
"""

from __future__ import annotations

from typing import Any

from rollpacker.lab.bench.tables import legend

THROUGHPUT_LEGEND = (
    (
        "out tok/s (all)",
        "output tokens per rollout second counting every generated token, terminated and cached ones "
        "included (SortedRL's 'output tokens per second', arXiv:2603.23414 sec. 4.4.1)",
    ),
    ("out x", "this arm's out tok/s (all) over the baseline's (the first row)"),
    ("trained tok/s", "tokens of the trained responses per rollout second (what an update gets)"),
    ("trained x", "this arm's trained tok/s over the baseline's"),
    ("s/trained step", "rollout seconds per trained step (rollpacker's speedups compare these)"),
    ("bubble (Q)", "SortedRL eq. 4 with Q = the engine's running capacity (max_num_seqs per replica)"),
    ("wasted", "tokens generated then thrown away, share of all generated"),
)


def throughput_table(rows: dict[str, dict[str, Any]], title: str) -> list[str]:
    """One line per arm (the first is the baseline of the ratios), then the legend."""
    hdr = (
        f"{'policy':<16}  {'out tok/s (all)':>15}  {'out x':>5}  {'trained tok/s':>13}  {'trained x':>9}  "
        f"{'s/trained step':>14}  {'bubble (Q)':>10}  {'wasted':>6}"
    )
    lines = [title, hdr, "-" * len(hdr)]
    base = next(iter(rows.values()), {})
    for name, r in rows.items():
        lines.append(
            f"{name:<16}  {r['output_tokens_per_s']:>15.1f}  {_x(r, base, 'output_tokens_per_s'):>5}  "
            f"{r['trained_tokens_per_s']:>13.1f}  {_x(r, base, 'trained_tokens_per_s'):>9}  "
            f"{r['s_per_trained_step']:>14.3f}  {r['bubble_ratio']:>10.1%}  {r['wasted_share']:>6.1%}"
        )
    return lines + legend(THROUGHPUT_LEGEND)


def _x(row: dict[str, Any], base: dict[str, Any], key: str) -> str:
    return f"{row[key] / base[key]:.2f}" if base[key] else "-"
