"""Plain-text layout of the benchmarks' printed tables: at most ``MAX_COLUMNS`` characters a line,
prose wrapped, and a legend below each table that says what every column means, units included.

Every line ``wrap`` and ``legend`` return is at most ``MAX_COLUMNS`` characters long (a single word
longer than that is broken); ``clip`` keeps a table cell to its column's width.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

MAX_COLUMNS = 120


def wrap(text: str, indent: str = "") -> list[str]:
    """``text`` wrapped to ``MAX_COLUMNS``, its continuation lines indented two more spaces."""
    return textwrap.wrap(
        text,
        width=MAX_COLUMNS,
        initial_indent=indent,
        subsequent_indent=indent + "  ",
        break_on_hyphens=False,
    )


def legend(entries: Sequence[tuple[str, str]], indent: str = "") -> list[str]:
    """``legend:`` then one ``term  meaning`` entry per column, the terms aligned and the meanings
    wrapped under each other."""
    term_w = max(len(term) for term, _ in entries)
    hang = indent + " " * (term_w + 4)
    lines = [f"{indent}legend:"]
    for term, meaning in entries:
        lines += textwrap.wrap(
            meaning,
            width=MAX_COLUMNS,
            initial_indent=f"{indent}  {term:<{term_w}}  ",
            subsequent_indent=hang,
            break_on_hyphens=False,
        )
    return lines


def clip(text: str, width: int) -> str:
    """``text`` cut to ``width`` (>= 3) characters, ending in ``...`` where it was cut."""
    return text if len(text) <= width else text[: max(0, width - 3)] + "..."
